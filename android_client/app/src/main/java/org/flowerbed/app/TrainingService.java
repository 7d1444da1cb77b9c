package org.flowerbed.app;

import android.app.Notification;
import android.app.NotificationChannel;
import android.app.NotificationManager;
import android.app.Service;
import android.content.Context;
import android.content.Intent;
import android.content.pm.ServiceInfo;
import android.os.Build;
import android.os.IBinder;
import android.os.PowerManager;
import android.util.Log;
import java.io.File;
import java.io.IOException;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import org.flowerbed.phone.Backoff;
import org.flowerbed.phone.Dataset;
import org.flowerbed.phone.DeviceStatus;
import org.flowerbed.phone.GatewayClient;
import org.flowerbed.phone.GatewayException;
import org.flowerbed.phone.NamedArray;
import org.flowerbed.phone.PhoneAgent;
import org.flowerbed.phone.Sleeper;
import org.flowerbed.phone.Ticker;
import org.flowerbed.phone.Trainer;

/**
 * Foreground service that runs core's {@link PhoneAgent} on a worker thread. The agent waits
 * (without polling) while the device is not charging or not on unmetered Wi-Fi, when the settings
 * ask for that, and abandons a task if the condition is lost mid-training. A partial wake lock
 * keeps the CPU up with the screen off, but only while those conditions hold: a phone waiting for
 * its charger is left free to sleep.
 *
 * <p>Files, in the app's external files directory ({@code
 * /sdcard/Android/data/org.flowerbed.app/files/}, pushed with adb): {@code model.pte} from {@code
 * flowerbed export-android} and {@code train.csv}, rows {@code label,f1,f2,...}.
 */
public final class TrainingService extends Service {
  static final String MODEL_FILE = "model.pte";
  static final String DATA_FILE = "train.csv";
  private static final String TAG = "flowerbed";
  private static final String CHANNEL = "training";
  private static final int NOTIFICATION_ID = 1;

  private PowerManager.WakeLock wakeLock;
  private volatile PhoneAgent agent;
  private Thread worker;

  @Override
  public IBinder onBind(Intent intent) {
    return null;
  }

  @Override
  public int onStartCommand(Intent intent, int flags, int startId) {
    Notification n = notification("starting");
    if (Build.VERSION.SDK_INT >= 34) {
      startForeground(NOTIFICATION_ID, n, ServiceInfo.FOREGROUND_SERVICE_TYPE_SPECIAL_USE);
    } else {
      startForeground(NOTIFICATION_ID, n);
    }
    if (worker == null) {
      PowerManager pm = (PowerManager) getSystemService(Context.POWER_SERVICE);
      wakeLock = pm.newWakeLock(PowerManager.PARTIAL_WAKE_LOCK, "flowerbed:training");
      wakeLock.setReferenceCounted(false);
      worker = new Thread(this::work, "flowerbed-agent");
      worker.start();
    }
    return START_STICKY;
  }

  @Override
  public void onDestroy() {
    PhoneAgent a = agent;
    if (a != null) {
      a.stop();
    }
    if (worker != null) {
      try {
        worker.join(5000);
      } catch (InterruptedException e) {
        Thread.currentThread().interrupt();
      }
      worker = null;
    }
    setAwake(false);
    super.onDestroy();
  }

  /** Hold the wake lock while the device may train, release it while it may not. */
  private synchronized void setAwake(boolean awake) {
    if (wakeLock == null) {
      return;
    }
    if (awake && !wakeLock.isHeld()) {
      wakeLock.acquire();
    } else if (!awake && wakeLock.isHeld()) {
      wakeLock.release();
    }
  }

  /** The worker thread: build the agent from the settings and run it until stopped. */
  private void work() {
    AppSettings s = AppSettings.load(this);
    try {
      File dir = getExternalFilesDir(null);
      final Dataset data = Dataset.readCsv(new File(dir, DATA_FILE));
      final File pte = new File(dir, MODEL_FILE);
      final long[] sampleShape = s.sampleShapeDims();
      final int maxBatch = s.maxBatchSize;
      PhoneAgent.TrainerFactory factory =
          new PhoneAgent.TrainerFactory() {
            private ExecuTorchTrainer trainer;

            @Override
            public Trainer create(List<NamedArray> arrays) {
              if (trainer == null) {
                trainer = ExecuTorchTrainer.load(pte, data, sampleShape, maxBatch, 0);
              }
              trainer.setParameters(arrays);
              return trainer;
            }
          };
      Map<String, Object> info = new LinkedHashMap<String, Object>();
      info.put("model", Build.MANUFACTURER + " " + Build.MODEL);
      info.put("android", Build.VERSION.RELEASE);
      info.put("sdk", Build.VERSION.SDK_INT);
      info.put("cores", Runtime.getRuntime().availableProcessors());
      info.put("examples", data.size());
      agent =
          new PhoneAgent(
              new GatewayClient(s.gatewayUrl, s.token),
              factory,
              wakeWhileAllowed(
                  new AndroidDeviceStatus(this, s.requireCharging, s.requireUnmeteredWifi)),
              Ticker.SYSTEM,
              Sleeper.SYSTEM,
              Backoff.defaults(),
              info,
              this::report,
              20);
      agent.run(0);
      report("stopped");
    } catch (GatewayException e) {
      report("refused by the gateway: " + e.getMessage());
      stopSelf();
    } catch (IOException | IllegalArgumentException e) {
      report("cannot start: " + e.getMessage());
      stopSelf();
    }
  }

  /** The device status, taking or releasing the wake lock each time the agent asks it. */
  private DeviceStatus wakeWhileAllowed(final DeviceStatus device) {
    return new DeviceStatus() {
      @Override
      public Double batteryPct() {
        return device.batteryPct();
      }

      @Override
      public Double tempC() {
        return device.tempC();
      }

      @Override
      public String blockReason() {
        String reason = device.blockReason();
        setAwake(reason == null);
        return reason;
      }
    };
  }

  /** One agent line: to logcat, the notification and the settings screen. */
  private void report(String line) {
    Log.i(TAG, line);
    AppSettings.setLastLine(this, line);
    NotificationManager nm = getSystemService(NotificationManager.class);
    nm.notify(NOTIFICATION_ID, notification(line));
  }

  private Notification notification(String text) {
    NotificationManager nm = getSystemService(NotificationManager.class);
    nm.createNotificationChannel(
        new NotificationChannel(CHANNEL, "Training", NotificationManager.IMPORTANCE_LOW));
    return new Notification.Builder(this, CHANNEL)
        .setContentTitle("flowerbed phone")
        .setContentText(text)
        .setStyle(new Notification.BigTextStyle().bigText(text))
        .setSmallIcon(android.R.drawable.stat_notify_sync)
        .setOngoing(true)
        .build();
  }
}
