package org.flowerbed.app;

import android.content.Context;
import androidx.work.Constraints;
import androidx.work.ExistingPeriodicWorkPolicy;
import androidx.work.ExistingWorkPolicy;
import androidx.work.NetworkType;
import androidx.work.OneTimeWorkRequest;
import androidx.work.PeriodicWorkRequest;
import androidx.work.WorkManager;
import java.util.concurrent.TimeUnit;
import org.flowerbed.phone.TrainingPolicy;

/**
 * Training as WorkManager jobs: the constraints come from core's {@link TrainingPolicy}; a
 * periodic job (every 15 minutes, WorkManager's minimum) is the safety net, and each job that ends
 * asks for the next one at once, so a phone with work keeps working while its conditions hold.
 * WorkManager keeps both across reboots.
 */
final class Scheduler {
  static final String PERIODIC = "flowerbed-periodic";
  static final String NEXT = "flowerbed-next";

  private Scheduler() {}

  static Constraints constraints(TrainingPolicy policy) {
    Constraints.Builder c =
        new Constraints.Builder()
            .setRequiredNetworkType(
                policy.requiresUnmetered() ? NetworkType.UNMETERED : NetworkType.CONNECTED)
            .setRequiresCharging(policy.requiresCharging())
            .setRequiresBatteryNotLow(policy.requiresBatteryNotLow());
    if (policy.requiresIdle()) {
      c.setRequiresDeviceIdle(true);
    }
    return c.build();
  }

  /** Start (or keep) the periodic job and run one as soon as the constraints allow. */
  static void start(Context context, TrainingPolicy policy) {
    WorkManager wm = WorkManager.getInstance(context);
    Constraints c = constraints(policy);
    wm.enqueueUniquePeriodicWork(
        PERIODIC,
        ExistingPeriodicWorkPolicy.UPDATE,
        new PeriodicWorkRequest.Builder(TrainingWorker.class, 15, TimeUnit.MINUTES)
            .setConstraints(c)
            .build());
    next(context, policy, ExistingWorkPolicy.REPLACE);
  }

  /**
   * One more job as soon as the constraints allow. A finishing job passes APPEND_OR_REPLACE (the
   * next one waits for it; REPLACE would cancel the job that asks).
   */
  static void next(Context context, TrainingPolicy policy, ExistingWorkPolicy existing) {
    WorkManager.getInstance(context)
        .enqueueUniqueWork(
            NEXT,
            existing,
            new OneTimeWorkRequest.Builder(TrainingWorker.class)
                .setConstraints(constraints(policy))
                .build());
  }

  static void stop(Context context) {
    WorkManager wm = WorkManager.getInstance(context);
    wm.cancelUniqueWork(PERIODIC);
    wm.cancelUniqueWork(NEXT);
  }
}
