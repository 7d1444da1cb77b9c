package org.flowerbed.app;

import java.io.File;
import java.nio.FloatBuffer;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.List;
import java.util.Map;
import org.flowerbed.phone.Dataset;
import org.flowerbed.phone.MinibatchSampler;
import org.flowerbed.phone.NamedArray;
import org.flowerbed.phone.Trainer;
import org.pytorch.executorch.DType;
import org.pytorch.executorch.EValue;
import org.pytorch.executorch.Tensor;
import org.pytorch.executorch.training.SGD;
import org.pytorch.executorch.training.TrainingModule;

/**
 * core's {@link Trainer} on ExecuTorch's on-device training runtime.
 *
 * <p>The program comes from {@code flowerbed export-android}: one joint method {@code forward}
 * taking float32 samples {@code [batch, ...sampleShape]} and int64 labels {@code [batch]} (batch
 * from 1 to the exported maximum) and returning the mean cross-entropy loss and the logits; the
 * runtime keeps the gradients, which {@link TrainingModule#namedGradients} hands to {@link SGD}.
 * Parameters are named by the torch model's state_dict keys, the Flower array names, so the global
 * model is written into the program by name: {@code namedParameters} returns tensors that wrap the
 * program's own parameter memory, and their {@code getRawDataBuffer()} (public since ExecuTorch
 * 1.4) is written in place.
 */
final class ExecuTorchTrainer implements Trainer {
  static final String METHOD = "forward";

  private final TrainingModule module;
  private final Dataset data;
  private final long[] sampleShape;
  private final int sampleSize;
  private final int maxBatchSize;
  private MinibatchSampler sampler;
  private List<NamedArray> layout = new ArrayList<NamedArray>();
  private SGD sgd;
  private double sgdLr = Double.NaN;

  /**
   * Load the program.
   *
   * @throws IllegalArgumentException if the data's feature count is not the product of the sample
   *     shape
   * @throws RuntimeException from ExecuTorch if the file is missing or not a program
   */
  /** Draw the next task's minibatches with {@code seed} (each phone and task has its own). */
  void reseed(long seed) {
    sampler = new MinibatchSampler(data.size(), seed);
  }

  static ExecuTorchTrainer load(
      File pte, Dataset data, long[] sampleShape, int maxBatchSize, long seed) {
    long size = 1;
    for (long d : sampleShape) {
      size *= d;
    }
    if (size != data.numFeatures()) {
      throw new IllegalArgumentException(
          "sample shape "
              + Arrays.toString(sampleShape)
              + " holds "
              + size
              + " values but the data rows have "
              + data.numFeatures()
              + " features");
    }
    return new ExecuTorchTrainer(
        TrainingModule.load(pte.getAbsolutePath()),
        data,
        sampleShape,
        (int) size,
        maxBatchSize,
        seed);
  }

  private ExecuTorchTrainer(
      TrainingModule module,
      Dataset data,
      long[] sampleShape,
      int sampleSize,
      int maxBatchSize,
      long seed) {
    this.module = module;
    this.data = data;
    this.sampleShape = sampleShape.clone();
    this.sampleSize = sampleSize;
    this.maxBatchSize = maxBatchSize;
    this.sampler = new MinibatchSampler(data.size(), seed);
  }

  @Override
  public void setParameters(List<NamedArray> arrays) {
    Map<String, Tensor> params = module.namedParameters(METHOD);
    List<String> names = new ArrayList<String>();
    for (NamedArray a : arrays) {
      names.add(a.name());
    }
    if (params.size() != arrays.size() || !params.keySet().containsAll(names)) {
      throw new IllegalArgumentException(
          "the program has parameters " + params.keySet() + " but the task sends " + names);
    }
    for (NamedArray a : arrays) {
      Tensor t = params.get(a.name());
      long[] shape = t.shape();
      int[] want = a.shape();
      boolean same = shape.length == want.length && t.dtype() == DType.FLOAT;
      for (int i = 0; same && i < shape.length; i++) {
        same = shape[i] == want[i];
      }
      if (!same) {
        throw new IllegalArgumentException(
            "program parameter "
                + a.name()
                + " is "
                + t.dtype()
                + Arrays.toString(shape)
                + ", the task sends float32"
                + Arrays.toString(want));
      }
    }
    for (NamedArray a : arrays) {
      FloatBuffer buf = (FloatBuffer) params.get(a.name()).getRawDataBuffer();
      buf.rewind();
      buf.put(a.data());
    }
    layout = new ArrayList<NamedArray>(arrays);
  }

  @Override
  public List<NamedArray> getParameters() {
    Map<String, Tensor> params = module.namedParameters(METHOD);
    List<NamedArray> out = new ArrayList<NamedArray>();
    for (NamedArray a : layout) {
      out.add(new NamedArray(a.name(), a.shape(), params.get(a.name()).getDataAsFloatArray()));
    }
    return out;
  }

  @Override
  public int numExamples() {
    return data.size();
  }

  @Override
  public StepResult step(int batchSize, double lr) {
    int[] idx = sampler.next(Math.min(batchSize, maxBatchSize));
    EValue[] out = forwardBackward(idx);
    if (sgd == null || lr != sgdLr) {
      sgd = SGD.create(module.namedParameters(METHOD), lr);
      sgdLr = lr;
    }
    sgd.step(module.namedGradients(METHOD));
    return new StepResult(idx.length, out[0].toTensor().getDataAsFloatArray()[0]);
  }

  @Override
  public Evaluation evaluate() {
    // The program has only the joint method: its gradients are computed and left unused.
    double lossSum = 0;
    int correct = 0;
    for (int start = 0; start < data.size(); start += maxBatchSize) {
      int b = Math.min(maxBatchSize, data.size() - start);
      int[] idx = new int[b];
      for (int k = 0; k < b; k++) {
        idx[k] = start + k;
      }
      EValue[] out = forwardBackward(idx);
      lossSum += b * (double) out[0].toTensor().getDataAsFloatArray()[0];
      float[] logits = out[1].toTensor().getDataAsFloatArray();
      int classes = logits.length / b;
      for (int k = 0; k < b; k++) {
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
    }
    return new Evaluation(data.size(), lossSum / data.size(), (double) correct / data.size());
  }

  /** Run the joint method on the examples {@code idx}; returns (loss, logits). */
  private EValue[] forwardBackward(int[] idx) {
    float[] x = new float[idx.length * sampleSize];
    long[] y = new long[idx.length];
    for (int k = 0; k < idx.length; k++) {
      System.arraycopy(data.features(idx[k]), 0, x, k * sampleSize, sampleSize);
      y[k] = data.label(idx[k]);
    }
    long[] xShape = new long[sampleShape.length + 1];
    xShape[0] = idx.length;
    System.arraycopy(sampleShape, 0, xShape, 1, sampleShape.length);
    return module.executeForwardBackward(
        METHOD,
        EValue.from(Tensor.fromBlob(x, xShape)),
        EValue.from(Tensor.fromBlob(y, new long[] {idx.length})));
  }
}
