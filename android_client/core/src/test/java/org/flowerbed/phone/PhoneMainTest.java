package org.flowerbed.phone;

import static org.junit.Assert.assertEquals;
import static org.junit.Assert.assertTrue;

import java.io.BufferedReader;
import java.io.ByteArrayOutputStream;
import java.io.File;
import java.io.FileInputStream;
import java.io.FileOutputStream;
import java.io.IOException;
import java.io.InputStreamReader;
import java.io.OutputStreamWriter;
import java.io.PrintStream;
import java.io.Writer;
import java.nio.charset.StandardCharsets;
import java.util.Arrays;
import java.util.HashMap;
import java.util.Map;
import java.util.concurrent.TimeUnit;
import org.junit.After;
import org.junit.Before;
import org.junit.Rule;
import org.junit.Test;
import org.junit.rules.TemporaryFolder;

public class PhoneMainTest {
  @Rule public TemporaryFolder tmp = new TemporaryFolder();

  private FakeGateway gw;
  private File csv;
  private final ByteArrayOutputStream out = new ByteArrayOutputStream();
  private final ByteArrayOutputStream err = new ByteArrayOutputStream();

  @Before
  public void start() throws IOException {
    gw = new FakeGateway();
    gw.tokens.put("tok-a", 3L);
    csv = tmp.newFile("data.csv");
    Writer w = new OutputStreamWriter(new FileOutputStream(csv), StandardCharsets.UTF_8);
    try {
      w.write("0,-1.0,-0.5\n1,1.0,0.5\n0,-0.8,-1.2\n1,0.9,1.1\n");
    } finally {
      w.close();
    }
  }

  @After
  public void stop() {
    gw.close();
  }

  private int run(String... args) {
    return PhoneMain.run(args, new PrintStream(out, true), new PrintStream(err, true));
  }

  private String stdout() {
    return new String(out.toByteArray(), StandardCharsets.UTF_8);
  }

  private static byte[] mlp() {
    Dataset shape = new Dataset(new float[][] {{0, 0}}, new int[] {0});
    return TensorCodec.encode(new Mlp(shape, 4, 2, 1).getParameters());
  }

  @Test
  public void actsAsAPhoneForMaxTasksAndExitsZero() {
    Map<String, Object> config = new HashMap<String, Object>();
    config.put("local-steps", 3L);
    config.put("batch-size", 2L);
    FakeGateway.FakeTask t = gw.addTask("t-1", "train", config, mlp());
    int status =
        run(
            "--gateway",
            gw.url(),
            "--token",
            "tok-a",
            "--data",
            csv.getPath(),
            "--max-tasks",
            "1",
            "--battery-pct",
            "55",
            "--temp-c",
            "31.5",
            "--poll-wait",
            "0");
    assertEquals(0, status);
    String[] lines = stdout().split("\n");
    assertEquals(3, lines.length);
    assertEquals("hello node_id=3 phone=phone-3 chunk_bytes=1048576", lines[0]);
    assertTrue(
        lines[1],
        lines[1].startsWith("task=t-1 type=train status=accepted num-steps=3 num-examples=6"));
    assertEquals("stopped tasks=1", lines[2]);
    assertEquals(6L, t.metrics.get("num-examples"));
    assertEquals(55.0, t.metrics.get("battery-pct"));
    assertEquals(31.5, t.metrics.get("temp-c"));
    assertEquals("jvm-phone", ((Map<?, ?>) gw.hellos.get(0).get("device")).get("model"));
    assertEquals(4L, ((Map<?, ?>) gw.hellos.get(0).get("device")).get("examples"));
  }

  @Test
  public void aRefusedTokenExitsThree() {
    int status =
        run("--gateway", gw.url(), "--token", "wrong", "--data", csv.getPath(), "--max-tasks", "1");
    assertEquals(3, status);
    assertTrue(stdout(), stdout().startsWith("refused status=401"));
  }

  @Test
  public void badArgumentsExitTwoWithTheReason() {
    assertEquals(2, run("--gateway", gw.url(), "--token", "t"));
    assertTrue(
        err.toString(),
        err.toString().startsWith("error: --data and either --enrol or --gateway and --token are required"));
    err.reset();
    assertEquals(2, run("--gateway", "ftp://x", "--token", "t", "--data", csv.getPath()));
    assertTrue(
        err.toString(), err.toString().startsWith("error: gateway URL must start with http://"));
    err.reset();
    assertEquals(
        2, run("--gateway", gw.url(), "--token", "t", "--data", csv.getPath(), "--slow-ms", "-3"));
    assertTrue(
        err.toString(),
        err.toString().startsWith("error: --slow-ms needs an integer >= 0, got '-3'"));
    err.reset();
    assertEquals(2, run("--gateway", gw.url(), "--token", "t", "--data", "/nonexistent.csv"));
    assertTrue(err.toString(), err.toString().startsWith("error: /nonexistent.csv"));
  }

  @Test
  public void aSeparateJvmPhoneStopsOnSigterm() throws Exception {
    gw.pollDelayMs = 20_000;
    String java =
        System.getProperty("java.home") + File.separator + "bin" + File.separator + "java";
    ProcessBuilder pb =
        new ProcessBuilder(
            Arrays.asList(
                java,
                "-cp",
                System.getProperty("java.class.path"),
                "org.flowerbed.phone.PhoneMain",
                "--gateway",
                gw.url(),
                "--token",
                "tok-a",
                "--data",
                csv.getPath()));
    File log = tmp.newFile("phone.log");
    pb.redirectErrorStream(true);
    pb.redirectOutput(log); // Process.destroy() closes pipes, so the output goes to a file
    Process p = pb.start();
    try {
      while (gw.requests.size() < 2) {
        Thread.sleep(10); // hello done, now blocked in a 20 s long poll
      }
      p.destroy(); // SIGTERM
      assertTrue("no exit within 10 s of SIGTERM", p.waitFor(10, TimeUnit.SECONDS));
      BufferedReader lines =
          new BufferedReader(
              new InputStreamReader(new FileInputStream(log), StandardCharsets.UTF_8));
      try {
        assertEquals("hello node_id=3 phone=phone-3 chunk_bytes=1048576", lines.readLine());
        assertEquals("stopped tasks=0", lines.readLine());
      } finally {
        lines.close();
      }
      assertEquals(143, p.exitValue()); // 128 + SIGTERM, after the shutdown hook ran
    } finally {
      p.destroyForcibly();
    }
  }
}
