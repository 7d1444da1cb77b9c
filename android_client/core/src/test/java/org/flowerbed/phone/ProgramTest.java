package org.flowerbed.phone;

import static org.junit.Assert.assertArrayEquals;
import static org.junit.Assert.assertEquals;
import static org.junit.Assert.assertFalse;
import static org.junit.Assert.assertTrue;
import static org.junit.Assert.fail;

import java.io.File;
import java.io.FileOutputStream;
import java.io.IOException;
import java.nio.file.Files;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.Collections;
import java.util.HashMap;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import org.junit.After;
import org.junit.Before;
import org.junit.Test;

/** Programs served by the gateway (protocol revision 2): metadata, download, cache, checks. */
public class ProgramTest extends GatewayFixture {
  /** 3,000 bytes standing in for a .pte. */
  private static final byte[] PTE = new byte[3000];

  static {
    for (int i = 0; i < PTE.length; i++) {
      PTE[i] = (byte) (i * 7);
    }
  }

  private File dir;

  @Before
  public void makeCacheDir() throws IOException {
    dir = Files.createTempDirectory("programs").toFile();
  }

  @After
  public void removeCacheDir() {
    for (File f : dir.listFiles()) {
      f.delete();
    }
    dir.delete();
  }

  static String sha256(byte[] data) throws IOException {
    File f = File.createTempFile("sha", ".bin");
    try {
      FileOutputStream out = new FileOutputStream(f);
      out.write(data);
      out.close();
      return ProgramCache.sha256(f);
    } finally {
      f.delete();
    }
  }

  static Map<String, Object> programJson(String name, byte[] data, String minRuntime)
      throws IOException {
    String sha = sha256(data);
    Map<String, Object> p = new LinkedHashMap<String, Object>();
    p.put("name", name);
    p.put("sha256", sha);
    p.put("bytes", (long) data.length);
    p.put("min_runtime", minRuntime);
    p.put("url", "/v1/program/" + sha);
    List<Object> params = new ArrayList<Object>();
    params.add(param("fc.weight", 2L, 2L));
    params.add(param("fc.bias", 2L));
    p.put("parameters", params);
    return p;
  }

  private static Map<String, Object> param(String name, Long... shape) {
    Map<String, Object> m = new LinkedHashMap<String, Object>();
    m.put("name", name);
    m.put("shape", new ArrayList<Object>(Arrays.asList((Object[]) shape)));
    return m;
  }

  private ProgramCache cache(final GatewayClient client) {
    return new ProgramCache(
        dir,
        new ProgramCache.Downloader() {
          @Override
          public void download(ProgramInfo program, File part) throws IOException {
            client.downloadProgram(program, part);
          }
        });
  }

  @Test
  public void metadataIsReadWithParametersInProgramOrder() throws IOException {
    ProgramInfo p = ProgramInfo.fromJson(programJson("tiny", PTE, "1.5.1"));
    assertEquals("tiny", p.name());
    assertEquals(sha256(PTE), p.sha256());
    assertEquals(3000, p.bytes());
    assertEquals(Arrays.asList("fc.weight", "fc.bias"), p.parameterNames());
  }

  @Test
  public void theSampleShapeAndMaximumBatchAreReadWhenGiven() throws IOException {
    Map<String, Object> json = programJson("tiny", PTE, "1.5.1");
    assertEquals(null, ProgramInfo.fromJson(json).sampleShape());
    json.put("input", new ArrayList<Object>(Arrays.asList((Object) 3L, 32L, 32L)));
    json.put("max_batch_size", 16L);
    ProgramInfo p = ProgramInfo.fromJson(json);
    assertArrayEquals(new long[] {3, 32, 32}, p.sampleShape());
    assertEquals(16, p.maxBatchSize());
  }

  @Test
  public void stateEvaluationMethodAndBatchBoundsAreRead() throws IOException {
    Map<String, Object> json = programJson("tiny", PTE, "1.5.1");
    ProgramInfo plain = ProgramInfo.fromJson(json);
    assertEquals(Collections.emptyList(), plain.stateNames());
    assertEquals(null, plain.evaluateMethod());
    assertEquals(1, plain.minBatchSize());
    List<Object> state = new ArrayList<Object>();
    state.add(param("bn.running_mean", 2L));
    state.add(param("bn.running_var", 2L));
    json.put("state", state);
    json.put("evaluate_method", "evaluate");
    json.put("max_batch_size", 16L);
    json.put("min_batch_size", 2L);
    ProgramInfo p = ProgramInfo.fromJson(json);
    assertEquals(Arrays.asList("bn.running_mean", "bn.running_var"), p.stateNames());
    assertEquals(Arrays.asList("fc.weight", "fc.bias"), p.parameterNames());
    assertArrayEquals(new int[] {2}, p.shapeOf("bn.running_var"));
    assertEquals("evaluate", p.evaluateMethod());
    assertEquals(2, p.minBatchSize());
  }

  @Test
  public void stateNamedLikeAParameterOrBatchBoundsOutOfOrderAreViolations() throws IOException {
    Map<String, Object> clash = programJson("tiny", PTE, "1.5.1");
    clash.put("state", new ArrayList<Object>(Arrays.asList((Object) param("fc.bias", 2L))));
    Map<String, Object> bounds = programJson("tiny", PTE, "1.5.1");
    bounds.put("max_batch_size", 4L);
    bounds.put("min_batch_size", 5L);
    for (Map<String, Object> bad : Arrays.asList(clash, bounds)) {
      try {
        ProgramInfo.fromJson(bad);
        fail("accepted " + bad);
      } catch (GatewayException e) {
        assertEquals(GatewayException.PROTOCOL_VIOLATION, e.status());
      }
    }
  }

  @Test
  public void malformedMetadataIsAProtocolViolation() throws IOException {
    Map<String, Object> p = programJson("tiny", PTE, "1.5.1");
    p.put("url", "/elsewhere");
    try {
      ProgramInfo.fromJson(p);
      fail("expected a violation");
    } catch (GatewayException e) {
      assertEquals(GatewayException.PROTOCOL_VIOLATION, e.status());
      assertTrue(e.getMessage(), e.getMessage().contains("program.url"));
    }
  }

  @Test
  public void arraysMustBeExactlyTheProgramsParameters() throws IOException {
    ProgramInfo p = ProgramInfo.fromJson(programJson("tiny", PTE, "1.5.1"));
    p.checkArrays(
        Arrays.asList(
            new NamedArray("fc.bias", new int[] {2}, new float[2]),
            new NamedArray("fc.weight", new int[] {2, 2}, new float[4])));
    try {
      p.checkArrays(
          Arrays.asList(
              new NamedArray("fc.weight", new int[] {4}, new float[4]),
              new NamedArray("extra", new int[] {1}, new float[1])));
      fail("expected a mismatch");
    } catch (IllegalArgumentException e) {
      assertEquals(
          "program: the arrays do not match program 'tiny': [fc.weight [4] (program: [2, 2]),"
              + " unexpected extra, missing fc.bias]",
          e.getMessage());
    }
  }

  @Test
  public void versionsCompareNumberByNumber() {
    assertEquals(1, ProgramInfo.compareVersions("1.10", "1.9"));
    assertEquals(0, ProgramInfo.compareVersions("1.5", "1.5.0"));
    assertEquals(-1, ProgramInfo.compareVersions("1.4.1", "1.5.1"));
  }

  @Test
  public void anOlderRuntimeIsRefusedWithWhatIsNeeded() throws IOException {
    ProgramInfo p = ProgramInfo.fromJson(programJson("tiny", PTE, "1.5.1"));
    p.checkRuntime("1.5.1");
    p.checkRuntime("1.6");
    try {
      p.checkRuntime("1.4.1");
      fail("expected a refusal");
    } catch (IllegalArgumentException e) {
      assertEquals(
          "program: 'tiny' needs ExecuTorch 1.5.1 or newer, this phone has 1.4.1; update the app",
          e.getMessage());
    }
  }

  /** Program "tiny" (PTE, for ExecuTorch 1.5.1 or newer), which the gateway serves as {@code served}.
   */
  private ProgramInfo tinyServedAs(byte[] served) throws IOException {
    ProgramInfo p = ProgramInfo.fromJson(programJson("tiny", PTE, "1.5.1"));
    gw.programs.put(p.sha256(), served);
    return p;
  }

  @Test
  public void aProgramIsDownloadedOnceThenServedFromTheCache() throws IOException {
    ProgramInfo p = tinyServedAs(PTE);
    ProgramCache cache = cache(client());
    File first = cache.fetch(p);
    File second = cache.fetch(p);
    assertEquals(new File(dir, p.sha256() + ".pte"), first);
    assertEquals(first, second);
    assertArrayEquals(PTE, Files.readAllBytes(first.toPath()));
    assertEquals(1, count("GET /v1/program/"));
  }

  @Test
  public void anInterruptedDownloadResumesWhereItStopped() throws IOException {
    ProgramInfo p = tinyServedAs(PTE);
    gw.cutDownloadAt = 1200;
    File f = cache(client()).fetch(p);
    assertArrayEquals(PTE, Files.readAllBytes(f.toPath()));
    assertEquals(
        Arrays.asList(
            "GET /v1/program/" + p.sha256() + " len=0",
            "GET /v1/program/" + p.sha256() + " Range:bytes=1200- len=0"),
        gw.requests);
  }

  @Test
  public void aProgramWithTheWrongHashIsDeletedAndRefused() throws IOException {
    byte[] other = PTE.clone();
    other[10] ^= 1;
    ProgramInfo p = tinyServedAs(other);
    try {
      cache(client()).fetch(p);
      fail("expected a hash mismatch");
    } catch (IllegalArgumentException e) {
      assertTrue(e.getMessage(), e.getMessage().startsWith("program: downloaded 'tiny' has SHA-256"));
    }
    assertEquals(0, dir.listFiles().length);
  }

  @Test
  public void aDamagedCachedProgramIsFetchedAgain() throws IOException {
    ProgramInfo p = tinyServedAs(PTE);
    ProgramCache cache = cache(client());
    File f = cache.fetch(p);
    Files.write(f.toPath(), new byte[] {1, 2, 3});
    assertArrayEquals(PTE, Files.readAllBytes(cache.fetch(p).toPath()));
    assertEquals(2, count("GET /v1/program/"));
  }

  private int count(String prefix) {
    int n = 0;
    synchronized (gw.requests) {
      for (String r : gw.requests) {
        if (r.startsWith(prefix)) {
          n++;
        }
      }
    }
    return n;
  }

  // -- the agent runs program tasks ----------------------------------------------------

  private PhoneAgent agent(PhoneAgent.TrainerFactory factory) {
    return agent(
        client(),
        factory,
        DeviceStatus.NONE,
        Ticker.SYSTEM,
        new Sleeper() {
          @Override
          public void sleep(long millis) {}
        },
        new HashMap<String, Object>());
  }

  private static final Dataset DATA =
      new Dataset(new float[][] {{2, 0}, {0, 2}, {2, 0}}, new int[] {0, 1, 1});

  /** Trains core's pure-Java model but records the program and seed each task was given. */
  private final List<File> programsGiven = new ArrayList<File>();

  private final List<Long> seedsGiven = new ArrayList<Long>();

  private final PhoneAgent.TrainerFactory runtime =
      new PhoneAgent.TrainerFactory() {
        @Override
        public Trainer create(List<NamedArray> arrays) {
          throw new AssertionError("program tasks use the three-argument create");
        }

        @Override
        public Trainer create(
            List<NamedArray> arrays, ProgramInfo info, File program, long seed) {
          programsGiven.add(program);
          seedsGiven.add(seed);
          return Models.fromArrays(arrays, DATA, seed);
        }
      };

  private FakeGateway.FakeTask programTask(String id, byte[] arrays) throws IOException {
    FakeGateway.FakeTask t = gw.addTask(id, "train", new HashMap<String, Object>(), arrays);
    t.program = programJson("tiny", PTE, "1.5.1");
    gw.programs.put(sha256(PTE), PTE);
    return t;
  }

  private static byte[] model(int weightSize) {
    return TensorCodec.encode(
        Arrays.asList(
            new NamedArray("fc.weight", new int[] {weightSize, 2}, new float[weightSize * 2]),
            new NamedArray("fc.bias", new int[] {2}, new float[2])));
  }

  @Test
  public void programTasksRunWithTheCachedProgramAndAPerTaskSeed() throws IOException {
    FakeGateway.FakeTask a = programTask("t1", model(2));
    FakeGateway.FakeTask b = programTask("t2", model(2));
    agent(runtime).withPrograms(cache(client()), "1.5.1").run(2);
    assertTrue(log.toString(), a.metrics != null && b.metrics != null);
    File cached = new File(dir, sha256(PTE) + ".pte");
    assertEquals(Arrays.asList(cached, cached), programsGiven);
    assertEquals(1, count("GET /v1/program/"));
    assertFalse("every task samples with its own seed", seedsGiven.get(0).equals(seedsGiven.get(1)));
  }

  @Test
  public void programTasksFailWithTheReasonWhenTheyCannotRun() throws IOException {
    FakeGateway.FakeTask noCache = programTask("t1", model(2));
    agent(runtime).run(1);
    assertEquals(
        "program: this phone keeps no program cache, so it cannot run program 'tiny'",
        noCache.failReason.substring("program: ".length()));
    FakeGateway.FakeTask oldRuntime = programTask("t2", model(2));
    agent(runtime).withPrograms(cache(client()), "1.4.1").run(1);
    assertTrue(oldRuntime.failReason, oldRuntime.failReason.contains("needs ExecuTorch 1.5.1"));
    FakeGateway.FakeTask mismatch = programTask("t3", model(3));
    agent(runtime).withPrograms(cache(client()), "1.5.1").run(1);
    assertTrue(
        mismatch.failReason,
        mismatch.failReason.startsWith("decode: program: the arrays do not match program 'tiny'"));
    FakeGateway.FakeTask jvm = programTask("t4", model(2));
    agent(
            new PhoneAgent.TrainerFactory() {
              @Override
              public Trainer create(List<NamedArray> arrays) {
                return Models.fromArrays(arrays, DATA, 0);
              }
            })
        .withPrograms(cache(client()), "1.5.1")
        .run(1);
    assertTrue(jvm.failReason, jvm.failReason.contains("no ExecuTorch runtime"));
  }

  @Test
  public void theListenerBracketsEveryTaskAndAnIdleAgentReturns() throws IOException {
    programTask("t1", model(2));
    final List<String> events = new ArrayList<String>();
    final long[] now = {0};
    PhoneAgent agent =
        new PhoneAgent(
                client(),
                runtime,
                DeviceStatus.NONE,
                new Ticker() {
                  @Override
                  public long nanoTime() {
                    return now[0] += 1_000_000_000L; // one second per look at the clock
                  }
                },
                new Sleeper() {
                  @Override
                  public void sleep(long millis) {}
                },
                fastBackoff(),
                new HashMap<String, Object>(),
                new PhoneAgent.Log() {
                  @Override
                  public void line(String text) {
                    events.add(text.split(" ")[0]);
                  }
                },
                0)
            .withPrograms(cache(client()), "1.5.1")
            .withTaskListener(
                new PhoneAgent.TaskListener() {
                  @Override
                  public void taskStarted(Task task) {
                    events.add("start " + task.id);
                  }

                  @Override
                  public void taskEnded(Task task) {
                    events.add("end " + task.id);
                  }
                })
            .returnWhenIdle(30_000);
    assertEquals(1, agent.run(0)); // returns by itself: no task for 30 s
    assertEquals("hello", events.get(0));
    assertEquals(Arrays.asList("start t1", "task=t1", "end t1"), events.subList(1, 4));
    assertEquals("idle:", events.get(events.size() - 1));
  }

  @Test
  public void scheduledWorkEndsAsSoonAsTheDeviceBlocksIt() throws IOException {
    programTask("t1", model(2));
    PhoneAgent agent =
        agent(
                client(),
                runtime,
                DeviceStatus.fixed(null, null, "not charging"),
                Ticker.SYSTEM,
                new Sleeper() {
                  @Override
                  public void sleep(long millis) {
                    throw new AssertionError("scheduled work must not wait in place");
                  }
                },
                new HashMap<String, Object>())
            .returnWhenIdle(60_000);
    assertEquals(0, agent.run(0));
    assertEquals("waiting reason=\"not charging\"", log.get(log.size() - 1));
  }
}
