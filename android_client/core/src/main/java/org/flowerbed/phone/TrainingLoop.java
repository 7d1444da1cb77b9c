package org.flowerbed.phone;

import java.util.LinkedHashMap;
import java.util.Map;

/**
 * Deadline-aware local training: SGD steps until {@code local-steps} are done or the next step
 * would end past {@code deadline-s}, whichever comes first, then report the (possibly partial) work
 * in the wire keys the strategies read.
 *
 * <p>Before each step the loop stops if elapsed >= deadline, or if elapsed + mean step time >
 * deadline (the next step is predicted to overrun). The first step always runs, so a train task
 * never reports zero examples. Partial work is what FedNova and FedProx-style aggregation expect
 * (Wang et al., "Tackling the Objective Inconsistency Problem in Heterogeneous Federated
 * Optimization", NeurIPS 2020; Li et al., "Federated Optimization in Heterogeneous Networks", MLSys
 * 2020): {@code num-steps} tells the server how much was done.
 */
public final class TrainingLoop {
  /** Training stopped because the device may no longer train (unplugged, shutting down). */
  public static final class Abandoned extends Exception {
    private static final long serialVersionUID = 1L;

    public Abandoned(String reason) {
      super(reason);
    }
  }

  private TrainingLoop() {}

  /**
   * Train {@code trainer} as {@code settings} ask.
   *
   * @throws Abandoned if {@code device.stopReason()} becomes non-null during training
   */
  public static Report train(
      Trainer trainer, TrainSettings settings, Ticker ticker, DeviceStatus device)
      throws Abandoned {
    long start = ticker.nanoTime();
    int steps = 0;
    long examples = 0;
    double lossSum = 0;
    boolean deadlineHit = false;
    while (steps < settings.localSteps) {
      String block = device.stopReason();
      if (block != null) {
        throw new Abandoned(block);
      }
      if (settings.deadlineS != null && steps > 0) {
        double elapsed = seconds(ticker.nanoTime() - start);
        if (elapsed >= settings.deadlineS || elapsed + elapsed / steps > settings.deadlineS) {
          deadlineHit = true;
          break;
        }
      }
      Trainer.StepResult r = trainer.step(settings.batchSize, settings.lr);
      steps++;
      examples += r.examples;
      lossSum += r.loss;
    }
    double trainTime = seconds(ticker.nanoTime() - start);
    return new Report(steps, examples, trainTime, lossSum / steps, deadlineHit);
  }

  private static double seconds(long nanos) {
    return nanos / 1e9;
  }

  /** What one train task did. */
  public static final class Report {
    public final int numSteps;
    public final long numExamples;
    public final double trainTimeS;
    public final double meanLoss;

    /** True when the deadline, not {@code local-steps}, ended training. */
    public final boolean deadlineHit;

    public Report(
        int numSteps, long numExamples, double trainTimeS, double meanLoss, boolean deadlineHit) {
      this.numSteps = numSteps;
      this.numExamples = numExamples;
      this.trainTimeS = trainTimeS;
      this.meanLoss = meanLoss;
      this.deadlineHit = deadlineHit;
    }

    /**
     * The reply metrics: {@code num-examples}, {@code num-steps}, {@code train-time-s}, {@code
     * samples-per-s} (num-examples / train-time-s, when the time is > 0), and {@code battery-pct}
     * and {@code temp-c} when the device knows them.
     */
    public Map<String, Object> metrics(DeviceStatus device) {
      Map<String, Object> m = new LinkedHashMap<String, Object>();
      m.put("num-examples", numExamples);
      m.put("num-steps", (long) numSteps);
      m.put("train-time-s", trainTimeS);
      if (trainTimeS > 0) {
        m.put("samples-per-s", numExamples / trainTimeS);
      }
      putIfKnown(m, "battery-pct", device.batteryPct());
      putIfKnown(m, "temp-c", device.tempC());
      return m;
    }
  }

  /** Add {@code value} under {@code key} if it is a finite number. */
  static void putIfKnown(Map<String, Object> m, String key, Double value) {
    if (value != null && !value.isNaN() && !value.isInfinite()) {
      m.put(key, value);
    }
  }
}
