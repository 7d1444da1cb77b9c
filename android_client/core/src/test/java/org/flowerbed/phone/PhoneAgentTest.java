package org.flowerbed.phone;

import static org.junit.Assert.assertArrayEquals;
import static org.junit.Assert.assertEquals;
import static org.junit.Assert.assertFalse;
import static org.junit.Assert.assertTrue;
import static org.junit.Assert.fail;

import java.util.Arrays;
import java.util.Collections;
import java.util.HashMap;
import java.util.List;
import java.util.Map;
import org.junit.Test;

public class PhoneAgentTest extends GatewayFixture {
  /** Three examples over 2 features; with W = I, b = 0 two of three are right. */
  private static final Dataset DATA =
      new Dataset(new float[][] {{2, 0}, {0, 2}, {2, 0}}, new int[] {0, 1, 1});

  private volatile String block;

  private PhoneAgent agent(String token) {
    return agent(
        token,
        Ticker.SYSTEM,
        new PhoneAgent.TrainerFactory() {
          @Override
          public Trainer create(List<NamedArray> arrays) {
            return Models.fromArrays(arrays, DATA, 0);
          }
        });
  }

  private PhoneAgent agent(String token, Ticker ticker, PhoneAgent.TrainerFactory factory) {
    Sleeper sleeper =
        new Sleeper() {
          @Override
          public void sleep(long millis) {
            sleeps.add(millis);
            block = null; // a blocked phone gets its charger back while it waits
          }
        };
    DeviceStatus device =
        new DeviceStatus() {
          @Override
          public Double batteryPct() {
            return 64.0;
          }

          @Override
          public Double tempC() {
            return null;
          }

          @Override
          public String blockReason() {
            return block;
          }
        };
    Map<String, Object> info = new HashMap<String, Object>();
    info.put("model", "test");
    return agent(client(token, sleeper), factory, device, ticker, sleeper, info);
  }

  private static byte[] identityModel() {
    return TensorCodec.encode(
        Arrays.asList(
            new NamedArray("fc.weight", new int[] {2, 2}, new float[] {1, 0, 0, 1}),
            new NamedArray("fc.bias", new int[] {2}, new float[] {0, 0})));
  }

  private static Map<String, Object> config(Object... kv) {
    Map<String, Object> m = new HashMap<String, Object>();
    for (int i = 0; i < kv.length; i += 2) {
      m.put((String) kv[i], kv[i + 1]);
    }
    return m;
  }

  /** A training task of the identity model with the given steps, batch size and rate. */
  private FakeGateway.FakeTask trainTask(String id, long steps, long batchSize, double lr) {
    return gw.addTask(
        id,
        "train",
        config("local-steps", steps, "batch-size", batchSize, "lr", lr),
        identityModel());
  }

  private String lastTaskLine() {
    for (int i = log.size() - 1; i >= 0; i--) {
      if (log.get(i).startsWith("task=")) {
        return log.get(i);
      }
    }
    throw new AssertionError("no task line in " + log);
  }

  @Test
  public void trainTaskUploadsTheTrainedArraysAndReportsTheWork() throws Exception {
    FakeGateway.FakeTask t = trainTask("t-1", 5L, 2L, 0.5);
    assertEquals(1, agent("tok-a").run(1));
    List<NamedArray> up = TensorCodec.decode(t.upload.toByteArray());
    List<NamedArray> sent = TensorCodec.decode(identityModel());
    assertEquals(2, up.size());
    for (int i = 0; i < 2; i++) {
      assertTrue(up.get(i).sameLayout(sent.get(i)));
    }
    assertFalse(Arrays.equals(up.get(0).data(), sent.get(0).data()));
    assertEquals(10L, t.metrics.get("num-examples"));
    assertEquals(5L, t.metrics.get("num-steps"));
    assertTrue(t.metrics.get("train-time-s") instanceof Double);
    assertEquals(64.0, t.metrics.get("battery-pct"));
    assertFalse(t.metrics.containsKey("temp-c"));
    assertTrue(
        lastTaskLine(),
        lastTaskLine()
            .startsWith("task=t-1 type=train status=accepted num-steps=5 num-examples=10"));
    assertEquals("hello node_id=7 phone=phone-7 chunk_bytes=1048576", log.get(0));
  }

  @Test
  public void evaluateTaskReportsLossAndAccuracyAndUploadsNothing() throws Exception {
    FakeGateway.FakeTask t = gw.addTask("t-2", "evaluate", config(), identityModel());
    agent("tok-a").run(1);
    double loss = (2 * Math.log(1 + Math.exp(-2)) + Math.log(1 + Math.exp(2))) / 3;
    assertEquals(3L, t.metrics.get("num-examples"));
    assertEquals(loss, (Double) t.metrics.get("eval-loss"), 1e-6);
    assertEquals(2.0 / 3, (Double) t.metrics.get("eval-acc"), 1e-12);
    assertEquals(0, t.upload.size());
    assertTrue(lastTaskLine(), lastTaskLine().contains("status=accepted num-examples=3"));
  }

  @Test
  public void trainingStopsInTimeForTheResultToBeatTheTaskExpiry() throws Exception {
    // expires_in_s = 5, each step takes 1 s on a hand-moved clock, download takes no time:
    // budget = 5 - 0 - 0 - 1 s slack = 4 s, so 4 of the 10 asked steps run.
    gw.expiresInS = 5.0;
    FakeGateway.FakeTask t =
        gw.addTask("t-10", "train", config("local-steps", 10L, "batch-size", 1L), identityModel());
    final long[] now = {0};
    Ticker clock =
        new Ticker() {
          @Override
          public long nanoTime() {
            return now[0];
          }
        };
    PhoneAgent.TrainerFactory slow =
        new PhoneAgent.TrainerFactory() {
          @Override
          public Trainer create(List<NamedArray> arrays) {
            return new ForwardingTrainer(Models.fromArrays(arrays, DATA, 0)) {
              @Override
              public StepResult step(int batchSize, double lr) {
                now[0] += 1_000_000_000L;
                return inner.step(batchSize, lr);
              }
            };
          }
        };
    agent("tok-a", clock, slow).run(1);
    assertEquals(4L, t.metrics.get("num-steps"));
    assertEquals(4.0, (Double) t.metrics.get("train-time-s"), 1e-9);
    assertTrue(lastTaskLine(), lastTaskLine().endsWith("deadline-hit=true"));
  }

  /**
   * The agent runs one task and task {@code t} fails with a reason starting {@code reason}; the
   * log's last task line starts {@code line}.
   */
  private void assertOneTaskFails(FakeGateway.FakeTask t, String reason, String line)
      throws Exception {
    agent("tok-a").run(1);
    assertTrue(t.failReason, t.failReason.startsWith(reason));
    assertTrue(lastTaskLine(), lastTaskLine().startsWith(line));
  }

  @Test
  public void malformedArraysFailTheTaskWithTheReason() throws Exception {
    byte[] bad = Arrays.copyOf(identityModel(), 20);
    FakeGateway.FakeTask t = gw.addTask("t-3", "train", config(), bad);
    assertOneTaskFails(t, "decode: truncated", "task=t-3 type=train status=failed at=decode");
  }

  @Test
  public void arraysLongerThanAnnouncedFailTheTaskInsteadOfLooping() throws Exception {
    FakeGateway.FakeTask t = gw.addTask("t-9", "train", config(), identityModel());
    char[] junk = new char[200];
    Arrays.fill(junk, 'x');
    gw.fault("/v1/task/t-9/arrays", 200, new String(junk));
    assertOneTaskFails(
        t,
        "download: the download is longer than the 68 bytes",
        "task=t-9 type=train status=failed at=download");
  }

  @Test
  public void arraysOfAnotherModelFailTheTask() throws Exception {
    byte[] other =
        TensorCodec.encode(
            Collections.singletonList(new NamedArray("conv.weight", new int[] {1}, new float[1])));
    FakeGateway.FakeTask t = gw.addTask("t-4", "train", config(), other);
    agent("tok-a").run(1);
    assertTrue(t.failReason, t.failReason.startsWith("build: no pure-Java model has arrays"));
  }

  @Test
  public void badConfigFailsTheTaskNamingTheKey() throws Exception {
    FakeGateway.FakeTask t = gw.addTask("t-5", "train", config("lr", -1L), identityModel());
    agent("tok-a").run(1);
    assertEquals("train: config key 'lr' must be a number > 0, got -1", t.failReason);
  }

  @Test
  public void anOversizeUploadIsRejectedAndThePhoneGoesOnToTheNextTask() throws Exception {
    gw.maxUploadBytes = 10;
    gw.addTask("big", "train", config("local-steps", 1L), identityModel());
    FakeGateway.FakeTask next = gw.addTask("next", "evaluate", config(), identityModel());
    assertEquals(2, agent("tok-a").run(2));
    assertTrue(
        log.toString(),
        log.get(1).startsWith("task=big type=train status=rejected http=413 at=upload"));
    assertEquals(3L, next.metrics.get("num-examples"));
  }

  @Test
  public void aWrongTokenEndsTheRunAndIsLogged() {
    try {
      agent("stolen").run(1);
      fail("expected GatewayException");
    } catch (GatewayException e) {
      assertEquals(401, e.status());
    }
    assertEquals(
        "refused status=401 reason=\"token refused by the gateway: unknown token\"", log.get(0));
  }

  @Test
  public void afterTheGatewayWasUnreachableThePhoneSaysHelloAgainAsTheSameNode() throws Exception {
    for (int i = 0; i < 4; i++) {
      gw.fault("/v1/task", 503, "{\"error\": \"down\"}"); // the client gives up after 4
    }
    gw.addTask("t-6", "evaluate", config(), identityModel());
    assertEquals(1, agent("tok-a").run(1));
    assertEquals(2, gw.hellos.size());
    assertEquals("hello node_id=7 phone=phone-7 chunk_bytes=1048576", log.get(0));
    assertTrue(
        log.get(1), log.get(1).startsWith("reconnecting after network error: poll failed 4"));
    assertEquals(log.get(0), log.get(2));
  }

  @Test
  public void aPhoneThatMayNotTrainWaitsInsteadOfPolling() throws Exception {
    block = "not charging";
    gw.addTask("t-7", "evaluate", config(), identityModel());
    assertEquals(1, agent("tok-a").run(1));
    assertEquals("waiting reason=\"not charging\"", log.get(1));
    assertEquals(Arrays.asList(1000L), sleeps); // poll_s = 1 from hello
  }

  @Test
  public void stopEndsALongPollPromptly() throws Exception {
    gw.pollDelayMs = 20_000;
    final PhoneAgent a = agent("tok-a");
    final int[] handled = {-1};
    Thread runner =
        new Thread() {
          @Override
          public void run() {
            try {
              handled[0] = a.run(0);
            } catch (GatewayException e) {
              handled[0] = -2;
            }
          }
        };
    runner.start();
    while (gw.requests.size() < 2) {
      Thread.sleep(10);
    }
    a.stop();
    runner.join(5000);
    assertFalse("run() still going after stop()", runner.isAlive());
    assertEquals(0, handled[0]);
  }

  @Test
  public void uploadedArraysDecodeToWhatTheTrainerHolds() throws Exception {
    FakeGateway.FakeTask t = trainTask("t-8", 1L, 3L, 1.0);
    agent("tok-a").run(1);
    // The same step done here by hand on a fresh trainer gives the same arrays.
    DenseTrainer expected = Models.fromArrays(TensorCodec.decode(identityModel()), DATA, 0);
    expected.step(3, 1.0);
    List<NamedArray> up = TensorCodec.decode(t.upload.toByteArray());
    for (int i = 0; i < up.size(); i++) {
      assertArrayEquals(expected.getParameters().get(i).data(), up.get(i).data(), 0f);
    }
  }
}
