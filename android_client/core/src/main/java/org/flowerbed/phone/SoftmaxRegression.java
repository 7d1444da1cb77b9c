package org.flowerbed.phone;

import java.util.Arrays;
import java.util.List;
import java.util.Random;

/**
 * Multinomial logistic regression, logits = W x + b, with parameters {@code fc.weight} [classes,
 * in] and {@code fc.bias} [classes]: the torch model {@code nn.Sequential} holding one {@code
 * nn.Linear} registered as {@code fc}.
 */
public final class SoftmaxRegression extends DenseTrainer {
  public static final String WEIGHT = "fc.weight";
  public static final String BIAS = "fc.bias";

  private final int in;
  private final int iw;
  private final int ib;

  /** A model with PyTorch's default initialisation (seeded). */
  public SoftmaxRegression(Dataset data, int numClasses, long seed) {
    this(data, initial(data.numFeatures(), numClasses, new Random(seed)), seed);
  }

  /**
   * A model holding the given parameters.
   *
   * @throws IllegalArgumentException unless {@code arrays} are {@code fc.weight} [C, in] and {@code
   *     fc.bias} [C] (either order) with in = the data's feature count
   */
  public SoftmaxRegression(Dataset data, List<NamedArray> arrays, long seed) {
    super(data, arrays, classesOf(arrays, data), seed);
    this.in = data.numFeatures();
    this.iw = indexOf(WEIGHT);
    this.ib = indexOf(BIAS);
  }

  /** The parameter layout this model expects, for an error message. */
  public static String layout() {
    return WEIGHT + " [classes, in], " + BIAS + " [classes]";
  }

  private static List<NamedArray> initial(int in, int classes, Random random) {
    return Arrays.asList(
        new NamedArray(WEIGHT, new int[] {classes, in}, linearInit(classes * in, in, random)),
        new NamedArray(BIAS, new int[] {classes}, linearInit(classes, in, random)));
  }

  private static int classesOf(List<NamedArray> arrays, Dataset data) {
    NamedArray w = Models.find(arrays, WEIGHT);
    NamedArray b = Models.find(arrays, BIAS);
    int[] ws = w.shape();
    if (arrays.size() != 2
        || ws.length != 2
        || ws[1] != data.numFeatures()
        || !Arrays.equals(b.shape(), new int[] {ws[0]})) {
      throw layoutError("softmax regression", layout(), data, arrays);
    }
    return ws[0];
  }

  @Override
  protected float[] logits(float[] x) {
    return linear(param(WEIGHT), param(BIAS), x, numClasses, in);
  }

  @Override
  protected double accumulateGradient(float[] x, int label, float[][] grads) {
    float[] dz = new float[numClasses];
    double loss = crossEntropy(logits(x), label, dz);
    addLinearGradient(dz, x, grads[iw], grads[ib], numClasses, in);
    return loss;
  }
}
