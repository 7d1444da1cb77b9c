package org.flowerbed.phone;

/**
 * One reading of what decides whether a phone may train: power, network, idleness and heat. The
 * Android app fills it from BatteryManager, ConnectivityManager and PowerManager; tests build it
 * by hand.
 */
public final class DeviceState {
  /** Android's PowerManager thermal statuses (THERMAL_STATUS_NONE ... _SHUTDOWN). */
  public static final int THERMAL_UNKNOWN = -1;

  public static final int THERMAL_NONE = 0;
  public static final int THERMAL_LIGHT = 1;
  public static final int THERMAL_MODERATE = 2;
  public static final int THERMAL_SEVERE = 3;
  public static final int THERMAL_CRITICAL = 4;

  /** Battery charge in percent, or null if unknown. */
  public final Double batteryPct;

  public final boolean charging;
  /** The system's own "battery low" flag (Intent.ACTION_BATTERY_LOW). */
  public final boolean batteryLow;

  public final boolean connected;
  /** On a network that is not metered (Wi-Fi, Ethernet). */
  public final boolean unmetered;
  /** Device idle (Doze) state: TRUE/FALSE, or null where the platform does not say. */
  public final Boolean idle;
  /** One of the THERMAL_* constants. */
  public final int thermalStatus;
  /** Battery temperature in degrees Celsius, or null if unknown. */
  public final Double tempC;

  public DeviceState(
      Double batteryPct,
      boolean charging,
      boolean batteryLow,
      boolean connected,
      boolean unmetered,
      Boolean idle,
      int thermalStatus,
      Double tempC) {
    this.batteryPct = batteryPct;
    this.charging = charging;
    this.batteryLow = batteryLow;
    this.connected = connected;
    this.unmetered = unmetered;
    this.idle = idle;
    this.thermalStatus = thermalStatus;
    this.tempC = tempC;
  }

  /** Reads the device now. */
  public interface Source {
    DeviceState read();
  }
}
