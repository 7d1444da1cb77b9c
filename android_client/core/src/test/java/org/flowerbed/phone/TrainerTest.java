package org.flowerbed.phone;

import static org.junit.Assert.assertArrayEquals;
import static org.junit.Assert.assertEquals;
import static org.junit.Assert.assertTrue;
import static org.junit.Assert.fail;

import java.util.Arrays;
import java.util.List;
import java.util.Random;
import org.junit.Test;

public class TrainerTest {
  private static NamedArray array(String name, int[] shape, float... data) {
    return new NamedArray(name, shape, data);
  }

  /** Arrays of softmax regression over 2 classes: fc.weight [2, in] and fc.bias [2]. */
  private static List<NamedArray> fc(int in, float[] weight, float... bias) {
    return Arrays.asList(
        array("fc.weight", new int[] {2, in}, weight), array("fc.bias", new int[] {2}, bias));
  }

  private static Dataset one(float[] x, int y) {
    return new Dataset(new float[][] {x}, new int[] {y});
  }

  /** Two Gaussian-free, linearly separable clusters: class 0 near (-1,-1), class 1 near (1,1). */
  private static Dataset separable(int n, long seed) {
    Random r = new Random(seed);
    float[][] x = new float[n][];
    int[] y = new int[n];
    for (int i = 0; i < n; i++) {
      y[i] = i % 2;
      float c = y[i] == 0 ? -1f : 1f;
      x[i] = new float[] {c + (r.nextFloat() - 0.5f), c + (r.nextFloat() - 0.5f)};
    }
    return new Dataset(x, y);
  }

  private static float[] param(Trainer t, String name) {
    for (NamedArray a : t.getParameters()) {
      if (a.name().equals(name)) {
        return a.data();
      }
    }
    throw new AssertionError("no " + name);
  }

  @Test
  public void softmaxRegressionStepMatchesTheHandGradient() {
    // W = 0, b = 0, x = (1, 2), y = 0: logits 0, p = (1/2, 1/2), loss = ln 2,
    // dlogits = p - onehot = (-1/2, 1/2), dW = dlogits x^T = [[-1/2, -1], [1/2, 1]], db = dlogits.
    // With lr 0.5: W = [[1/4, 1/2], [-1/4, -1/2]], b = (1/4, -1/4).
    List<NamedArray> zero = fc(2, new float[] {0, 0, 0, 0}, 0, 0);
    SoftmaxRegression t = new SoftmaxRegression(one(new float[] {1, 2}, 0), zero, 0);
    Trainer.StepResult r = t.step(1, 0.5);
    assertEquals(1, r.examples);
    assertEquals(Math.log(2), r.loss, 1e-12);
    assertArrayEquals(new float[] {0.25f, 0.5f, -0.25f, -0.5f}, param(t, "fc.weight"), 1e-7f);
    assertArrayEquals(new float[] {0.25f, -0.25f}, param(t, "fc.bias"), 1e-7f);
  }

  @Test
  public void mlpStepMatchesTheHandGradient() {
    // fc1: w = 1, b = 0; fc2: w = (1, -1), b = 0; x = 2, y = 0, lr = 1.
    // h = relu(2) = 2, logits = (2, -2), p0 = 1/(1+e^-4) = 0.98201379, p1 = 0.01798621,
    // loss = -ln p0 = 0.01814993; dz = (p0 - 1, p1) = (-0.01798621, 0.01798621);
    // dfc2.w = dz h = (-0.03597242, 0.03597242), dfc2.b = dz;
    // dh = 1*(-0.01798621) + (-1)*(0.01798621) = -0.03597242 (relu passes, h > 0);
    // dfc1.w = dh x = -0.07194484, dfc1.b = dh.
    List<NamedArray> p =
        Arrays.asList(
            array("fc1.weight", new int[] {1, 1}, 1),
            array("fc1.bias", new int[] {1}, 0),
            array("fc2.weight", new int[] {2, 1}, 1, -1),
            array("fc2.bias", new int[] {2}, 0, 0));
    Mlp t = new Mlp(one(new float[] {2}, 0), p, 0);
    Trainer.StepResult r = t.step(1, 1.0);
    assertEquals(0.01814993, r.loss, 1e-7);
    assertArrayEquals(new float[] {1.07194484f}, param(t, "fc1.weight"), 1e-6f);
    assertArrayEquals(new float[] {0.03597242f}, param(t, "fc1.bias"), 1e-6f);
    assertArrayEquals(new float[] {1.03597242f, -1.03597242f}, param(t, "fc2.weight"), 1e-6f);
    assertArrayEquals(new float[] {0.01798621f, -0.01798621f}, param(t, "fc2.bias"), 1e-6f);
  }

  @Test
  public void batchGradientIsTheMeanOfTheExampleGradients() {
    // Two examples x = (1, 0) y = 0 and x = (0, 1) y = 1 at W = 0, b = 0: each dlogits is
    // -/+ 1/2; mean dW = [[-1/4, 1/4], [1/4, -1/4]], mean db = (0, 0). lr 1 flips the signs.
    List<NamedArray> zero = fc(2, new float[] {0, 0, 0, 0}, 0, 0);
    Dataset d = new Dataset(new float[][] {{1, 0}, {0, 1}}, new int[] {0, 1});
    SoftmaxRegression t = new SoftmaxRegression(d, zero, 0);
    assertEquals(2, t.step(32, 1.0).examples);
    assertArrayEquals(new float[] {0.25f, -0.25f, -0.25f, 0.25f}, param(t, "fc.weight"), 1e-7f);
    assertArrayEquals(new float[] {0f, 0f}, param(t, "fc.bias"), 1e-7f);
  }

  /**
   * After {@code steps} minibatches of 8 at rate {@code lr}, the loss is below a quarter of the
   * initial loss and every example is classified right.
   */
  private static void assertLearns(Trainer t, int steps, double lr) {
    double before = t.evaluate().loss;
    for (int i = 0; i < steps; i++) {
      t.step(8, lr);
    }
    Trainer.Evaluation after = t.evaluate();
    assertTrue("loss " + before + " -> " + after.loss, after.loss < before / 4);
    assertEquals(1.0, after.accuracy, 0);
  }

  @Test
  public void softmaxRegressionLearnsASeparableSet() {
    assertLearns(new SoftmaxRegression(separable(64, 1), 2, 7), 100, 0.5);
  }

  @Test
  public void mlpLearnsASeparableSet() {
    assertLearns(new Mlp(separable(64, 2), 8, 2, 7), 200, 0.2);
  }

  @Test
  public void evaluateCountsLossAndAccuracyOverAllExamples() {
    // W = I, b = 0 over 2 features: logits = x. Examples: (2,0)->0 right, (0,2)->1 right,
    // (2,0)->1 wrong. Losses: ln(1+e^-2) twice and ln(1+e^2) once; accuracy 2/3.
    List<NamedArray> id = fc(2, new float[] {1, 0, 0, 1}, 0, 0);
    Dataset d = new Dataset(new float[][] {{2, 0}, {0, 2}, {2, 0}}, new int[] {0, 1, 1});
    Trainer.Evaluation e = new SoftmaxRegression(d, id, 0).evaluate();
    double expected = (2 * Math.log(1 + Math.exp(-2)) + Math.log(1 + Math.exp(2))) / 3;
    assertEquals(3, e.examples);
    assertEquals(expected, e.loss, 1e-6);
    assertEquals(2.0 / 3, e.accuracy, 1e-12);
  }

  @Test
  public void setParametersRefusesAnotherLayout() {
    SoftmaxRegression t = new SoftmaxRegression(separable(4, 0), 2, 0);
    try {
      t.setParameters(fc(3, new float[6], 0, 0));
      fail("expected IllegalArgumentException");
    } catch (IllegalArgumentException e) {
      assertEquals("parameter 0 should be fc.weight[2, 2], got fc.weight[2, 3]", e.getMessage());
    }
  }

  @Test
  public void setAndGetParametersRoundTripWithoutSharing() {
    SoftmaxRegression t = new SoftmaxRegression(separable(4, 0), 2, 0);
    List<NamedArray> p = fc(2, new float[] {1, 2, 3, 4}, 5, 6);
    t.setParameters(p);
    p.get(0).data()[0] = 99; // the trainer holds its own copy
    assertArrayEquals(new float[] {1, 2, 3, 4}, param(t, "fc.weight"), 0);
    assertArrayEquals(new float[] {5, 6}, param(t, "fc.bias"), 0);
  }

  @Test
  public void modelsPickTheModelByArrayNames() {
    Dataset d = separable(4, 0);
    assertTrue(
        Models.fromArrays(new SoftmaxRegression(d, 3, 0).getParameters(), d, 0)
            instanceof SoftmaxRegression);
    DenseTrainer mlp = Models.fromArrays(new Mlp(d, 5, 3, 0).getParameters(), d, 0);
    assertTrue(mlp instanceof Mlp);
    assertEquals(3, mlp.numClasses);
  }

  @Test
  public void modelsExplainUnknownArrays() {
    try {
      Models.fromArrays(Arrays.asList(array("conv1.weight", new int[] {1}, 0)), separable(4, 0), 0);
      fail("expected IllegalArgumentException");
    } catch (IllegalArgumentException e) {
      assertTrue(
          e.getMessage(),
          e.getMessage().startsWith("no pure-Java model has arrays [conv1.weight]"));
      assertTrue(e.getMessage(), e.getMessage().contains("fc1.weight [hidden, in]"));
    }
  }

  @Test
  public void modelsRefuseAModelOverOtherFeatures() {
    List<NamedArray> threeFeatures = fc(3, new float[6], 0, 0);
    try {
      Models.fromArrays(threeFeatures, separable(4, 0), 0);
      fail("expected IllegalArgumentException");
    } catch (IllegalArgumentException e) {
      assertTrue(e.getMessage(), e.getMessage().startsWith("softmax regression over 2 features"));
    }
  }

  @Test
  public void modelsRefuseLabelsBeyondTheClasses() {
    Dataset d = new Dataset(new float[][] {{0, 0}}, new int[] {4});
    try {
      new SoftmaxRegression(d, 2, 0);
      fail("expected IllegalArgumentException");
    } catch (IllegalArgumentException e) {
      assertEquals("the data has label 4 but the model has only 2 classes", e.getMessage());
    }
  }
}
