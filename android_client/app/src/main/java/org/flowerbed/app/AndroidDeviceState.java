package org.flowerbed.app;

import android.content.Context;
import android.content.Intent;
import android.content.IntentFilter;
import android.net.ConnectivityManager;
import android.net.Network;
import android.net.NetworkCapabilities;
import android.os.BatteryManager;
import android.os.Build;
import android.os.PowerManager;
import org.flowerbed.phone.DeviceState;

/**
 * Reads the phone for core's {@link org.flowerbed.phone.TrainingPolicy}: battery (sticky
 * ACTION_BATTERY_CHANGED), network (ConnectivityManager), Doze idle and thermal status
 * (PowerManager). Only reads: every decision is the core's.
 */
final class AndroidDeviceState implements DeviceState.Source {
  private final Context context;

  AndroidDeviceState(Context context) {
    this.context = context.getApplicationContext();
  }

  @Override
  public DeviceState read() {
    // A null receiver returns the last sticky broadcast without registering.
    Intent b = context.registerReceiver(null, new IntentFilter(Intent.ACTION_BATTERY_CHANGED));
    Double pct = null;
    Double temp = null;
    boolean charging = false;
    boolean low = false;
    if (b != null) {
      int level = b.getIntExtra(BatteryManager.EXTRA_LEVEL, -1);
      int scale = b.getIntExtra(BatteryManager.EXTRA_SCALE, -1);
      pct = level < 0 || scale <= 0 ? null : 100.0 * level / scale;
      charging = b.getIntExtra(BatteryManager.EXTRA_PLUGGED, 0) != 0;
      if (b.hasExtra(BatteryManager.EXTRA_TEMPERATURE)) {
        temp = b.getIntExtra(BatteryManager.EXTRA_TEMPERATURE, 0) / 10.0; // tenths of a degree
      }
      if (Build.VERSION.SDK_INT >= 28) {
        low = b.getBooleanExtra(BatteryManager.EXTRA_BATTERY_LOW, false);
      }
    }
    ConnectivityManager cm = context.getSystemService(ConnectivityManager.class);
    Network network = cm == null ? null : cm.getActiveNetwork();
    NetworkCapabilities caps = network == null ? null : cm.getNetworkCapabilities(network);
    boolean connected =
        caps != null && caps.hasCapability(NetworkCapabilities.NET_CAPABILITY_INTERNET);
    boolean unmetered =
        caps != null && caps.hasCapability(NetworkCapabilities.NET_CAPABILITY_NOT_METERED);
    PowerManager pm = context.getSystemService(PowerManager.class);
    Boolean idle = pm == null ? null : pm.isDeviceIdleMode();
    int thermal = DeviceState.THERMAL_UNKNOWN;
    if (pm != null && Build.VERSION.SDK_INT >= 29) {
      thermal = pm.getCurrentThermalStatus(); // same numbering as DeviceState.THERMAL_*
    }
    return new DeviceState(pct, charging, low, connected, unmetered, idle, thermal, temp);
  }
}
