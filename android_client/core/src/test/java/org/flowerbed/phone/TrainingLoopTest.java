package org.flowerbed.phone;

import static org.junit.Assert.assertEquals;
import static org.junit.Assert.assertFalse;
import static org.junit.Assert.assertNull;
import static org.junit.Assert.assertTrue;
import static org.junit.Assert.fail;

import java.util.ArrayList;
import java.util.Collections;
import java.util.HashMap;
import java.util.List;
import java.util.Map;
import org.junit.Test;

public class TrainingLoopTest {
  /** A clock that only moves when a trainer step advances it. */
  private static final class StepClock implements Ticker {
    long now;

    @Override
    public long nanoTime() {
      return now;
    }
  }

  /** A trainer whose every step uses {@code batch} examples, loss 1/steps, and costs time. */
  private static class CountingTrainer implements Trainer {
    final StepClock clock;
    final long stepNanos;
    int steps;
    int lastBatchSize;
    double lastLr;

    CountingTrainer(StepClock clock, double stepS) {
      this.clock = clock;
      this.stepNanos = (long) (stepS * 1e9);
    }

    @Override
    public void setParameters(List<NamedArray> arrays) {}

    @Override
    public List<NamedArray> getParameters() {
      return new ArrayList<NamedArray>();
    }

    @Override
    public int numExamples() {
      return 100;
    }

    @Override
    public StepResult step(int batchSize, double lr) {
      steps++;
      lastBatchSize = batchSize;
      lastLr = lr;
      clock.now += stepNanos;
      return new StepResult(batchSize, 1.0 / steps);
    }

    @Override
    public Evaluation evaluate() {
      return new Evaluation(100, 0, 0);
    }
  }

  private static final class Status implements DeviceStatus {
    Double battery;
    Double temp;
    String block;

    @Override
    public Double batteryPct() {
      return battery;
    }

    @Override
    public Double tempC() {
      return temp;
    }

    @Override
    public String blockReason() {
      return block;
    }
  }

  private static Map<String, Object> config(Object... kv) {
    Map<String, Object> m = new HashMap<String, Object>();
    for (int i = 0; i < kv.length; i += 2) {
      m.put((String) kv[i], kv[i + 1]);
    }
    return m;
  }

  @Test
  public void trainsExactlyTheLocalStepsWithoutADeadline() throws Exception {
    StepClock clock = new StepClock();
    CountingTrainer t = new CountingTrainer(clock, 0.5);
    TrainSettings s =
        TrainSettings.fromConfig(config("local-steps", 4L, "batch-size", 8L, "lr", 0.1), 100);
    TrainingLoop.Report r = TrainingLoop.train(t, s, clock, DeviceStatus.NONE);
    assertEquals(4, r.numSteps);
    assertEquals(32, r.numExamples);
    assertEquals(2.0, r.trainTimeS, 1e-9);
    assertEquals((1 + 1 / 2.0 + 1 / 3.0 + 1 / 4.0) / 4, r.meanLoss, 1e-12);
    assertFalse(r.deadlineHit);
    assertEquals(8, t.lastBatchSize);
    assertEquals(0.1, t.lastLr, 0);
  }

  @Test
  public void deadlineStopsBeforeTheStepThatWouldOverrunAndReportsPartialWork() throws Exception {
    // 1 s per step, deadline 3.5 s, 10 steps asked: after 3 steps elapsed = 3 s and the next
    // step is predicted to end at 4 s > 3.5 s, so training stops with 3 steps in 3 s.
    StepClock clock = new StepClock();
    CountingTrainer t = new CountingTrainer(clock, 1.0);
    TrainSettings s =
        TrainSettings.fromConfig(
            config("local-steps", 10L, "deadline-s", 3.5, "batch-size", 16L), 100);
    TrainingLoop.Report r = TrainingLoop.train(t, s, clock, DeviceStatus.NONE);
    assertEquals(3, r.numSteps);
    assertEquals(48, r.numExamples);
    assertEquals(3.0, r.trainTimeS, 1e-9);
    assertTrue(r.deadlineHit);
    Map<String, Object> m = r.metrics(DeviceStatus.NONE);
    assertEquals(3L, m.get("num-steps"));
    assertEquals(48L, m.get("num-examples"));
    assertEquals(3.0, (Double) m.get("train-time-s"), 1e-9);
    assertEquals(16.0, (Double) m.get("samples-per-s"), 1e-9);
  }

  @Test
  public void deadlineExactlyReachedStopsToo() throws Exception {
    // 1 s per step, deadline 2 s: after 2 steps elapsed = 2 s >= deadline.
    StepClock clock = new StepClock();
    TrainSettings s = TrainSettings.fromConfig(config("local-steps", 10L, "deadline-s", 2L), 100);
    TrainingLoop.Report r =
        TrainingLoop.train(new CountingTrainer(clock, 1.0), s, clock, DeviceStatus.NONE);
    assertEquals(2, r.numSteps);
  }

  @Test
  public void theFirstStepAlwaysRunsSoATrainTaskNeverReportsNothing() throws Exception {
    StepClock clock = new StepClock();
    TrainSettings s = TrainSettings.fromConfig(config("local-steps", 5L, "deadline-s", 0.1), 100);
    TrainingLoop.Report r =
        TrainingLoop.train(new CountingTrainer(clock, 1.0), s, clock, DeviceStatus.NONE);
    assertEquals(1, r.numSteps);
    assertTrue(r.deadlineHit);
  }

  @Test
  public void metricsCarryBatteryAndTemperatureWhenTheDeviceKnowsThem() throws Exception {
    StepClock clock = new StepClock();
    Status device = new Status();
    device.battery = 81.0;
    device.temp = 36.5;
    TrainSettings s = TrainSettings.fromConfig(config("local-steps", 1L), 100);
    Map<String, Object> m =
        TrainingLoop.train(new CountingTrainer(clock, 1.0), s, clock, device).metrics(device);
    assertEquals(81.0, m.get("battery-pct"));
    assertEquals(36.5, m.get("temp-c"));
    Map<String, Object> none =
        TrainingLoop.train(new CountingTrainer(clock, 1.0), s, clock, DeviceStatus.NONE)
            .metrics(DeviceStatus.NONE);
    assertFalse(none.containsKey("battery-pct"));
    assertFalse(none.containsKey("temp-c"));
  }

  @Test
  public void defaultsAreOnePassLrAndBatchConstants() {
    TrainSettings s = TrainSettings.fromConfig(Collections.<String, Object>emptyMap(), 100);
    assertEquals(TrainSettings.DEFAULT_BATCH_SIZE, s.batchSize);
    assertEquals(100 / TrainSettings.DEFAULT_BATCH_SIZE, s.localSteps);
    assertEquals(TrainSettings.DEFAULT_LR, s.lr, 0);
    assertNull(s.deadlineS);
    assertEquals(1, TrainSettings.fromConfig(Collections.<String, Object>emptyMap(), 3).localSteps);
  }

  @Test
  public void badConfigValuesNameTheKey() {
    String[][] cases = {
      {"local-steps", "0", "config key 'local-steps' must be an integer >= 1, got 0"},
      {"batch-size", "2.5", "config key 'batch-size' must be an integer >= 1, got 2.5"},
      {"lr", "-1", "config key 'lr' must be a number > 0, got -1"},
      {"deadline-s", "soon", "config key 'deadline-s' must be a number > 0, got soon"},
    };
    for (String[] c : cases) {
      Object value = c[1].equals("soon") ? c[1] : Json.parse(c[1]);
      try {
        TrainSettings.fromConfig(config(c[0], value), 100);
        fail("expected IllegalArgumentException for " + c[0]);
      } catch (IllegalArgumentException e) {
        assertEquals(c[2], e.getMessage());
      }
    }
  }

  @Test
  public void aDeviceThatMayNoLongerTrainAbandonsTheTask() {
    final StepClock clock = new StepClock();
    final Status device = new Status();
    CountingTrainer t =
        new CountingTrainer(clock, 1.0) {
          @Override
          public StepResult step(int batchSize, double lr) {
            if (steps == 1) {
              device.block = "not charging";
            }
            return super.step(batchSize, lr);
          }
        };
    try {
      TrainingLoop.train(
          t, TrainSettings.fromConfig(config("local-steps", 5L), 100), clock, device);
      fail("expected Abandoned");
    } catch (TrainingLoop.Abandoned e) {
      assertEquals("not charging", e.getMessage());
      assertEquals(2, t.steps);
    }
  }
}
