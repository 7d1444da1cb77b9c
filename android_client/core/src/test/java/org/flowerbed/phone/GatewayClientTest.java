package org.flowerbed.phone;

import static org.junit.Assert.assertArrayEquals;
import static org.junit.Assert.assertEquals;
import static org.junit.Assert.assertNull;
import static org.junit.Assert.assertTrue;
import static org.junit.Assert.fail;

import java.io.IOException;
import java.io.InterruptedIOException;
import java.net.ServerSocket;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.Collections;
import java.util.HashMap;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.concurrent.atomic.AtomicReference;
import org.junit.Test;

public class GatewayClientTest extends GatewayFixture {
  /** Waits 100, 200, 400, ... ms (no jitter), at most 4 attempts per request. */
  private GatewayClient client(String url, String token) {
    return new GatewayClient(url, token, new Backoff(100, 10_000, 0, 4, 0), recorder, 2000, 5000);
  }

  @Override
  protected GatewayClient client() {
    return client(gw.url(), "tok-a");
  }

  private static byte[] blob(int floats) {
    float[] v = new float[floats];
    for (int i = 0; i < floats; i++) {
      v[i] = i * 0.25f;
    }
    return TensorCodec.encode(
        Collections.singletonList(new NamedArray("fc.weight", new int[] {floats}, v)));
  }

  private Task taskWithArrays(String id, byte[] arrays) throws IOException {
    gw.addTask(id, "train", new HashMap<String, Object>(), arrays);
    return client().pollTask(0);
  }

  private List<String> requestsStartingWith(String prefix) {
    List<String> out = new ArrayList<String>();
    synchronized (gw.requests) {
      for (String r : gw.requests) {
        if (r.startsWith(prefix)) {
          out.add(r);
        }
      }
    }
    return out;
  }

  @Test
  public void helloSendsProtocolDeviceAndTheBearerToken() throws IOException {
    Map<String, Object> device = new LinkedHashMap<String, Object>();
    device.put("model", "Pixel 7");
    Hello h = client().hello(device);
    assertEquals(7, h.nodeId);
    assertEquals("phone-7", h.phone);
    assertEquals(1 << 20, h.chunkBytes);
    assertEquals(2L, gw.hellos.get(0).get("protocol"));
    assertEquals(device, gw.hellos.get(0).get("device"));
  }

  @Test
  public void nodeIdsAreUint64() throws IOException {
    // Flower draws node ids from the whole uint64 range; this one is above 2^63-1.
    Hello h =
        Hello.fromJson(
            Json.parseObject(
                "{\"node_id\": 16659729769155621624, \"phone\": \"p0\", \"poll_s\": 5,"
                    + " \"max_upload_bytes\": 67108864, \"chunk_bytes\": 1048576}"));
    assertEquals("16659729769155621624", h.nodeIdText());
    try {
      Hello.fromJson(Json.parseObject("{\"node_id\": 18446744073709551616}"));
      fail("2^64 is not a node id");
    } catch (GatewayException e) {
      assertTrue(
          e.getMessage(), e.getMessage().contains("node_id must be an integer in [0, 2^64)"));
    }
  }

  @Test
  public void helloAfterALostConnectionReturnsTheSameNode() throws IOException {
    GatewayClient c = client();
    long first = c.hello(new HashMap<String, Object>()).nodeId;
    gw.fault("/v1/hello", 0, null); // the phone slept, its Wi-Fi dropped mid-request
    long again = c.hello(new HashMap<String, Object>()).nodeId;
    assertEquals(first, again);
    assertEquals(3, requestsStartingWith("POST /v1/hello").size());
  }

  @Test
  public void wrongTokenIsRefusedWithoutRetrying() {
    try {
      client(gw.url(), "stolen").hello(new HashMap<String, Object>());
      fail("expected GatewayException");
    } catch (IOException e) {
      assertTrue(e instanceof GatewayException);
      assertEquals(401, ((GatewayException) e).status());
      assertEquals("token refused by the gateway: unknown token", e.getMessage());
    }
    assertEquals(1, gw.requests.size());
    assertTrue(sleeps.isEmpty());
  }

  @Test
  public void unsupportedProtocolIs426() {
    gw.fault("/v1/hello", 426, "{\"error\": \"speak v2\", \"supported\": [2]}");
    try {
      client().hello(new HashMap<String, Object>());
      fail("expected GatewayException");
    } catch (IOException e) {
      assertEquals(426, ((GatewayException) e).status());
      assertEquals("gateway speaks none of this app's protocol revisions; update the app: speak v2", e.getMessage());
    }
  }

  @Test
  public void pollGivesNullWithoutWorkAndTheTaskWithIt() throws IOException {
    GatewayClient c = client();
    assertNull(c.pollTask(3));
    Map<String, Object> config = new HashMap<String, Object>();
    config.put("local-steps", 5L);
    gw.addTask("t-1", "evaluate", config, blob(3));
    Task t = c.pollTask(3);
    assertEquals("t-1", t.id);
    assertEquals("evaluate", t.type);
    assertEquals(5L, t.config.get("local-steps"));
    assertEquals(blob(3).length, t.arraysBytes);
    assertEquals(2, requestsStartingWith("GET /v1/task?wait=3").size());
  }

  @Test
  public void serverErrorsAreRetried() throws IOException {
    gw.fault("/v1/task", 503, "{\"error\": \"restarting\"}");
    assertNull(client().pollTask(0));
    assertEquals(Arrays.asList(100L), sleeps);
  }

  @Test
  public void networkErrorsBackOffExponentiallyThenGiveUp() throws IOException {
    ServerSocket s = new ServerSocket(0);
    int deadPort = s.getLocalPort();
    s.close();
    try {
      client("http://127.0.0.1:" + deadPort, "tok-a").pollTask(0);
      fail("expected IOException");
    } catch (GatewayException e) {
      fail("a network error is not a gateway answer: " + e);
    } catch (IOException e) {
      assertTrue(e.getMessage(), e.getMessage().startsWith("poll failed 4 times in a row"));
    }
    assertEquals(Arrays.asList(100L, 200L, 400L), sleeps);
  }

  @Test
  public void downloadGetsTheWholeBlob() throws IOException {
    byte[] arrays = blob(5000);
    Task t = taskWithArrays("t-1", arrays);
    assertArrayEquals(arrays, client().downloadArrays(t));
  }

  @Test
  public void downloadResumesWithRangeAfterTheConnectionBreaks() throws IOException {
    byte[] arrays = blob(5000);
    Task t = taskWithArrays("t-1", arrays);
    gw.cutDownloadAt = 3000;
    assertArrayEquals(arrays, client().downloadArrays(t));
    List<String> gets = requestsStartingWith("GET /v1/task/t-1/arrays");
    assertEquals(2, gets.size());
    assertTrue(gets.get(1), gets.get(1).contains("Range:bytes=3000-"));
  }

  @Test
  public void downloadOfAnExpiredTaskIs404() throws IOException {
    Task t = taskWithArrays("t-1", blob(4));
    gw.tasks.remove("t-1");
    try {
      client().downloadArrays(t);
      fail("expected GatewayException");
    } catch (GatewayException e) {
      assertEquals(404, e.status());
    }
  }

  /**
   * Uploading {@code result} (2,500 bytes) as the result of task t-1, of which the gateway holds
   * the first {@code held} bytes already, in chunks of 1,000 leaves them all at the gateway, sent
   * with offsets 0, 1000 and 2000.
   */
  private void assertUploadsIn1000ByteChunks(byte[] result, int held) throws IOException {
    Task t = taskWithArrays("t-1", blob(4));
    gw.tasks.get("t-1").upload.write(result, 0, held);
    client().uploadResult(t.id, result, 1000);
    assertArrayEquals(result, gw.tasks.get("t-1").upload.toByteArray());
    assertEquals(
        Arrays.asList(
            "PUT /v1/task/t-1/result?offset=0&total=2500 len=1000",
            "PUT /v1/task/t-1/result?offset=1000&total=2500 len=1000",
            "PUT /v1/task/t-1/result?offset=2000&total=2500 len=500"),
        requestsStartingWith("PUT"));
  }

  @Test
  public void uploadSendsChunksOfAtMostChunkBytes() throws IOException {
    byte[] result = new byte[2500];
    for (int i = 0; i < result.length; i++) {
      result[i] = (byte) i;
    }
    assertUploadsIn1000ByteChunks(result, 0);
  }

  @Test
  public void uploadResumesFromTheOffsetA409Names() throws IOException {
    // An earlier attempt delivered the first 1000 bytes but its answer was lost.
    byte[] result = new byte[2500];
    Arrays.fill(result, (byte) 3);
    assertUploadsIn1000ByteChunks(result, 1000);
  }

  @Test
  public void uploadRetriesAChunkWhoseConnectionBroke() throws IOException {
    Task t = taskWithArrays("t-1", blob(4));
    byte[] result = new byte[1500];
    Arrays.fill(result, (byte) 9);
    gw.fault("/v1/task/t-1/result", 0, null);
    client().uploadResult(t.id, result, 1000);
    assertArrayEquals(result, gw.tasks.get("t-1").upload.toByteArray());
    assertEquals(Arrays.asList(100L), sleeps);
  }

  @Test
  public void aConflictTheGatewayDoesNotResolveIsAProtocolViolation() throws IOException {
    Task t = taskWithArrays("t-1", blob(4));
    gw.fault("/v1/task/t-1/result", 409, "{\"received\": 0}");
    try {
      client().uploadResult(t.id, new byte[10], 1000);
      fail("expected GatewayException");
    } catch (GatewayException e) {
      assertEquals(GatewayException.PROTOCOL_VIOLATION, e.status());
    }
  }

  @Test
  public void oversizeUploadIs413AndNotRetried() throws IOException {
    Task t = taskWithArrays("t-1", blob(4));
    gw.maxUploadBytes = 100;
    try {
      client().uploadResult(t.id, new byte[2500], 1000);
      fail("expected GatewayException");
    } catch (GatewayException e) {
      assertEquals(413, e.status());
      assertTrue(e.getMessage(), e.getMessage().contains("exceeds the limit"));
    }
    assertEquals(1, requestsStartingWith("PUT").size());
    assertTrue(sleeps.isEmpty());
  }

  @Test
  public void completeAndFailSendTheirBodies() throws IOException {
    gw.addTask("t-1", "train", new HashMap<String, Object>(), blob(1));
    gw.addTask("t-2", "train", new HashMap<String, Object>(), blob(1));
    Map<String, Object> metrics = new LinkedHashMap<String, Object>();
    metrics.put("num-examples", 32L);
    metrics.put("train-time-s", 0.5);
    client().complete("t-1", metrics);
    client().fail("t-2", "battery low");
    assertEquals(metrics, gw.tasks.get("t-1").metrics);
    assertEquals("battery low", gw.tasks.get("t-2").failReason);
  }

  @Test
  public void aCompleteWhoseConnectionBrokeIsRetriedByTheClientItself() throws IOException {
    gw.addTask("t-1", "train", new HashMap<String, Object>(), blob(1));
    gw.fault("/v1/task/t-1/complete", 0, null);
    client().complete("t-1", new HashMap<String, Object>());
    assertEquals(2, requestsStartingWith("POST /v1/task/t-1/complete").size());
    assertEquals(Arrays.asList(100L), sleeps);
  }

  @Test
  public void completingAnExpiredTaskIs404() {
    try {
      client().complete("gone", new HashMap<String, Object>());
      fail("expected GatewayException");
    } catch (IOException e) {
      assertEquals(404, ((GatewayException) e).status());
    }
  }

  @Test
  public void closeAbortsALongPollFromAnotherThread() throws Exception {
    gw.pollDelayMs = 20_000;
    final GatewayClient c = client();
    final AtomicReference<Throwable> outcome = new AtomicReference<Throwable>();
    Thread poller =
        new Thread() {
          @Override
          public void run() {
            try {
              c.pollTask(20);
            } catch (Throwable e) {
              outcome.set(e);
            }
          }
        };
    poller.start();
    while (requestsStartingWith("GET /v1/task").isEmpty()) {
      Thread.sleep(10);
    }
    c.close();
    poller.join(5000);
    assertTrue("poll still blocked after close()", !poller.isAlive());
    assertTrue(String.valueOf(outcome.get()), outcome.get() instanceof InterruptedIOException);
  }
}
