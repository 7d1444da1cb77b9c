package org.flowerbed.phone;

import java.util.ArrayList;
import java.util.Arrays;
import java.util.HashMap;
import java.util.List;
import java.util.Map;

/**
 * A {@link Trainer} on an ExecuTorch training program (from {@code flowerbed export-android}),
 * run by a {@link ProgramRunner}. Every decision is here, tested on the JVM: which arrays are
 * parameters and which are state, batch sizes within the program's bounds, carrying the state
 * (batch-norm running statistics) from each step to the next, and evaluating with the program's
 * evaluation method, without a backward pass, on the weights the phone holds.
 */
public final class ProgramTrainer implements Trainer {
  /** The training method's name in every flowerbed program. */
  public static final String TRAIN_METHOD = "forward";

  private final ProgramRunner runner;
  private final ProgramInfo info;
  private final Dataset data;
  private final long[] sampleShape;
  private final int sampleSize;
  private MinibatchSampler sampler;
  private final Map<String, float[]> state = new HashMap<String, float[]>();
  private List<NamedArray> layout = new ArrayList<NamedArray>();

  /**
   * @param seed seed of this task's minibatches (each phone and task has its own)
   * @throws IllegalArgumentException starting "program:" if the program names no input shape or
   *     batch size, its samples do not fit the local data, or the data has fewer examples than
   *     the program's smallest batch
   */
  public ProgramTrainer(ProgramRunner runner, ProgramInfo info, Dataset data, long seed) {
    if (info.sampleShape() == null || info.maxBatchSize() < 1) {
      throw new IllegalArgumentException(
          "program: '" + info.name() + "' names no input shape or batch size; export it again");
    }
    long size = 1;
    for (long d : info.sampleShape()) {
      size *= d;
    }
    if (size != data.numFeatures()) {
      throw new IllegalArgumentException(
          "program: '"
              + info.name()
              + "' takes samples of shape "
              + Arrays.toString(info.sampleShape())
              + " ("
              + size
              + " values) but the local data rows have "
              + data.numFeatures()
              + " features");
    }
    if (data.size() < info.minBatchSize()) {
      throw new IllegalArgumentException(
          "program: '"
              + info.name()
              + "' trains batches of at least "
              + info.minBatchSize()
              + " examples (batch norm) but this phone has "
              + data.size());
    }
    this.runner = runner;
    this.info = info;
    this.data = data;
    this.sampleShape = info.sampleShape();
    this.sampleSize = (int) size;
    this.sampler = new MinibatchSampler(data.size(), seed);
  }

  /** Draw the next task's minibatches with {@code seed}. */
  public void reseed(long seed) {
    sampler = new MinibatchSampler(data.size(), seed);
  }

  /**
   * Load the global model: the parameters into the program, the state kept here.
   *
   * @throws IllegalArgumentException starting "program:" if the arrays are not exactly the
   *     program's parameters and state, or the loaded program's parameters are not those its
   *     metadata describes
   */
  @Override
  public void setParameters(List<NamedArray> arrays) {
    info.checkArrays(arrays);
    Map<String, long[]> held = runner.parameterShapes();
    List<String> wrong = new ArrayList<String>();
    for (String name : info.parameterNames()) {
      long[] have = held.get(name);
      int[] want = info.shapeOf(name);
      if (have == null || !sameShape(have, want)) {
        wrong.add(name + (have == null ? " (absent)" : " " + Arrays.toString(have)));
      }
    }
    if (!wrong.isEmpty() || held.size() != info.parameterNames().size()) {
      throw new IllegalArgumentException(
          "program: the loaded program's parameters "
              + held.keySet()
              + " are not those its metadata describes: "
              + wrong);
    }
    Map<String, NamedArray> byName = new HashMap<String, NamedArray>();
    for (NamedArray a : arrays) {
      byName.put(a.name(), a);
    }
    List<NamedArray> params = new ArrayList<NamedArray>();
    for (String name : info.parameterNames()) {
      params.add(byName.get(name));
    }
    runner.writeParameters(params);
    state.clear();
    for (String name : info.stateNames()) {
      state.put(name, byName.get(name).data().clone());
    }
    layout = new ArrayList<NamedArray>(arrays);
  }

  /** The parameters (read from the program) and the state, in the order they were received. */
  @Override
  public List<NamedArray> getParameters() {
    List<NamedArray> out = new ArrayList<NamedArray>();
    for (NamedArray a : layout) {
      float[] values = state.containsKey(a.name()) ? state.get(a.name()) : runner.readParameter(a.name());
      out.add(new NamedArray(a.name(), a.shape(), values.clone()));
    }
    return out;
  }

  @Override
  public int numExamples() {
    return data.size();
  }

  /**
   * One step on the next minibatch of {@code batchSize} examples, raised to the program's smallest
   * batch and capped at its largest (and at the local data); the state the step returns feeds the
   * next step.
   *
   * @throws IllegalStateException if the program returns other outputs than its metadata says
   */
  @Override
  public StepResult step(int batchSize, double lr) {
    int batch = Math.min(Math.max(batchSize, info.minBatchSize()), info.maxBatchSize());
    int[] idx = sampler.next(batch);
    float[][] out = runner.trainStep(TRAIN_METHOD, samples(idx), shape(idx.length), labels(idx), stateArrays(), lr);
    List<String> names = info.stateNames();
    if (out.length != 2 + names.size() || out[0].length != 1) {
      throw new IllegalStateException(
          "program '"
              + info.name()
              + "' returned "
              + out.length
              + " outputs, expected the loss, the logits and "
              + names.size()
              + " state arrays");
    }
    for (int i = 0; i < names.size(); i++) {
      float[] updated = out[2 + i];
      if (updated.length != state.get(names.get(i)).length) {
        throw new IllegalStateException(
            "program '" + info.name() + "' returned " + names.get(i) + " with " + updated.length + " values");
      }
      state.put(names.get(i), updated.clone());
    }
    return new StepResult(idx.length, out[0][0]);
  }

  /**
   * Mean loss and accuracy over the local data, in batches of the program's largest size, with
   * the evaluation method on the weights the program holds now and the current state.
   *
   * @throws IllegalArgumentException starting "program:" if the program has no evaluation method
   */
  @Override
  public Evaluation evaluate() {
    String method = info.evaluateMethod();
    if (method == null) {
      throw new IllegalArgumentException(
          "program: '"
              + info.name()
              + "' has no evaluation method (exported by an older flowerbed); export it again");
    }
    List<NamedArray> inputs = new ArrayList<NamedArray>();
    for (String name : info.parameterNames()) {
      inputs.add(new NamedArray(name, info.shapeOf(name), runner.readParameter(name)));
    }
    inputs.addAll(stateArrays());
    double lossSum = 0;
    int correct = 0;
    for (int start = 0; start < data.size(); start += info.maxBatchSize()) {
      int b = Math.min(info.maxBatchSize(), data.size() - start);
      int[] idx = new int[b];
      for (int k = 0; k < b; k++) {
        idx[k] = start + k;
      }
      float[][] out = runner.evaluate(method, samples(idx), shape(b), labels(idx), inputs);
      if (out.length != 2 || out[0].length != 1 || out[1].length % b != 0 || out[1].length == 0) {
        throw new IllegalStateException(
            "program '" + info.name() + "' evaluation returned no loss and [" + b + ", classes] logits");
      }
      lossSum += b * (double) out[0][0];
      correct += countCorrect(out[1], idx);
    }
    return new Evaluation(data.size(), lossSum / data.size(), (double) correct / data.size());
  }

  /** Examples whose largest logit is their label (the first largest on ties, as argmax). */
  private int countCorrect(float[] logits, int[] idx) {
    int classes = logits.length / idx.length;
    int correct = 0;
    for (int k = 0; k < idx.length; k++) {
      int best = 0;
      for (int c = 1; c < classes; c++) {
        if (logits[k * classes + c] > logits[k * classes + best]) {
          best = c;
        }
      }
      if (best == data.label(idx[k])) {
        correct++;
      }
    }
    return correct;
  }

  private List<NamedArray> stateArrays() {
    List<NamedArray> out = new ArrayList<NamedArray>();
    for (String name : info.stateNames()) {
      out.add(new NamedArray(name, info.shapeOf(name), state.get(name)));
    }
    return out;
  }

  private float[] samples(int[] idx) {
    float[] x = new float[idx.length * sampleSize];
    for (int k = 0; k < idx.length; k++) {
      System.arraycopy(data.features(idx[k]), 0, x, k * sampleSize, sampleSize);
    }
    return x;
  }

  private long[] labels(int[] idx) {
    long[] y = new long[idx.length];
    for (int k = 0; k < idx.length; k++) {
      y[k] = data.label(idx[k]);
    }
    return y;
  }

  private long[] shape(int batch) {
    long[] s = new long[sampleShape.length + 1];
    s[0] = batch;
    System.arraycopy(sampleShape, 0, s, 1, sampleShape.length);
    return s;
  }

  private static boolean sameShape(long[] a, int[] b) {
    if (b == null || a.length != b.length) {
      return false;
    }
    for (int i = 0; i < a.length; i++) {
      if (a[i] != b[i]) {
        return false;
      }
    }
    return true;
  }
}
