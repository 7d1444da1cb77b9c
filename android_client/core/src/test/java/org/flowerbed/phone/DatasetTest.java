package org.flowerbed.phone;

import static org.junit.Assert.assertArrayEquals;
import static org.junit.Assert.assertEquals;
import static org.junit.Assert.fail;

import java.io.IOException;
import java.io.StringReader;
import org.junit.Test;

public class DatasetTest {
  @Test
  public void readsLabelThenFeatures() throws IOException {
    Dataset d = Dataset.readCsv(new StringReader("1,0.5,-2\n\n0, 3 ,4e-1\n"), "t.csv");
    assertEquals(2, d.size());
    assertEquals(2, d.numFeatures());
    assertEquals(2, d.numClassesSeen());
    assertEquals(1, d.label(0));
    assertArrayEquals(new float[] {3f, 0.4f}, d.features(1), 0f);
  }

  private static void assertBad(String csv, String message) {
    try {
      Dataset.readCsv(new StringReader(csv), "t.csv");
      fail("expected IOException " + message);
    } catch (IOException e) {
      assertEquals(message, e.getMessage());
    }
  }

  @Test
  public void namesTheLineOfABadRow() {
    assertBad("1,2\nx,3\n", "t.csv:2: label 'x' is not an integer");
    assertBad("1,2\n0,y\n", "t.csv:2: feature 1 'y' is not a number");
    assertBad("1,2\n0,1,2\n", "t.csv:2: 2 features, the first row has 1");
    assertBad("-1,2\n", "t.csv:1: label -1 is negative");
    assertBad("3\n", "t.csv:1: expected 'label,f1,f2,...', got '3'");
    assertBad("\n", "t.csv: no rows");
  }
}
