package org.flowerbed.phone;

import java.io.BufferedReader;
import java.io.File;
import java.io.FileInputStream;
import java.io.IOException;
import java.io.InputStreamReader;
import java.io.Reader;
import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.List;

/** Labelled float feature vectors, the phone's local data. */
public final class Dataset {
  private final float[][] features;
  private final int[] labels;

  /**
   * @throws IllegalArgumentException if empty, ragged, or a label is negative
   */
  public Dataset(float[][] features, int[] labels) {
    if (features.length == 0 || features.length != labels.length) {
      throw new IllegalArgumentException(
          "need as many labels as feature rows and at least one, got "
              + features.length
              + " rows and "
              + labels.length
              + " labels");
    }
    int width = features[0].length;
    for (int i = 0; i < features.length; i++) {
      if (features[i].length != width) {
        throw new IllegalArgumentException(
            "row " + i + " has " + features[i].length + " features, row 0 has " + width);
      }
      if (labels[i] < 0) {
        throw new IllegalArgumentException("row " + i + " has negative label " + labels[i]);
      }
    }
    this.features = features;
    this.labels = labels;
  }

  /** Read a CSV file of rows {@code label,f1,f2,...}. */
  public static Dataset readCsv(File file) throws IOException {
    Reader reader = new InputStreamReader(new FileInputStream(file), StandardCharsets.UTF_8);
    try {
      return readCsv(reader, file.getPath());
    } finally {
      reader.close();
    }
  }

  /**
   * Read rows {@code label,f1,f2,...}: an integer label >= 0 then float features, all rows the same
   * width. Blank lines are skipped.
   *
   * @param source name used in error messages
   * @throws IOException naming the source and line of the first bad row
   */
  public static Dataset readCsv(Reader reader, String source) throws IOException {
    BufferedReader in = new BufferedReader(reader);
    List<float[]> rows = new ArrayList<float[]>();
    List<Integer> labels = new ArrayList<Integer>();
    String line;
    int lineNo = 0;
    while ((line = in.readLine()) != null) {
      lineNo++;
      if (line.trim().isEmpty()) {
        continue;
      }
      String[] cells = line.split(",", -1);
      String where = source + ":" + lineNo;
      if (cells.length < 2) {
        throw new IOException(where + ": expected 'label,f1,f2,...', got '" + line + "'");
      }
      int label;
      try {
        label = Integer.parseInt(cells[0].trim());
      } catch (NumberFormatException e) {
        throw new IOException(where + ": label '" + cells[0] + "' is not an integer");
      }
      if (label < 0) {
        throw new IOException(where + ": label " + label + " is negative");
      }
      float[] x = new float[cells.length - 1];
      for (int j = 1; j < cells.length; j++) {
        try {
          x[j - 1] = Float.parseFloat(cells[j].trim());
        } catch (NumberFormatException e) {
          throw new IOException(where + ": feature " + j + " '" + cells[j] + "' is not a number");
        }
      }
      if (!rows.isEmpty() && x.length != rows.get(0).length) {
        throw new IOException(
            where + ": " + x.length + " features, the first row has " + rows.get(0).length);
      }
      rows.add(x);
      labels.add(label);
    }
    if (rows.isEmpty()) {
      throw new IOException(source + ": no rows");
    }
    int[] y = new int[labels.size()];
    for (int i = 0; i < y.length; i++) {
      y[i] = labels.get(i);
    }
    return new Dataset(rows.toArray(new float[0][]), y);
  }

  public int size() {
    return labels.length;
  }

  public int numFeatures() {
    return features[0].length;
  }

  /** One more than the largest label. */
  public int numClassesSeen() {
    int max = 0;
    for (int y : labels) {
      max = Math.max(max, y);
    }
    return max + 1;
  }

  public float[] features(int i) {
    return features[i];
  }

  public int label(int i) {
    return labels[i];
  }
}
