package org.flowerbed.phone;

/**
 * What the device knows about itself: battery and temperature for the metrics, and whether it may
 * train at all right now. The Android app reads these from the battery and network services; a JVM
 * phone may report nothing.
 */
public interface DeviceStatus {
  /** A device that reports nothing and never refuses to train. */
  DeviceStatus NONE = fixed(null, null, null);

  /**
   * A device that always reports the same: a JVM phone's status from its command line, or a test's.
   *
   * @param batteryPct battery charge in percent, or null
   * @param tempC temperature in degrees Celsius, or null
   * @param blockReason why it must not take work, or null if it may
   */
  static DeviceStatus fixed(final Double batteryPct, final Double tempC, final String blockReason) {
    return new DeviceStatus() {
      @Override
      public Double batteryPct() {
        return batteryPct;
      }

      @Override
      public Double tempC() {
        return tempC;
      }

      @Override
      public String blockReason() {
        return blockReason;
      }
    };
  }

  /** Battery charge in percent, or null if unknown. */
  Double batteryPct();

  /** Battery (or SoC) temperature in degrees Celsius, or null if unknown. */
  Double tempC();

  /**
   * Why the device must not take work now (for example "not charging", "metered network"), or null
   * if it may. Asked before taking work.
   */
  String blockReason();

  /**
   * Why training in progress must stop now, or null if it may go on; asked before every training
   * step. By default the same as {@link #blockReason()}; a policy may be more lenient once training
   * has started (hysteresis).
   */
  default String stopReason() {
    return blockReason();
  }

  /** Called after a training task ran to its end (a policy may forget past overheating). */
  default void trained() {}
}
