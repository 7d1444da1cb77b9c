package org.flowerbed.phone;

import java.util.ArrayList;
import java.util.Arrays;
import java.util.List;
import java.util.Random;

/**
 * Pure-Java trainer for small dense classifiers: mean softmax cross-entropy over a minibatch and
 * plain SGD, p <- p - lr * grad, as {@code torch.nn.CrossEntropyLoss} with {@code
 * torch.optim.SGD(lr)} and no momentum. Minibatches come from a {@link MinibatchSampler}.
 *
 * <p>Parameters are named arrays in PyTorch {@code nn.Linear} layout (weight [out, in], bias [out],
 * row-major), so the gateway can load them into the matching torch model.
 */
public abstract class DenseTrainer implements Trainer {
  protected final Dataset data;
  protected final int numClasses;
  private final List<NamedArray> params;
  private final MinibatchSampler sampler;

  /**
   * @param layout names and shapes of the parameters, in wire order; values are copied
   * @param numClasses classes of the output layer; every label must be below it
   * @param seed seed of the minibatch order
   */
  protected DenseTrainer(Dataset data, List<NamedArray> layout, int numClasses, long seed) {
    if (data.numClassesSeen() > numClasses) {
      throw new IllegalArgumentException(
          "the data has label "
              + (data.numClassesSeen() - 1)
              + " but the model has only "
              + numClasses
              + " classes");
    }
    this.data = data;
    this.numClasses = numClasses;
    this.params = new ArrayList<NamedArray>();
    for (NamedArray a : layout) {
      params.add(a.copy());
    }
    this.sampler = new MinibatchSampler(data.size(), seed);
  }

  /** Logits of one example, length {@link #numClasses}. */
  protected abstract float[] logits(float[] x);

  /**
   * Add the gradient of the loss of one example to {@code grads} (same order and sizes as the
   * parameters) and return that loss.
   */
  protected abstract double accumulateGradient(float[] x, int label, float[][] grads);

  /** The values of the parameter called {@code name}. */
  protected final float[] param(String name) {
    for (NamedArray a : params) {
      if (a.name().equals(name)) {
        return a.data();
      }
    }
    throw new IllegalStateException("no parameter " + name);
  }

  /** Index of the parameter called {@code name} in wire order. */
  protected final int indexOf(String name) {
    for (int i = 0; i < params.size(); i++) {
      if (params.get(i).name().equals(name)) {
        return i;
      }
    }
    throw new IllegalStateException("no parameter " + name);
  }

  @Override
  public final void setParameters(List<NamedArray> arrays) {
    if (arrays.size() != params.size()) {
      throw new IllegalArgumentException(
          "model has parameters " + params + " but " + arrays + " were given");
    }
    for (int i = 0; i < arrays.size(); i++) {
      if (!arrays.get(i).sameLayout(params.get(i))) {
        throw new IllegalArgumentException(
            "parameter " + i + " should be " + params.get(i) + ", got " + arrays.get(i));
      }
    }
    for (int i = 0; i < arrays.size(); i++) {
      float[] src = arrays.get(i).data();
      System.arraycopy(src, 0, params.get(i).data(), 0, src.length);
    }
  }

  @Override
  public final List<NamedArray> getParameters() {
    List<NamedArray> out = new ArrayList<NamedArray>();
    for (NamedArray a : params) {
      out.add(a.copy());
    }
    return out;
  }

  @Override
  public final int numExamples() {
    return data.size();
  }

  @Override
  public final StepResult step(int batchSize, double lr) {
    int[] batchIdx = sampler.next(batchSize);
    int batch = batchIdx.length;
    float[][] grads = new float[params.size()][];
    for (int i = 0; i < grads.length; i++) {
      grads[i] = new float[params.get(i).data().length];
    }
    double lossSum = 0;
    for (int i : batchIdx) {
      lossSum += accumulateGradient(data.features(i), data.label(i), grads);
    }
    for (int p = 0; p < grads.length; p++) {
      float[] w = params.get(p).data();
      for (int j = 0; j < w.length; j++) {
        w[j] -= (float) (lr * grads[p][j] / batch);
      }
    }
    return new StepResult(batch, lossSum / batch);
  }

  @Override
  public final Evaluation evaluate() {
    double lossSum = 0;
    int correct = 0;
    for (int i = 0; i < data.size(); i++) {
      float[] z = logits(data.features(i));
      lossSum += crossEntropy(z, data.label(i), null);
      if (argmax(z) == data.label(i)) {
        correct++;
      }
    }
    return new Evaluation(data.size(), lossSum / data.size(), (double) correct / data.size());
  }

  /**
   * Softmax cross-entropy of logits z for label y, -log softmax(z)_y, computed as logsumexp(z) -
   * z_y with the max subtracted for stability. If {@code dz} is given, it receives the gradient
   * softmax(z) - onehot(y).
   */
  protected static double crossEntropy(float[] z, int y, float[] dz) {
    double max = Double.NEGATIVE_INFINITY;
    for (float v : z) {
      max = Math.max(max, v);
    }
    double sum = 0;
    for (float v : z) {
      sum += Math.exp(v - max);
    }
    double logSumExp = max + Math.log(sum);
    if (dz != null) {
      for (int c = 0; c < z.length; c++) {
        dz[c] = (float) (Math.exp(z[c] - logSumExp) - (c == y ? 1 : 0));
      }
    }
    return logSumExp - z[y];
  }

  /**
   * The error for {@code arrays} that do not have a model's {@code layout} over {@code data}, e.g.
   * "softmax regression over 2 features needs fc.weight [classes, in], fc.bias [classes] with in =
   * 2, got [...]".
   */
  protected static IllegalArgumentException layoutError(
      String model, String layout, Dataset data, List<NamedArray> arrays) {
    return new IllegalArgumentException(
        model
            + " over "
            + data.numFeatures()
            + " features needs "
            + layout
            + " with in = "
            + data.numFeatures()
            + ", got "
            + arrays);
  }

  /**
   * One {@code nn.Linear} layer, z = W x + b, with W [out, in] row-major: z_o = b_o + sum_j W_oj
   * x_j, summed in double from j = 0 up.
   */
  protected static float[] linear(float[] w, float[] b, float[] x, int out, int in) {
    float[] z = new float[out];
    for (int o = 0; o < out; o++) {
      double s = b[o];
      for (int j = 0; j < in; j++) {
        s += w[o * in + j] * x[j];
      }
      z[o] = (float) s;
    }
    return z;
  }

  /**
   * Add the gradient of one {@link #linear} layer with output gradient {@code dz} to {@code gw} and
   * {@code gb}: gb_o += dz_o, gw_oj += dz_o x_j.
   */
  protected static void addLinearGradient(
      float[] dz, float[] x, float[] gw, float[] gb, int out, int in) {
    for (int o = 0; o < out; o++) {
      gb[o] += dz[o];
      for (int j = 0; j < in; j++) {
        gw[o * in + j] += dz[o] * x[j];
      }
    }
  }

  /**
   * Values drawn uniformly from [-1/sqrt(fanIn), 1/sqrt(fanIn)], the default initialisation of
   * PyTorch's {@code nn.Linear} (reset_parameters: kaiming_uniform with a = sqrt(5) for the weight,
   * the same bound for the bias).
   */
  protected static float[] linearInit(int count, int fanIn, Random random) {
    float bound = (float) (1 / Math.sqrt(fanIn));
    float[] v = new float[count];
    for (int i = 0; i < count; i++) {
      v[i] = (2 * random.nextFloat() - 1) * bound;
    }
    return v;
  }

  private static int argmax(float[] z) {
    int best = 0;
    for (int c = 1; c < z.length; c++) {
      if (z[c] > z[best]) {
        best = c;
      }
    }
    return best;
  }

  @Override
  public String toString() {
    return getClass().getSimpleName() + Arrays.toString(params.toArray());
  }
}
