package org.flowerbed.phone;

import java.util.Arrays;
import java.util.List;
import java.util.Random;

/**
 * One-hidden-layer perceptron, logits = W2 relu(W1 x + b1) + b2, with parameters {@code fc1.weight}
 * [hidden, in], {@code fc1.bias} [hidden], {@code fc2.weight} [classes, hidden], {@code fc2.bias}
 * [classes]: torch {@code nn.Linear} layers registered as {@code fc1} and {@code fc2} with a ReLU
 * between them.
 */
public final class Mlp extends DenseTrainer {
  public static final String W1 = "fc1.weight";
  public static final String B1 = "fc1.bias";
  public static final String W2 = "fc2.weight";
  public static final String B2 = "fc2.bias";

  private final int in;
  private final int hidden;
  private final int iw1;
  private final int ib1;
  private final int iw2;
  private final int ib2;

  /** A model with PyTorch's default initialisation (seeded). */
  public Mlp(Dataset data, int hidden, int numClasses, long seed) {
    this(data, initial(data.numFeatures(), hidden, numClasses, new Random(seed)), seed);
  }

  /**
   * A model holding the given parameters.
   *
   * @throws IllegalArgumentException unless the arrays have the layout of {@link #layout()} with in
   *     = the data's feature count
   */
  public Mlp(Dataset data, List<NamedArray> arrays, long seed) {
    super(data, arrays, classesOf(arrays, data), seed);
    this.in = data.numFeatures();
    this.hidden = Models.find(arrays, W1).shape()[0];
    this.iw1 = indexOf(W1);
    this.ib1 = indexOf(B1);
    this.iw2 = indexOf(W2);
    this.ib2 = indexOf(B2);
  }

  /** The parameter layout this model expects, for an error message. */
  public static String layout() {
    return W1
        + " [hidden, in], "
        + B1
        + " [hidden], "
        + W2
        + " [classes, hidden], "
        + B2
        + " [classes]";
  }

  private static List<NamedArray> initial(int in, int hidden, int classes, Random random) {
    return Arrays.asList(
        new NamedArray(W1, new int[] {hidden, in}, linearInit(hidden * in, in, random)),
        new NamedArray(B1, new int[] {hidden}, linearInit(hidden, in, random)),
        new NamedArray(
            W2, new int[] {classes, hidden}, linearInit(classes * hidden, hidden, random)),
        new NamedArray(B2, new int[] {classes}, linearInit(classes, hidden, random)));
  }

  private static int classesOf(List<NamedArray> arrays, Dataset data) {
    int[] w1 = Models.find(arrays, W1).shape();
    int[] b1 = Models.find(arrays, B1).shape();
    int[] w2 = Models.find(arrays, W2).shape();
    int[] b2 = Models.find(arrays, B2).shape();
    boolean ok =
        arrays.size() == 4
            && w1.length == 2
            && w1[1] == data.numFeatures()
            && Arrays.equals(b1, new int[] {w1[0]})
            && w2.length == 2
            && w2[1] == w1[0]
            && Arrays.equals(b2, new int[] {w2[0]});
    if (!ok) {
      throw layoutError("an MLP", layout(), data, arrays);
    }
    return w2[0];
  }

  private float[] hiddenPre(float[] x) {
    return linear(param(W1), param(B1), x, hidden, in);
  }

  private float[] output(float[] h) {
    return linear(param(W2), param(B2), h, numClasses, hidden);
  }

  private static float[] relu(float[] pre) {
    float[] h = new float[pre.length];
    for (int k = 0; k < pre.length; k++) {
      h[k] = Math.max(0f, pre[k]);
    }
    return h;
  }

  @Override
  protected float[] logits(float[] x) {
    return output(relu(hiddenPre(x)));
  }

  @Override
  protected double accumulateGradient(float[] x, int label, float[][] grads) {
    float[] pre = hiddenPre(x);
    float[] h = relu(pre);
    float[] dz = new float[numClasses];
    double loss = crossEntropy(output(h), label, dz);
    addLinearGradient(dz, h, grads[iw2], grads[ib2], numClasses, hidden);
    float[] w2 = param(W2);
    float[] dh = new float[hidden];
    for (int c = 0; c < numClasses; c++) {
      for (int k = 0; k < hidden; k++) {
        dh[k] += dz[c] * w2[c * hidden + k];
      }
    }
    float[] dpre = new float[hidden];
    for (int k = 0; k < hidden; k++) {
      dpre[k] = pre[k] > 0 ? dh[k] : 0f;
    }
    addLinearGradient(dpre, x, grads[iw1], grads[ib1], hidden, in);
    return loss;
  }
}
