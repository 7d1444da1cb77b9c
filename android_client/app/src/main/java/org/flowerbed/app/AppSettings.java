package org.flowerbed.app;

import android.content.Context;
import android.content.SharedPreferences;
import org.flowerbed.phone.TrainingPolicy;

/** The training conditions the user sets (the enrolment is in {@link KeystoreTokens}). */
final class AppSettings {
  private static final String PREFS = "flowerbed";

  /** Train only while plugged in (default on). */
  boolean requireCharging;

  /** Take work only on an unmetered network (default on). */
  boolean requireUnmetered;

  /** Train only while the phone is idle (default off: idle windows are short). */
  boolean requireIdle;

  /** Start only at or above this battery charge, percent (default 30). */
  int minBatteryPct;

  static AppSettings load(Context context) {
    SharedPreferences p = context.getSharedPreferences(PREFS, Context.MODE_PRIVATE);
    AppSettings s = new AppSettings();
    s.requireCharging = p.getBoolean("require_charging", true);
    s.requireUnmetered = p.getBoolean("require_unmetered", true);
    s.requireIdle = p.getBoolean("require_idle", false);
    s.minBatteryPct = p.getInt("min_battery_pct", 30);
    return s;
  }

  void save(Context context) {
    context
        .getSharedPreferences(PREFS, Context.MODE_PRIVATE)
        .edit()
        .putBoolean("require_charging", requireCharging)
        .putBoolean("require_unmetered", requireUnmetered)
        .putBoolean("require_idle", requireIdle)
        .putInt("min_battery_pct", minBatteryPct)
        .apply();
  }

  /** Core's policy with these conditions: 5-minute to 2-hour cool-downs after overheating. */
  TrainingPolicy policy() {
    return new TrainingPolicy(
        requireCharging, requireUnmetered, requireIdle, minBatteryPct, 5 * 60_000L, 7_200_000L);
  }

  /** The last line the worker logged, for the settings screen. */
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
