package org.flowerbed.app;

import android.content.Context;
import android.content.SharedPreferences;

/** What the user sets on the settings screen, kept in SharedPreferences. */
final class AppSettings {
  private static final String PREFS = "flowerbed";

  /** Gateway root, e.g. http://192.168.1.10:8765. */
  String gatewayUrl;

  /** This phone's bearer token, from the gateway's token file. */
  String token;

  /** Train only while plugged in (default on). */
  boolean requireCharging;

  /** Train only on an unmetered Wi-Fi network (default on). */
  boolean requireUnmeteredWifi;

  /** Shape of one sample as the .pte expects it, e.g. "1,8,8" for digits. */
  String sampleShape;

  /** Largest batch the .pte accepts (flowerbed export-android --max-batch-size). */
  int maxBatchSize;

  static AppSettings load(Context context) {
    SharedPreferences p = context.getSharedPreferences(PREFS, Context.MODE_PRIVATE);
    AppSettings s = new AppSettings();
    s.gatewayUrl = p.getString("gateway_url", "http://192.168.1.10:8765");
    s.token = p.getString("token", "");
    s.requireCharging = p.getBoolean("require_charging", true);
    s.requireUnmeteredWifi = p.getBoolean("require_unmetered_wifi", true);
    s.sampleShape = p.getString("sample_shape", "1,8,8");
    s.maxBatchSize = p.getInt("max_batch_size", 64);
    return s;
  }

  void save(Context context) {
    context
        .getSharedPreferences(PREFS, Context.MODE_PRIVATE)
        .edit()
        .putString("gateway_url", gatewayUrl)
        .putString("token", token)
        .putBoolean("require_charging", requireCharging)
        .putBoolean("require_unmetered_wifi", requireUnmeteredWifi)
        .putString("sample_shape", sampleShape)
        .putInt("max_batch_size", maxBatchSize)
        .apply();
  }

  /**
   * The sample shape as numbers.
   *
   * @throws IllegalArgumentException if it is not a comma-separated list of positive integers
   */
  long[] sampleShapeDims() {
    String[] parts = sampleShape.split(",");
    long[] dims = new long[parts.length];
    for (int i = 0; i < parts.length; i++) {
      try {
        dims[i] = Long.parseLong(parts[i].trim());
      } catch (NumberFormatException e) {
        dims[i] = 0;
      }
      if (dims[i] < 1) {
        throw new IllegalArgumentException(
            "sample shape must be positive integers separated by commas, like 1,8,8; got '"
                + sampleShape
                + "'");
      }
    }
    return dims;
  }

  /** The last line the service logged, for the settings screen. */
  static String lastLine(Context context) {
    return context
        .getSharedPreferences(PREFS, Context.MODE_PRIVATE)
        .getString("last_line", "not started");
  }

  static void setLastLine(Context context, String line) {
    context
        .getSharedPreferences(PREFS, Context.MODE_PRIVATE)
        .edit()
        .putString("last_line", line)
        .apply();
  }
}
