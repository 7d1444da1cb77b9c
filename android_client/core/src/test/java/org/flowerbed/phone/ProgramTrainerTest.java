package org.flowerbed.phone;

import static org.junit.Assert.assertArrayEquals;
import static org.junit.Assert.assertEquals;
import static org.junit.Assert.assertThrows;
import static org.junit.Assert.assertTrue;

import java.util.ArrayList;
import java.util.Arrays;
import java.util.HashMap;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import org.junit.Test;
import org.junit.function.ThrowingRunnable;

/**
 * {@link ProgramTrainer}: the decisions around an ExecuTorch program, on a fake runner that
 * records what it is asked to run.
 */
public class ProgramTrainerTest {
  private static final String SHA =
      "abababababababababababababababababababababababababababababababab";

  /** Metadata of a 2-feature, 2-class program with one batch-norm layer's running mean. */
  private static ProgramInfo info(String extra) throws GatewayException {
    String json =
        "{\"name\": \"tiny\", \"sha256\": \""
            + SHA
            + "\", \"bytes\": 10, \"min_runtime\": \"1.5.1\", \"url\": \"/v1/program/"
            + SHA
            + "\", \"input\": [2], \"max_batch_size\": 3, \"parameters\": ["
            + "{\"name\": \"fc.weight\", \"shape\": [2, 2]}, {\"name\": \"fc.bias\", \"shape\": [2]}]"
            + extra
            + "}";
    return ProgramInfo.fromJson(Json.parse(json));
  }

  /**
   * {@code call} throws a {@code type} whose message contains {@code fragment} ({@code why} it
   * should).
   */
  private static void assertRefused(
      String why, Class<? extends RuntimeException> type, String fragment, ThrowingRunnable call) {
    String message = assertThrows(why, type, call).getMessage();
    assertTrue(message, message.contains(fragment));
  }

  /** Parameter shapes a runner reports: fc.weight {@code weight}, then fc.bias [2]. */
  private static Map<String, long[]> shapes(long... weight) {
    Map<String, long[]> s = new LinkedHashMap<String, long[]>();
    s.put("fc.weight", weight);
    s.put("fc.bias", new long[] {2});
    return s;
  }

  private static final String WITH_STATE =
      ", \"state\": [{\"name\": \"bn.running_mean\", \"shape\": [2]}],"
          + " \"evaluate_method\": \"evaluate\", \"min_batch_size\": 2";

  /** Four examples, two features each; labels 0, 1, 1, 0. */
  private static Dataset data() {
    return new Dataset(
        new float[][] {{1, 0}, {0, 1}, {1, 1}, {3, 3}}, new int[] {0, 1, 1, 0});
  }

  /**
   * A fake program: logits = x W^T + b; the training step returns loss 0.5 and the running mean
   * updated as batch norm does with momentum 0.1; the evaluation returns the batch size as loss.
   */
  static class FakeRunner implements ProgramRunner {
    final Map<String, float[]> params = new HashMap<String, float[]>();
    final List<int[]> trainBatches = new ArrayList<int[]>();
    final List<float[]> stateSeen = new ArrayList<float[]>();
    final List<List<String>> evaluateInputs = new ArrayList<List<String>>();
    final List<String> methods = new ArrayList<String>();
    int extraOutputs = 0;

    FakeRunner() {
      params.put("fc.weight", new float[4]);
      params.put("fc.bias", new float[2]);
    }

    @Override
    public Map<String, long[]> parameterShapes() {
      return shapes(2, 2);
    }

    @Override
    public void writeParameters(List<NamedArray> parameters) {
      for (NamedArray a : parameters) {
        params.put(a.name(), a.data().clone());
      }
    }

    @Override
    public float[] readParameter(String name) {
      return params.get(name).clone();
    }

    @Override
    public float[][] trainStep(
        String method, float[] x, long[] xShape, long[] y, List<NamedArray> state, double lr) {
      methods.add(method);
      int b = (int) xShape[0];
      trainBatches.add(new int[] {b, (int) xShape[1]});
      float[] mean = new float[2];
      for (int k = 0; k < b; k++) {
        mean[0] += x[2 * k] / b;
        mean[1] += x[2 * k + 1] / b;
      }
      List<float[]> out = new ArrayList<float[]>();
      out.add(new float[] {0.5f});
      out.add(new float[2 * b]);
      for (NamedArray s : state) {
        stateSeen.add(s.data().clone());
        out.add(new float[] {0.9f * s.data()[0] + 0.1f * mean[0], 0.9f * s.data()[1] + 0.1f * mean[1]});
      }
      for (int i = 0; i < extraOutputs; i++) {
        out.add(new float[1]);
      }
      params.get("fc.bias")[0] += 1; // "training" changes the program's weights
      return out.toArray(new float[0][]);
    }

    @Override
    public float[][] evaluate(
        String method, float[] x, long[] xShape, long[] y, List<NamedArray> inputs) {
      methods.add(method);
      List<String> names = new ArrayList<String>();
      for (NamedArray a : inputs) {
        names.add(a.name());
      }
      evaluateInputs.add(names);
      float[] w = inputs.get(0).data();
      float[] bias = inputs.get(1).data();
      int b = (int) xShape[0];
      float[] logits = new float[2 * b];
      for (int k = 0; k < b; k++) {
        for (int c = 0; c < 2; c++) {
          logits[2 * k + c] = x[2 * k] * w[2 * c] + x[2 * k + 1] * w[2 * c + 1] + bias[c];
        }
      }
      return new float[][] {{(float) b}, logits};
    }
  }

  /** The global model as a task sends it: Flower's order, not the program's. */
  private static List<NamedArray> arrays(float[] runningMean) {
    List<NamedArray> a = new ArrayList<NamedArray>();
    a.add(new NamedArray("fc.weight", new int[] {2, 2}, new float[] {1, 0, 0, 1}));
    a.add(new NamedArray("bn.running_mean", new int[] {2}, runningMean));
    a.add(new NamedArray("fc.bias", new int[] {2}, new float[] {0, 0}));
    return a;
  }

  /** A trainer of the program with state on {@code data}, holding {@link #arrays}. */
  private static ProgramTrainer loaded(FakeRunner runner, Dataset data, float... runningMean)
      throws GatewayException {
    ProgramTrainer t = new ProgramTrainer(runner, info(WITH_STATE), data, 1);
    t.setParameters(arrays(runningMean));
    return t;
  }

  @Test
  public void theStateOfEachStepFeedsTheNextAndGoesBackWithTheWeights() throws GatewayException {
    FakeRunner runner = new FakeRunner();
    // Three examples, batches of the largest size (3): every step sees the mean (1, 1).
    Dataset three = new Dataset(new float[][] {{1, 0}, {0, 1}, {2, 2}}, new int[] {0, 1, 0});
    ProgramTrainer t = loaded(runner, three, 0, 0);
    t.step(3, 0.1);
    t.step(3, 0.1);
    // Momentum 0.1 from 0: 0.1 after the first step, which the second step receives and
    // turns into 0.9 * 0.1 + 0.1 * 1 = 0.19.
    assertArrayEquals(new float[] {0, 0}, runner.stateSeen.get(0), 0f);
    assertArrayEquals(new float[] {0.1f, 0.1f}, runner.stateSeen.get(1), 1e-7f);
    List<NamedArray> back = t.getParameters();
    assertEquals(
        Arrays.asList("fc.weight", "bn.running_mean", "fc.bias"),
        Arrays.asList(back.get(0).name(), back.get(1).name(), back.get(2).name()));
    assertArrayEquals(new float[] {0.19f, 0.19f}, back.get(1).data(), 1e-6f);
    assertArrayEquals(new float[] {1, 0, 0, 1}, back.get(0).data(), 0f);
    assertArrayEquals(new float[] {2, 0}, back.get(2).data(), 0f); // read from the program
    assertEquals(Arrays.asList("forward", "forward"), runner.methods);
  }

  @Test
  public void evaluationRunsTheEvaluationMethodOnTheWeightsHeldAndTheState()
      throws GatewayException {
    FakeRunner runner = new FakeRunner();
    ProgramTrainer t = loaded(runner, data(), 5, 6);
    Trainer.Evaluation e = t.evaluate();
    // Batches of the program's largest size, 3, then 1: inputs are the parameters then the
    // state, in the program's order, and no training step ran.
    assertEquals(Arrays.asList("evaluate", "evaluate"), runner.methods);
    List<String> order = Arrays.asList("fc.weight", "fc.bias", "bn.running_mean");
    assertEquals(Arrays.asList(order, order), runner.evaluateInputs);
    // W = identity, b = 0: predicted class = the larger feature, the first on ties:
    // (1,0)->0 right, (0,1)->1 right, (1,1)->0 wrong, (3,3)->0 right.
    assertEquals(4, e.examples);
    assertEquals(0.75, e.accuracy, 1e-12);
    // The fake's loss is the batch size: (3 * 3 + 1 * 1) / 4.
    assertEquals(2.5, e.loss, 1e-12);
  }

  @Test
  public void evaluationAfterTrainingUsesTheTrainedWeights() throws GatewayException {
    FakeRunner runner = new FakeRunner();
    ProgramTrainer t = loaded(runner, data(), 0, 0);
    t.step(2, 0.1);
    t.step(2, 0.1);
    t.step(2, 0.1); // the fake adds 1 to bias[0] per step: b = (3, 0)
    Trainer.Evaluation e = t.evaluate();
    // Every example now scores class 0 highest ((0,1): 3 > 1): right for labels 0 only, 2 of 4.
    assertEquals(0.5, e.accuracy, 1e-12);
  }

  @Test
  public void batchesAreRaisedToTheProgramsSmallestAndCappedAtItsLargest()
      throws GatewayException {
    FakeRunner runner = new FakeRunner();
    ProgramTrainer t = loaded(runner, data(), 0, 0);
    assertEquals(2, t.step(1, 0.1).examples);
    assertEquals(3, t.step(64, 0.1).examples);
    assertArrayEquals(new int[] {2, 2}, runner.trainBatches.get(0));
    assertArrayEquals(new int[] {3, 2}, runner.trainBatches.get(1));
  }

  @Test
  public void aPhoneWithFewerExamplesThanTheSmallestBatchRefusesTheProgram()
      throws GatewayException {
    Dataset one = new Dataset(new float[][] {{1, 0}}, new int[] {0});
    String message =
        assertThrows(
                "one example cannot make a batch of two",
                IllegalArgumentException.class,
                () -> new ProgramTrainer(new FakeRunner(), info(WITH_STATE), one, 1))
            .getMessage();
    assertTrue(message, message.startsWith("program: 'tiny' trains batches of at least 2"));
  }

  @Test
  public void arraysWithoutTheStateAreRefused() throws GatewayException {
    ProgramTrainer t = new ProgramTrainer(new FakeRunner(), info(WITH_STATE), data(), 1);
    List<NamedArray> a = arrays(new float[] {0, 0});
    a.remove(1);
    assertRefused(
        "the running mean is part of the model",
        IllegalArgumentException.class,
        "missing bn.running_mean",
        () -> t.setParameters(a));
  }

  @Test
  public void aLoadedProgramWhoseParametersAreNotItsMetadatasIsRefused() throws GatewayException {
    FakeRunner runner =
        new FakeRunner() {
          @Override
          public Map<String, long[]> parameterShapes() {
            return shapes(2, 3);
          }
        };
    ProgramTrainer t = new ProgramTrainer(runner, info(WITH_STATE), data(), 1);
    assertRefused(
        "the file is not the program its metadata describes",
        IllegalArgumentException.class,
        "fc.weight [2, 3]",
        () -> t.setParameters(arrays(new float[] {0, 0})));
  }

  @Test
  public void aProgramWithoutAnEvaluationMethodFailsEvaluationWithTheReason()
      throws GatewayException {
    ProgramTrainer t = new ProgramTrainer(new FakeRunner(), info(""), data(), 1);
    List<NamedArray> a = arrays(new float[] {0, 0});
    a.remove(1);
    t.setParameters(a);
    assertRefused(
        "nothing to evaluate with",
        IllegalArgumentException.class,
        "has no evaluation method",
        () -> t.evaluate());
  }

  @Test
  public void aProgramReturningOtherOutputsThanItsMetadataSaysIsAnError()
      throws GatewayException {
    FakeRunner runner = new FakeRunner();
    runner.extraOutputs = 1;
    ProgramTrainer t = loaded(runner, data(), 0, 0);
    assertRefused(
        "four outputs for one state array",
        IllegalStateException.class,
        "returned 4 outputs",
        () -> t.step(2, 0.1));
  }

  @Test
  public void samplesThatDoNotFitTheProgramsInputAreRefused() throws GatewayException {
    Dataset three = new Dataset(new float[][] {{1, 0, 0}, {0, 1, 0}}, new int[] {0, 1});
    assertRefused(
        "3 features for a [2] sample",
        IllegalArgumentException.class,
        "rows have 3 features",
        () -> new ProgramTrainer(new FakeRunner(), info(WITH_STATE), three, 1));
  }
}
