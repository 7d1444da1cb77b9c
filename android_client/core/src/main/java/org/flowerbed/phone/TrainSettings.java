package org.flowerbed.phone;

import java.util.Map;

/**
 * The work a train task asks for, read from its config (wire keys {@code local-steps}, {@code
 * deadline-s}, {@code lr}, {@code batch-size}).
 */
public final class TrainSettings {
  public static final String LOCAL_STEPS = "local-steps";
  public static final String DEADLINE_S = "deadline-s";
  public static final String LR = "lr";
  public static final String BATCH_SIZE = "batch-size";

  /** Learning rate when the config gives none. */
  public static final double DEFAULT_LR = 0.05;

  /** Batch size when the config gives none. */
  public static final int DEFAULT_BATCH_SIZE = 32;

  public final int localSteps;

  /** Seconds of training allowed, or null for no limit. */
  public final Double deadlineS;

  public final double lr;
  public final int batchSize;

  public TrainSettings(int localSteps, Double deadlineS, double lr, int batchSize) {
    this.localSteps = localSteps;
    this.deadlineS = deadlineS;
    this.lr = lr;
    this.batchSize = batchSize;
  }

  /**
   * These settings with the deadline lowered to {@code limitS} if that is sooner (or set, if there
   * was none).
   */
  public TrainSettings capDeadline(double limitS) {
    if (deadlineS != null && deadlineS <= limitS) {
      return this;
    }
    return new TrainSettings(localSteps, limitS, lr, batchSize);
  }

  /**
   * Read the settings from a task config. Absent keys take defaults: {@link #DEFAULT_LR}, {@link
   * #DEFAULT_BATCH_SIZE}, no deadline, and one pass over the data, max(1, floor(examples / batch))
   * steps.
   *
   * @throws IllegalArgumentException naming the key whose value is of the wrong type or range
   */
  public static TrainSettings fromConfig(Map<String, Object> config, int numExamples) {
    int batch = (int) integer(config, BATCH_SIZE, DEFAULT_BATCH_SIZE);
    int steps = (int) integer(config, LOCAL_STEPS, Math.max(1, numExamples / batch));
    Double deadline = config.containsKey(DEADLINE_S) ? positive(config, DEADLINE_S) : null;
    double lr = config.containsKey(LR) ? positive(config, LR) : DEFAULT_LR;
    return new TrainSettings(steps, deadline, lr, batch);
  }

  private static long integer(Map<String, Object> config, String key, long fallback) {
    if (!config.containsKey(key)) {
      return fallback;
    }
    Object v = config.get(key);
    if (v instanceof Number) {
      double d = ((Number) v).doubleValue();
      if (d == Math.rint(d) && d >= 1 && d <= Integer.MAX_VALUE) {
        return (long) d;
      }
    }
    throw new IllegalArgumentException(
        "config key '" + key + "' must be an integer >= 1, got " + v);
  }

  private static double positive(Map<String, Object> config, String key) {
    Object v = config.get(key);
    if (v instanceof Number) {
      double d = ((Number) v).doubleValue();
      if (d > 0 && !Double.isInfinite(d)) {
        return d;
      }
    }
    throw new IllegalArgumentException("config key '" + key + "' must be a number > 0, got " + v);
  }

  @Override
  public String toString() {
    return "local-steps="
        + localSteps
        + " deadline-s="
        + deadlineS
        + " lr="
        + lr
        + " batch-size="
        + batchSize;
  }
}
