package org.flowerbed.app;

import android.content.Context;
import android.content.Intent;
import android.content.IntentFilter;
import android.net.ConnectivityManager;
import android.net.Network;
import android.net.NetworkCapabilities;
import android.os.BatteryManager;
import org.flowerbed.phone.DeviceStatus;

/**
 * Battery level, battery temperature and the training conditions (charging, unmetered Wi-Fi) read
 * from Android's sticky battery broadcast and the connectivity service.
 */
final class AndroidDeviceStatus implements DeviceStatus {
  private final Context context;
  private final boolean requireCharging;
  private final boolean requireUnmeteredWifi;

  AndroidDeviceStatus(Context context, boolean requireCharging, boolean requireUnmeteredWifi) {
    this.context = context.getApplicationContext();
    this.requireCharging = requireCharging;
    this.requireUnmeteredWifi = requireUnmeteredWifi;
  }

  private Intent battery() {
    // A null receiver returns the last sticky ACTION_BATTERY_CHANGED without registering.
    return context.registerReceiver(null, new IntentFilter(Intent.ACTION_BATTERY_CHANGED));
  }

  @Override
  public Double batteryPct() {
    Intent b = battery();
    if (b == null) {
      return null;
    }
    int level = b.getIntExtra(BatteryManager.EXTRA_LEVEL, -1);
    int scale = b.getIntExtra(BatteryManager.EXTRA_SCALE, -1);
    return level < 0 || scale <= 0 ? null : 100.0 * level / scale;
  }

  @Override
  public Double tempC() {
    Intent b = battery();
    if (b == null || !b.hasExtra(BatteryManager.EXTRA_TEMPERATURE)) {
      return null;
    }
    // EXTRA_TEMPERATURE is in tenths of a degree Celsius.
    return b.getIntExtra(BatteryManager.EXTRA_TEMPERATURE, 0) / 10.0;
  }

  @Override
  public String blockReason() {
    if (requireCharging) {
      Intent b = battery();
      if (b == null || b.getIntExtra(BatteryManager.EXTRA_PLUGGED, 0) == 0) {
        return "not charging";
      }
    }
    if (requireUnmeteredWifi && !onUnmeteredWifi()) {
      return "not on unmetered Wi-Fi";
    }
    return null;
  }

  private boolean onUnmeteredWifi() {
    ConnectivityManager cm = context.getSystemService(ConnectivityManager.class);
    Network network = cm == null ? null : cm.getActiveNetwork();
    NetworkCapabilities caps = network == null ? null : cm.getNetworkCapabilities(network);
    return caps != null
        && caps.hasTransport(NetworkCapabilities.TRANSPORT_WIFI)
        && caps.hasCapability(NetworkCapabilities.NET_CAPABILITY_NOT_METERED);
  }
}
