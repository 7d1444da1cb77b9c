package org.flowerbed.phone;

/**
 * A {@link DeviceStatus} that reads the device through a {@link TrainingPolicy}: it blocks new work
 * by the start rules, and once training stopped for heat, blocks everything until the cool-down
 * has passed (recorded when {@link #stopReason} reports heat).
 */
public final class PolicyStatus implements DeviceStatus {
  private final TrainingPolicy policy;
  private final DeviceState.Source source;
  private final Ticker ticker;
  private int heatStrikes;
  private long coolUntilNanos;
  private boolean cooling;

  public PolicyStatus(TrainingPolicy policy, DeviceState.Source source, Ticker ticker) {
    this.policy = policy;
    this.source = source;
    this.ticker = ticker;
  }

  @Override
  public Double batteryPct() {
    return source.read().batteryPct;
  }

  @Override
  public Double tempC() {
    return source.read().tempC;
  }

  /** Start rules, or the cool-down after heat. */
  @Override
  public synchronized String blockReason() {
    if (cooling) {
      long left = coolUntilNanos - ticker.nanoTime();
      if (left > 0) {
        long seconds = (left + 999_999_999L) / 1_000_000_000L; // rounded up
        return "cooling down after overheating (" + seconds + " s left)";
      }
      cooling = false;
    }
    return policy.startBlock(source.read());
  }

  /** Stop rules: checked before every training step. */
  @Override
  public synchronized String stopReason() {
    String reason = policy.stopReason(source.read());
    if (TrainingPolicy.isHeat(reason)) {
      noteStopped(reason);
    }
    return reason;
  }

  /** Record that training stopped for {@code reason}; heat starts (or lengthens) a cool-down. */
  public synchronized void noteStopped(String reason) {
    if (TrainingPolicy.isHeat(reason)) {
      if (!cooling) {
        heatStrikes++;
        cooling = true;
        coolUntilNanos = ticker.nanoTime() + policy.coolDownMs(heatStrikes) * 1_000_000L;
      }
    }
  }

  /** A task trained to the end: the next stop for heat starts from the shortest wait again. */
  @Override
  public synchronized void trained() {
    heatStrikes = 0;
  }
}
