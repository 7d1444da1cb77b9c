package org.flowerbed.phone;

/**
 * When a phone may train and when it must stop: the decisions behind the app's scheduling, kept
 * here (plain Java, unit-tested with fake device states) so the Android code only reads sensors
 * and obeys.
 *
 * <p>The app schedules its work with WorkManager constraints ({@link #requiresCharging()} etc.);
 * those gate the start only, so the same rules are checked again here before work is taken and
 * before every training step. Training stops at once when the phone is unplugged (if charging is
 * required), the battery falls below the floor or the phone gets {@link DeviceState#THERMAL_SEVERE}
 * hot; after stopping for heat it waits before training again, twice as long after each stop in a
 * row (from {@code coolDownMs} up to {@code maxCoolDownMs}). Stop thresholds sit below start
 * thresholds (hysteresis), so a phone at the edge does not start and stop every step.
 */
public final class TrainingPolicy {
  private final boolean requireCharging;
  private final boolean requireUnmetered;
  private final boolean requireIdle;
  private final double minBatteryPct;
  private final long coolDownMs;
  private final long maxCoolDownMs;

  /**
   * @param requireCharging train only while plugged in
   * @param requireUnmetered take work only on an unmetered network (uploads are model-sized)
   * @param requireIdle train only while the device is idle, where the platform reports it
   * @param minBatteryPct start only at or above this charge; stop 5 points below it
   * @param coolDownMs wait after the first stop for heat
   * @param maxCoolDownMs longest wait after repeated stops for heat
   */
  public TrainingPolicy(
      boolean requireCharging,
      boolean requireUnmetered,
      boolean requireIdle,
      double minBatteryPct,
      long coolDownMs,
      long maxCoolDownMs) {
    if (minBatteryPct < 0 || minBatteryPct > 100) {
      throw new IllegalArgumentException("minBatteryPct must be in [0, 100], got " + minBatteryPct);
    }
    if (coolDownMs <= 0 || maxCoolDownMs < coolDownMs) {
      throw new IllegalArgumentException("need 0 < coolDownMs <= maxCoolDownMs");
    }
    this.requireCharging = requireCharging;
    this.requireUnmetered = requireUnmetered;
    this.requireIdle = requireIdle;
    this.minBatteryPct = minBatteryPct;
    this.coolDownMs = coolDownMs;
    this.maxCoolDownMs = maxCoolDownMs;
  }

  /** Charging, unmetered, battery not low, idle not required; 5 min to 2 h cool-downs. */
  public static TrainingPolicy defaults() {
    return new TrainingPolicy(true, true, false, 30, 5 * 60_000L, 2 * 3_600_000L);
  }

  /** Battery drop below the start floor that stops training in progress. */
  static final double STOP_MARGIN_PCT = 5;

  /** Seconds added to a task's expiry for a training wake lock's timeout. */
  static final long WAKE_LOCK_SLACK_MS = 60_000;

  /** The longest a wake lock is ever held. */
  static final long MAX_WAKE_LOCK_MS = 3_600_000;

  /** Why the phone must not take work now, or null if it may. */
  public String startBlock(DeviceState s) {
    if (!s.connected) {
      return "no network";
    }
    if (requireUnmetered && !s.unmetered) {
      return "metered network";
    }
    if (requireCharging && !s.charging) {
      return "not charging";
    }
    if (s.batteryLow || (s.batteryPct != null && s.batteryPct < minBatteryPct)) {
      return "battery below " + fmt(minBatteryPct) + "%";
    }
    if (requireIdle && Boolean.FALSE.equals(s.idle)) {
      return "device in use";
    }
    if (s.thermalStatus >= DeviceState.THERMAL_MODERATE) {
      return "device too warm (thermal status " + s.thermalStatus + ")";
    }
    return null;
  }

  /** Why training in progress must stop now, or null if it may go on. */
  public String stopReason(DeviceState s) {
    if (requireCharging && !s.charging) {
      return "unplugged";
    }
    if (s.batteryPct != null && s.batteryPct < minBatteryPct - STOP_MARGIN_PCT) {
      return "battery below " + fmt(minBatteryPct - STOP_MARGIN_PCT) + "%";
    }
    if (s.thermalStatus >= DeviceState.THERMAL_SEVERE) {
      return "device too hot (thermal status " + s.thermalStatus + ")";
    }
    return null;
  }

  /** True if {@code reason} (from {@link #stopReason}) was heat: a cool-down follows. */
  public static boolean isHeat(String reason) {
    return reason != null && reason.startsWith("device too");
  }

  /** Wait after the {@code strikes}-th stop for heat in a row (1, 2, ...): doubling, capped. */
  public long coolDownMs(int strikes) {
    if (strikes <= 0) {
      return 0;
    }
    long wait = coolDownMs;
    for (int i = 1; i < strikes && wait < maxCoolDownMs; i++) {
      wait *= 2;
    }
    return Math.min(wait, maxCoolDownMs);
  }

  /**
   * Timeout of the wake lock held while training a task that expires in {@code expiresInS}: the
   * task cannot be used after it expires, so the lock never outlives it by more than a minute, and
   * never exceeds an hour.
   */
  public static long wakeLockTimeoutMs(double expiresInS) {
    if (!(expiresInS > 0)) {
      return WAKE_LOCK_SLACK_MS;
    }
    return Math.min(MAX_WAKE_LOCK_MS, (long) Math.ceil(expiresInS * 1000) + WAKE_LOCK_SLACK_MS);
  }

  /** WorkManager constraint: requires charging. */
  public boolean requiresCharging() {
    return requireCharging;
  }

  /** WorkManager constraint: NetworkType.UNMETERED (else CONNECTED). */
  public boolean requiresUnmetered() {
    return requireUnmetered;
  }

  /** WorkManager constraint: requires device idle (API 23+). */
  public boolean requiresIdle() {
    return requireIdle;
  }

  /** WorkManager constraint: battery not low. */
  public boolean requiresBatteryNotLow() {
    return minBatteryPct > 0;
  }

  private static String fmt(double pct) {
    return pct == Math.rint(pct) ? String.valueOf((long) pct) : String.valueOf(pct);
  }
}
