package org.flowerbed.app;

import android.content.Context;
import android.os.Build;
import android.os.PowerManager;
import android.util.Log;
import androidx.annotation.NonNull;
import androidx.work.ExistingWorkPolicy;
import androidx.work.Worker;
import androidx.work.WorkerParameters;
import java.io.File;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.concurrent.Executors;
import java.util.concurrent.ScheduledExecutorService;
import java.util.concurrent.TimeUnit;
import org.flowerbed.phone.Backoff;
import org.flowerbed.phone.Dataset;
import org.flowerbed.phone.GatewayClient;
import org.flowerbed.phone.GatewayException;
import org.flowerbed.phone.NamedArray;
import org.flowerbed.phone.PhoneAgent;
import org.flowerbed.phone.PolicyStatus;
import org.flowerbed.phone.ProgramCache;
import org.flowerbed.phone.ProgramInfo;
import org.flowerbed.phone.ProgramTrainer;
import org.flowerbed.phone.Sleeper;
import org.flowerbed.phone.Task;
import org.flowerbed.phone.Ticker;
import org.flowerbed.phone.Trainer;
import org.flowerbed.phone.TrainingPolicy;

/**
 * One WorkManager job: run core's {@link PhoneAgent} while the policy allows, until no task came
 * for {@link #IDLE_MS}, the device blocks work, or {@link #BUDGET_MS} passed (WorkManager stops a
 * job after 10 minutes); then ask for the next job. A partial wake lock is held only while a task
 * trains, with the timeout {@link TrainingPolicy#wakeLockTimeoutMs} of that task.
 *
 * <p>Programs come from the gateway (cached by hash in the app's files, {@code programs/});
 * local data is {@code train.csv} in the app's external files directory (rows {@code
 * label,f1,f2,...}, pushed with adb or written by the user's own app).
 */
public final class TrainingWorker extends Worker {
  static final String DATA_FILE = "train.csv";
  static final long IDLE_MS = 120_000;
  static final long BUDGET_MS = 9 * 60_000;
  private static final String TAG = "flowerbed";

  public TrainingWorker(@NonNull Context context, @NonNull WorkerParameters params) {
    super(context, params);
  }

  @NonNull
  @Override
  public Result doWork() {
    Context ctx = getApplicationContext();
    AppSettings s = AppSettings.load(ctx);
    TrainingPolicy policy = s.policy();
    PowerManager pm = ctx.getSystemService(PowerManager.class);
    final PowerManager.WakeLock lock =
        pm.newWakeLock(PowerManager.PARTIAL_WAKE_LOCK, "flowerbed:training");
    lock.setReferenceCounted(false);
    ScheduledExecutorService timer = Executors.newSingleThreadScheduledExecutor();
    try {
      KeystoreTokens.Enrolment e = KeystoreTokens.load(ctx);
      if (e == null) {
        report(ctx, "not enrolled: scan the enrolment QR code");
        return Result.failure();
      }
      final Dataset data = Dataset.readCsv(new File(ctx.getExternalFilesDir(null), DATA_FILE));
      GatewayClient client =
          new GatewayClient(e.gateway, e.token)
              .appVersions(BuildConfig.VERSION_NAME, BuildConfig.EXECUTORCH_VERSION);
      if (e.pin != null) {
        client.pinCertificate(e.pin);
      }
      final PhoneAgent agent =
          new PhoneAgent(
                  client,
                  new ProgramTrainers(data),
                  new PolicyStatus(policy, new AndroidDeviceState(ctx), Ticker.SYSTEM),
                  Ticker.SYSTEM,
                  Sleeper.SYSTEM,
                  Backoff.defaults(),
                  deviceInfo(data),
                  line -> report(ctx, line),
                  20)
              .withPrograms(
                  new ProgramCache(
                      new File(ctx.getFilesDir(), "programs"), client::downloadProgram),
                  BuildConfig.EXECUTORCH_VERSION)
              .withTaskListener(
                  new PhoneAgent.TaskListener() {
                    @Override
                    public void taskStarted(Task task) {
                      lock.acquire(TrainingPolicy.wakeLockTimeoutMs(task.expiresInS));
                    }

                    @Override
                    public void taskEnded(Task task) {
                      if (lock.isHeld()) {
                        lock.release();
                      }
                    }
                  })
              .returnWhenIdle(IDLE_MS);
      timer.schedule(agent::stop, BUDGET_MS, TimeUnit.MILLISECONDS);
      agent.run(0);
      Scheduler.next(ctx, policy, ExistingWorkPolicy.APPEND_OR_REPLACE);
      return Result.success();
    } catch (GatewayException ex) {
      // Token refused or certificate not the pinned one: re-enrolment is needed.
      report(ctx, "refused: " + ex.getMessage());
      return Result.failure();
    } catch (Exception ex) {
      report(ctx, "cannot run: " + ex.getMessage());
      return Result.retry();
    } finally {
      timer.shutdownNow();
      if (lock.isHeld()) {
        lock.release();
      }
    }
  }

  @Override
  public void onStopped() {
    // WorkManager stops the job when a constraint is lost; the agent notices at its next check
    // (PolicyStatus), and the job's thread is interrupted.
    super.onStopped();
  }

  private static Map<String, Object> deviceInfo(Dataset data) {
    Map<String, Object> info = new LinkedHashMap<String, Object>();
    info.put("model", Build.MANUFACTURER + " " + Build.MODEL);
    info.put("android", Build.VERSION.RELEASE);
    info.put("sdk", Build.VERSION.SDK_INT);
    info.put("cores", Runtime.getRuntime().availableProcessors());
    info.put("examples", data.size());
    return info;
  }

  private static void report(Context ctx, String line) {
    Log.i(TAG, line);
    AppSettings.setLastLine(ctx, line);
  }

  /** Trainers on the task's program: the loaded program is kept while tasks name the same file. */
  private static final class ProgramTrainers implements PhoneAgent.TrainerFactory {
    private final Dataset data;
    private File loaded;
    private ExecuTorchProgram runner;

    ProgramTrainers(Dataset data) {
      this.data = data;
    }

    @Override
    public Trainer create(List<NamedArray> arrays) {
      throw new IllegalArgumentException(
          "this app trains ExecuTorch programs and the task names none: export one with "
              + "flowerbed export-android and start the gateway with --program");
    }

    @Override
    public Trainer create(List<NamedArray> arrays, ProgramInfo info, File program, long seed) {
      if (program == null) {
        return create(arrays);
      }
      if (!program.equals(loaded)) {
        runner = new ExecuTorchProgram(program);
        loaded = program;
      }
      ProgramTrainer trainer = new ProgramTrainer(runner, info, data, seed);
      trainer.setParameters(arrays);
      return trainer;
    }
  }
}
