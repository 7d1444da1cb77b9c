package org.flowerbed.phone;

import java.io.File;
import java.io.IOException;
import java.io.PrintStream;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;

/**
 * A phone on a JVM: the same {@link PhoneAgent} as the Android app, training core's pure-Java
 * models on a CSV file. The gateway's end-to-end tests start several of these.
 *
 * <pre>
 * java -cp flowerbed-phone.jar org.flowerbed.phone.PhoneMain --gateway http://127.0.0.1:PORT \
 *     --token TOKEN --data FILE.csv [--max-tasks N] [--slow-ms N] [options]
 * </pre>
 *
 * Exit status: 0 after --max-tasks tasks or on SIGTERM, 2 for bad arguments or data, 3 when the
 * gateway refuses the phone (wrong token) or the phone refuses the gateway (certificate).
 */
public final class PhoneMain {
  static final String USAGE =
      "usage: java -cp flowerbed-phone.jar org.flowerbed.phone.PhoneMain\n"
          + "  --gateway URL      gateway root, e.g. http://127.0.0.1:8470\n"
          + "  --token TOKEN      this phone's bearer token\n"
          + "  --enrol URI        flowerbed://enroll?... from 'flowerbed bridge enroll' (instead\n"
          + "                     of --gateway and --token; carries the certificate pin)\n"
          + "  --pin PIN          trust only the gateway key sha256/<base64> (HTTPS)\n"
          + "  --data FILE.csv    local data, rows 'label,f1,f2,...' (required)\n"
          + "  --max-tasks N      exit after N tasks (default 0: run until SIGTERM)\n"
          + "  --slow-ms N        sleep N ms per training step, to act as a slow phone (default"
          + " 0)\n"
          + "  --poll-wait S      seconds of each long poll (default 20)\n"
          + "  --seed N           mixed into each task's sampling seed, which differs per phone\n"
          + "                     and task (default 0)\n"
          + "  --model NAME       device model sent with hello (default jvm-phone)\n"
          + "  --battery-pct X    battery level to report (default: not reported)\n"
          + "  --temp-c X         temperature to report (default: not reported)\n"
          + "One line per task goes to stdout: task=<id> type=<train|evaluate> status=<accepted|\n"
          + "failed|expired|rejected> followed by key=value details.\n";

  /** This phone core's version, sent with hello. */
  static final String VERSION = "0.2.0";

  /** Set by the shutdown hook: the JVM is already exiting (SIGTERM). */
  private static volatile boolean signalled;

  private PhoneMain() {}

  public static void main(String[] args) {
    int status = run(args, System.out, System.err);
    if (!signalled) {
      // System.exit while shutdown hooks run would block: after SIGTERM main just returns.
      System.exit(status);
    }
  }

  /** Parse {@code args}, work, and return the exit status. */
  static int run(String[] args, final PrintStream out, PrintStream err) {
    Options o;
    Dataset data;
    try {
      o = Options.parse(args);
      if (o.help) {
        out.print(USAGE);
        return 0;
      }
      data = Dataset.readCsv(new File(o.data));
    } catch (IllegalArgumentException | IOException e) {
      err.println("error: " + e.getMessage());
      err.print(USAGE);
      return 2;
    }
    final Dataset local = data;
    final Options opts = o;
    PhoneAgent.TrainerFactory factory =
        new PhoneAgent.TrainerFactory() {
          private long tasks;

          @Override
          public Trainer create(List<NamedArray> arrays) {
            return create(arrays, null, null, 0);
          }

          @Override
          public Trainer create(
              List<NamedArray> arrays, ProgramInfo info, File program, long seed) {
            if (program != null) {
              throw new IllegalArgumentException(
                  "program: the JVM phone trains its own models, not ExecuTorch programs");
            }
            Trainer t = Models.fromArrays(arrays, local, opts.seed ^ seed);
            return opts.slowMs > 0 ? new SlowTrainer(t, opts.slowMs) : t;
          }
        };
    Map<String, Object> info = new LinkedHashMap<String, Object>();
    info.put("model", o.model);
    info.put("os", System.getProperty("os.name"));
    info.put("cores", Runtime.getRuntime().availableProcessors());
    info.put("runtime", "java " + System.getProperty("java.version"));
    info.put("examples", data.size());
    GatewayClient client = new GatewayClient(o.gateway, o.token).appVersions(VERSION, null);
    if (o.pin != null) {
      client.pinCertificate(o.pin);
    }
    final PhoneAgent agent =
        new PhoneAgent(
            client,
            factory,
            DeviceStatus.fixed(o.batteryPct, o.tempC, null),
            Ticker.SYSTEM,
            Sleeper.SYSTEM,
            Backoff.defaults(),
            info,
            new PhoneAgent.Log() {
              @Override
              public void line(String text) {
                synchronized (out) {
                  out.println(text);
                  out.flush();
                }
              }
            },
            o.pollWaitS);
    final Thread main = Thread.currentThread();
    Thread hook =
        new Thread("phone-shutdown") {
          @Override
          public void run() {
            signalled = true;
            agent.stop();
            try {
              main.join(10_000);
            } catch (InterruptedException e) {
              Thread.currentThread().interrupt();
            }
          }
        };
    Runtime.getRuntime().addShutdownHook(hook);
    try {
      int handled = agent.run(o.maxTasks);
      out.println("stopped tasks=" + handled);
      out.flush();
      return 0;
    } catch (GatewayException e) {
      out.println("stopped refused=" + e.status());
      out.flush();
      return 3;
    } finally {
      try {
        // Leaving normally: the hook must not wait for this thread, which is about to exit.
        Runtime.getRuntime().removeShutdownHook(hook);
      } catch (IllegalStateException e) {
        // the JVM is already shutting down (SIGTERM): the hook is running and waits for us
      }
    }
  }

  /** Command-line options. */
  static final class Options {
    String gateway;
    String token;
    String pin;
    String data;
    int maxTasks;
    long slowMs;
    int pollWaitS = 20;
    long seed;
    String model = "jvm-phone";
    Double batteryPct;
    Double tempC;
    boolean help;

    static Options parse(String[] args) {
      Options o = new Options();
      for (int i = 0; i < args.length; i++) {
        String flag = args[i];
        if (flag.equals("--help") || flag.equals("-h")) {
          o.help = true;
          return o;
        }
        if (i + 1 >= args.length) {
          throw new IllegalArgumentException(flag + " needs a value");
        }
        String v = args[++i];
        if (flag.equals("--gateway")) {
          o.gateway = v;
        } else if (flag.equals("--token")) {
          o.token = v;
        } else if (flag.equals("--enrol")) {
          // A test tool on a lab machine: a plain-HTTP gateway is allowed here.
          EnrolmentUri e = EnrolmentUri.parse(v, true);
          o.gateway = e.gateway;
          o.token = e.token;
          o.pin = e.pin;
        } else if (flag.equals("--pin")) {
          o.pin = v;
        } else if (flag.equals("--data")) {
          o.data = v;
        } else if (flag.equals("--max-tasks")) {
          o.maxTasks = (int) number(flag, v, 0);
        } else if (flag.equals("--slow-ms")) {
          o.slowMs = number(flag, v, 0);
        } else if (flag.equals("--poll-wait")) {
          o.pollWaitS = (int) number(flag, v, 0);
        } else if (flag.equals("--seed")) {
          o.seed = number(flag, v, Long.MIN_VALUE);
        } else if (flag.equals("--model")) {
          o.model = v;
        } else if (flag.equals("--battery-pct")) {
          o.batteryPct = decimal(flag, v);
        } else if (flag.equals("--temp-c")) {
          o.tempC = decimal(flag, v);
        } else {
          throw new IllegalArgumentException(
              "unknown option "
                  + flag
                  + "; valid: --gateway --token --enrol --pin --data --max-tasks"
                  + " --slow-ms --poll-wait --seed --model --battery-pct --temp-c --help");
        }
      }
      if (o.gateway == null || o.token == null || o.data == null) {
        throw new IllegalArgumentException(
            "--data and either --enrol or --gateway and --token are required");
      }
      GatewayClient check = new GatewayClient(o.gateway, o.token); // validates them now
      if (o.pin != null) {
        check.pinCertificate(o.pin);
      }
      return o;
    }

    private static long number(String flag, String v, long min) {
      try {
        long n = Long.parseLong(v);
        if (n >= min) {
          return n;
        }
      } catch (NumberFormatException e) {
        // reported below
      }
      throw new IllegalArgumentException(
          flag + " needs an integer >= " + min + ", got '" + v + "'");
    }

    private static double decimal(String flag, String v) {
      try {
        return Double.parseDouble(v);
      } catch (NumberFormatException e) {
        throw new IllegalArgumentException(flag + " needs a number, got '" + v + "'");
      }
    }
  }

  /** A trainer that sleeps before each step: a slow phone for straggler tests. */
  static final class SlowTrainer extends ForwardingTrainer {
    private final long delayMs;

    SlowTrainer(Trainer inner, long delayMs) {
      super(inner);
      this.delayMs = delayMs;
    }

    @Override
    public StepResult step(int batchSize, double lr) {
      try {
        Thread.sleep(delayMs);
      } catch (InterruptedException e) {
        Thread.currentThread().interrupt();
      }
      return super.step(batchSize, lr);
    }
  }
}
