package org.flowerbed.phone;

import java.io.File;
import java.io.IOException;
import java.io.InterruptedIOException;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Locale;
import java.util.Map;

/**
 * The phone's work loop, shared by the JVM phone ({@link PhoneMain}) and the Android app: hello,
 * long-poll, download the arrays, train or evaluate them, upload, complete; one log line per task.
 *
 * <p>Network trouble is survived: the client retries each request, and when it gives up the agent
 * waits and says hello again with the same token, so the phone comes back as the same Flower node.
 * A task that cannot be done (bad arrays, bad config, trainer error, the device may no longer
 * train) is failed with its reason. Only a refusal of the phone itself (401 wrong token, 426
 * unsupported protocol) ends {@link #run} with an exception.
 */
public final class PhoneAgent {
  /** Builds a trainer holding the arrays of a task. */
  public interface TrainerFactory {
    /**
     * @throws IllegalArgumentException if the arrays do not fit this phone's model or data
     */
    Trainer create(List<NamedArray> arrays);

    /**
     * A trainer for a task, run with {@code program} (a cached, hash-checked ExecuTorch program
     * described by {@code info}; both null when the task names none), sampling with {@code seed}
     * (different on every phone and task). The default suits trainers without a runtime: it
     * refuses programs and ignores the seed.
     *
     * @throws IllegalArgumentException if the arrays or the program do not fit
     */
    default Trainer create(List<NamedArray> arrays, ProgramInfo info, File program, long seed) {
      if (program != null) {
        throw new IllegalArgumentException(
            "program: this phone has no ExecuTorch runtime to run a training program");
      }
      return create(arrays);
    }
  }

  /** Where the agent's one-line reports go. */
  public interface Log {
    void line(String text);
  }

  /**
   * Told when the phone starts and ends work on a task: the Android app holds a wake lock, with
   * a timeout ({@link TrainingPolicy#wakeLockTimeoutMs}), exactly between the two.
   */
  public interface TaskListener {
    void taskStarted(Task task);

    void taskEnded(Task task);
  }

  private final GatewayClient client;

  /** Seconds kept free before a task's expiry for the upload and complete round trips. */
  static final double UPLOAD_SLACK_S = 1.0;

  private final TrainerFactory factory;
  private final DeviceStatus device;
  private final Ticker ticker;
  private final Sleeper sleeper;
  private final Backoff reconnect;
  private final Map<String, Object> deviceInfo;
  private final Log log;
  private final int pollWaitS;
  private ProgramCache programs;
  private String runtimeVersion;
  private TaskListener listener;
  private long idleLimitNanos;
  private long tasksSeen;
  private volatile boolean stopping;
  private volatile Thread runner;
  private Hello hello;

  /**
   * @param deviceInfo free-form facts sent with hello (model, cores, ...)
   * @param reconnect waits between reconnect attempts after the client gave up a request
   * @param pollWaitS seconds of each long poll
   */
  public PhoneAgent(
      GatewayClient client,
      TrainerFactory factory,
      DeviceStatus device,
      Ticker ticker,
      Sleeper sleeper,
      Backoff reconnect,
      Map<String, Object> deviceInfo,
      Log log,
      int pollWaitS) {
    this.client = client;
    this.factory = factory;
    this.device = device;
    this.ticker = ticker;
    this.sleeper = sleeper;
    this.reconnect = reconnect;
    this.deviceInfo = deviceInfo;
    this.log = log;
    this.pollWaitS = pollWaitS;
  }

  /** Seconds between hellos while the gateway asks for an app update (HTTP 426). */
  static final long UPDATE_RETRY_MS = 3_600_000L;

  /**
   * Run tasks that name a training program: fetch programs into {@code cache} and check them
   * against {@code runtimeVersion} (this phone's ExecuTorch version). Without it such tasks fail.
   */
  public PhoneAgent withPrograms(ProgramCache cache, String runtimeVersion) {
    this.programs = cache;
    this.runtimeVersion = runtimeVersion;
    return this;
  }

  /** Call {@code listener} around every task. */
  public PhoneAgent withTaskListener(TaskListener listener) {
    this.listener = listener;
    return this;
  }

  /**
   * Make {@link #run} return once no task has arrived for {@code idleLimitMs} (0: never), or the
   * device blocks work: scheduled work then ends and hands the phone back to the system instead
   * of polling (and holding the CPU) while there is nothing to do.
   */
  public PhoneAgent returnWhenIdle(long idleLimitMs) {
    this.idleLimitNanos = idleLimitMs * 1_000_000L;
    return this;
  }

  /** Ask {@link #run} to return soon: aborts the request in flight; safe from any thread. */
  public void stop() {
    stopping = true;
    client.close();
    Thread t = runner;
    if (t != null) {
      t.interrupt();
    }
  }

  /**
   * Work until {@link #stop} or until {@code maxTasks} tasks were handled (0: no limit).
   *
   * <p>A gateway that speaks no protocol revision of this app (426) does not end the run: the
   * phone logs that it needs an update and says hello again every {@link #UPDATE_RETRY_MS}, so it
   * comes back by itself when the gateway is rolled back.
   *
   * @return the number of tasks handled (completed, failed, expired or rejected)
   * @throws GatewayException if the gateway refuses this phone's token (401), or its certificate
   *     is not the one this phone trusts
   */
  public int run(int maxTasks) throws GatewayException {
    runner = Thread.currentThread();
    int handled = 0;
    int failures = 0;
    String lastBlock = null;
    long lastWork = ticker.nanoTime();
    try {
      while (!stopping && (maxTasks <= 0 || handled < maxTasks)) {
        if (idleLimitNanos > 0 && ticker.nanoTime() - lastWork >= idleLimitNanos) {
          log.line("idle: no task for " + idleLimitNanos / 1_000_000_000L + " s");
          break;
        }
        try {
          if (hello == null) {
            hello = client.hello(deviceInfo);
            log.line(
                "hello node_id="
                    + hello.nodeIdText()
                    + " phone="
                    + hello.phone
                    + " chunk_bytes="
                    + hello.chunkBytes);
          }
          String block = device.blockReason();
          if (block != null) {
            if (!block.equals(lastBlock)) {
              log.line("waiting reason=\"" + block + "\"");
            }
            lastBlock = block;
            if (idleLimitNanos > 0) {
              break; // scheduled work: the scheduler runs it again when allowed
            }
            sleeper.sleep(1000L * Math.max(1, hello.pollS));
            continue;
          }
          lastBlock = null;
          Task task = client.pollTask(pollWaitS);
          failures = 0;
          if (task != null) {
            if (listener != null) {
              listener.taskStarted(task);
            }
            try {
              log.line(handle(task));
            } finally {
              if (listener != null) {
                listener.taskEnded(task);
              }
            }
            handled++;
            lastWork = ticker.nanoTime();
          }
        } catch (GatewayException e) {
          if (e.status() == 426) {
            log.line("update required reason=\"" + e.getMessage() + "\"");
            hello = null;
            sleepQuietly(UPDATE_RETRY_MS);
            continue;
          }
          if (isRefusal(e)) {
            log.line("refused status=" + e.status() + " reason=\"" + e.getMessage() + "\"");
            throw e;
          }
          failures = pause("gateway error", e, failures);
        } catch (InterruptedIOException e) {
          if (!stopping) {
            failures = pause("interrupted", e, failures);
          }
        } catch (IOException e) {
          failures = pause("network error", e, failures);
        }
      }
    } finally {
      runner = null;
    }
    return handled;
  }

  private static boolean isRefusal(GatewayException e) {
    return e.status() == 401
        || e.status() == 426
        || e.status() == GatewayException.CERTIFICATE_REFUSED;
  }

  /** Log, forget the session (the next round says hello again) and wait before retrying. */
  private int pause(String what, IOException e, int failures) {
    if (stopping) {
      return failures;
    }
    log.line("reconnecting after " + what + ": " + e.getMessage());
    hello = null;
    sleepQuietly(reconnect.delayMs(failures));
    return failures + 1;
  }

  private void sleepQuietly(long ms) {
    try {
      sleeper.sleep(ms);
    } catch (InterruptedIOException ie) {
      // stop() interrupts the wait; the loop condition sees the flag
    }
  }

  /**
   * Do one task and describe the outcome in one line.
   *
   * @throws IOException on network trouble (the task is asked for again after reconnecting, as the
   *     gateway hands out the same task until it is completed or expires) or a refusal
   */
  private String handle(Task task) throws IOException {
    long received = ticker.nanoTime();
    String head = "task=" + task.id + " type=" + task.type;
    String step = "download";
    try {
      File program = null;
      if (task.program != null) {
        step = "program";
        program = fetchProgram(task.program);
      }
      step = "download";
      byte[] blob = client.downloadArrays(task);
      double downloadS = (ticker.nanoTime() - received) / 1e9;
      step = "decode";
      List<NamedArray> arrays = TensorCodec.decode(blob);
      if (task.program != null) {
        task.program.checkArrays(arrays);
      }
      step = "build";
      Trainer trainer = factory.create(arrays, task.program, program, taskSeed(tasksSeen++));
      Map<String, Object> metrics;
      String detail;
      if (task.isTrain()) {
        step = "train";
        TrainSettings settings =
            TrainSettings.fromConfig(task.config, trainer.numExamples())
                .capDeadline(trainingBudgetS(task, received, downloadS));
        TrainingLoop.Report report = TrainingLoop.train(trainer, settings, ticker, gate());
        step = "upload";
        client.uploadResult(
            task.id, TensorCodec.encode(trainer.getParameters()), hello.chunkBytes);
        metrics = report.metrics(device);
        if (!report.deadlineHit) {
          device.trained();
        }
        detail =
            String.format(
                Locale.ROOT,
                " num-steps=%d num-examples=%d train-time-s=%.4f loss=%.6f deadline-hit=%b",
                report.numSteps,
                report.numExamples,
                report.trainTimeS,
                report.meanLoss,
                report.deadlineHit);
      } else {
        step = "evaluate";
        Trainer.Evaluation e = trainer.evaluate();
        metrics = new LinkedHashMap<String, Object>();
        metrics.put("num-examples", (long) e.examples);
        metrics.put("eval-loss", e.loss);
        metrics.put("eval-acc", e.accuracy);
        TrainingLoop.putIfKnown(metrics, "battery-pct", device.batteryPct());
        TrainingLoop.putIfKnown(metrics, "temp-c", device.tempC());
        detail =
            String.format(
                Locale.ROOT,
                " num-examples=%d eval-loss=%.6f eval-acc=%.4f",
                e.examples,
                e.loss,
                e.accuracy);
      }
      step = "complete";
      client.complete(task.id, metrics);
      return head + " status=accepted" + detail;
    } catch (GatewayException e) {
      if (isRefusal(e)) {
        throw e;
      }
      if (e.status() == GatewayException.PROTOCOL_VIOLATION) {
        // Asking again would get the same broken answer: give the task up instead.
        return head + " status=failed at=" + step + reason(e) + giveUp(task, step, e);
      }
      String status = e.status() == 404 ? "expired" : "rejected";
      return head + " status=" + status + " http=" + e.status() + " at=" + step + reason(e);
    } catch (MalformedBlobException | TrainingLoop.Abandoned | RuntimeException e) {
      // RuntimeException covers bad arrays or config (IllegalArgumentException) and the ways a
      // trainer (e.g. the native ExecuTorch runtime) may fail: the task is given up with its
      // reason and the phone keeps serving.
      return head + " status=failed at=" + step + reason(e) + giveUp(task, step, e);
    }
  }

  /** The task's program file: cached by hash, else downloaded and checked; runtime checked. */
  private File fetchProgram(ProgramInfo info) throws IOException {
    if (programs == null) {
      throw new IllegalArgumentException(
          "program: this phone keeps no program cache, so it cannot run program '"
              + info.name()
              + "'");
    }
    info.checkRuntime(runtimeVersion);
    return programs.fetch(info);
  }

  /**
   * The sampling seed of this phone's {@code n}-th task: the node id and the task count mixed by
   * SplitMix64's finaliser (Steele, Lea, Flood, "Fast splittable pseudorandom number generators",
   * OOPSLA 2014), so no two phones draw the same minibatches.
   */
  long taskSeed(long n) {
    long z = (hello == null ? 0 : hello.nodeId) + (n + 1) * 0x9E3779B97F4A7C15L;
    z = (z ^ (z >>> 30)) * 0xBF58476D1CE4E5B9L;
    z = (z ^ (z >>> 27)) * 0x94D049BB133111EBL;
    return z ^ (z >>> 31);
  }

  /**
   * Seconds of training that still let the result reach the gateway before the task expires:
   * expires_in_s - (time since the task arrived) - (upload time, estimated as the download time,
   * since the update is as large as the model) - {@link #UPLOAD_SLACK_S}. Training past it would
   * only produce a reply the gateway no longer takes, so the loop stops there and reports the
   * partial work instead.
   */
  private double trainingBudgetS(Task task, long receivedNanos, double downloadS) {
    double sinceReceived = (ticker.nanoTime() - receivedNanos) / 1e9;
    return task.expiresInS - sinceReceived - downloadS - UPLOAD_SLACK_S;
  }

  /** Tell the gateway the task is given up; returns a note for the log if that failed too. */
  private String giveUp(Task task, String step, Exception cause) throws GatewayException {
    try {
      client.fail(task.id, step + ": " + cause.getMessage());
      return "";
    } catch (GatewayException e) {
      if (isRefusal(e)) {
        throw e;
      }
      return " fail-http=" + e.status();
    } catch (IOException e) {
      return " fail-error=\"" + e.getMessage() + "\"";
    }
  }

  private static String reason(Exception e) {
    return " reason=\"" + String.valueOf(e.getMessage()).replace('"', '\'') + "\"";
  }

  /** The device's status, plus "stopping" once {@link #stop} was called. */
  private DeviceStatus gate() {
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
        return stopping ? "phone is stopping" : device.blockReason();
      }

      @Override
      public String stopReason() {
        return stopping ? "phone is stopping" : device.stopReason();
      }
    };
  }
}
