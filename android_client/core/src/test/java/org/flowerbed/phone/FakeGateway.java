package org.flowerbed.phone;

import com.sun.net.httpserver.HttpExchange;
import com.sun.net.httpserver.HttpServer;
import java.io.ByteArrayOutputStream;
import java.io.IOException;
import java.io.OutputStream;
import java.net.InetSocketAddress;
import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.Collections;
import java.util.HashMap;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.concurrent.ExecutorService;
import java.util.concurrent.Executors;
import java.util.regex.Matcher;
import java.util.regex.Pattern;

/**
 * A small in-test gateway that follows PROTOCOL.md on 127.0.0.1, records what the phone sent, and
 * can be told to misbehave (drop connections, cut downloads short, answer a given status).
 */
final class FakeGateway implements AutoCloseable {
  /** One task the gateway hands out until it is completed or failed. */
  static final class FakeTask {
    final String id;
    final String type;
    final Map<String, Object> config;
    final byte[] arrays;
    final ByteArrayOutputStream upload = new ByteArrayOutputStream();
    Map<String, Object> metrics;
    String failReason;
    /** The task's "program" object (protocol revision 2), or null. */
    Map<String, Object> program;

    FakeTask(String id, String type, Map<String, Object> config, byte[] arrays) {
      this.id = id;
      this.type = type;
      this.config = config;
      this.arrays = arrays;
    }
  }

  /** What to do to the next request whose path starts with a prefix. */
  private static final class Fault {
    final String prefix;
    final int status; // 0: drop the connection without answering
    final String body;

    Fault(String prefix, int status, String body) {
      this.prefix = prefix;
      this.status = status;
      this.body = body;
    }
  }

  private static final Pattern TASK_PATH =
      Pattern.compile("/v1/task/([^/]+)/(arrays|result|complete|fail)");

  final Map<String, Long> tokens = new HashMap<String, Long>();
  final List<FakeTask> queue = Collections.synchronizedList(new ArrayList<FakeTask>());
  final Map<String, FakeTask> tasks =
      Collections.synchronizedMap(new LinkedHashMap<String, FakeTask>());
  final List<String> requests = Collections.synchronizedList(new ArrayList<String>());
  final List<Map<String, Object>> hellos =
      Collections.synchronizedList(new ArrayList<Map<String, Object>>());
  private final List<Fault> faults = Collections.synchronizedList(new ArrayList<Fault>());
  int chunkBytes = 1 << 20;
  long maxUploadBytes = 1 << 26;

  /** The expires_in_s every task announces. */
  volatile double expiresInS = 60.0;

  /** Milliseconds a poll waits before answering 204 when there is no task. */
  volatile long pollDelayMs;

  /** Bytes of the next download (arrays or program) to send before cutting it; -1: all. */
  volatile int cutDownloadAt = -1;

  /** Programs served at /v1/program/<sha256>. */
  final Map<String, byte[]> programs = Collections.synchronizedMap(new HashMap<String, byte[]>());

  /** The hello answer's "protocol" (0: leave it out, as a revision-1 gateway does). */
  volatile long protocol = 2;

  private final HttpServer server;
  private final ExecutorService pool = Executors.newCachedThreadPool();

  FakeGateway() throws IOException {
    server = HttpServer.create(new InetSocketAddress("127.0.0.1", 0), 0);
    server.createContext("/", this::handle);
    server.setExecutor(pool);
    server.start();
  }

  String url() {
    return "http://127.0.0.1:" + server.getAddress().getPort();
  }

  FakeTask addTask(String id, String type, Map<String, Object> config, byte[] arrays) {
    FakeTask t = new FakeTask(id, type, config, arrays);
    queue.add(t);
    tasks.put(id, t);
    return t;
  }

  /** The next request under {@code prefix} is answered {@code status} (0: dropped). */
  void fault(String prefix, int status, String body) {
    faults.add(new Fault(prefix, status, body));
  }

  @Override
  public void close() {
    server.stop(0);
    pool.shutdownNow();
  }

  private Fault takeFault(String path) {
    synchronized (faults) {
      for (int i = 0; i < faults.size(); i++) {
        if (path.startsWith(faults.get(i).prefix)) {
          return faults.remove(i);
        }
      }
    }
    return null;
  }

  private void handle(HttpExchange ex) throws IOException {
    try {
      String path = ex.getRequestURI().getPath();
      String query = ex.getRequestURI().getRawQuery();
      String range = ex.getRequestHeaders().getFirst("Range");
      byte[] body = GatewayClient.readAll(ex.getRequestBody());
      requests.add(
          ex.getRequestMethod()
              + " "
              + path
              + (query == null ? "" : "?" + query)
              + (range == null ? "" : " Range:" + range)
              + " len="
              + body.length);
      Fault f = takeFault(path);
      if (f != null) {
        if (f.status == 0) {
          throw new IOException("fault: drop the connection");
        }
        send(ex, f.status, f.body);
        return;
      }
      String auth = ex.getRequestHeaders().getFirst("Authorization");
      Long node = auth != null && auth.startsWith("Bearer ") ? tokens.get(auth.substring(7)) : null;
      if (node == null) {
        send(ex, 401, "{\"error\": \"unknown token\"}");
        return;
      }
      if (path.equals("/v1/hello")) {
        hellos.add(Json.parseObject(new String(body, StandardCharsets.UTF_8)));
        send(
            ex,
            200,
            "{\"node_id\": "
                + node
                + ", \"phone\": \"phone-"
                + node
                + "\", \"poll_s\": 1,"
                + " \"max_upload_bytes\": "
                + maxUploadBytes
                + ", \"chunk_bytes\": "
                + chunkBytes
                + (protocol > 0 ? ", \"protocol\": " + protocol : "")
                + "}");
        return;
      }
      if (path.startsWith("/v1/program/")) {
        byte[] program = programs.get(path.substring("/v1/program/".length()));
        if (program == null) {
          send(ex, 404, "{\"error\": \"no such program\"}");
        } else {
          sendRanged(ex, program, range);
        }
        return;
      }
      if (path.equals("/v1/task")) {
        FakeTask t = queue.isEmpty() ? null : queue.get(0);
        if (t == null) {
          if (pollDelayMs > 0) {
            try {
              Thread.sleep(pollDelayMs);
            } catch (InterruptedException e) {
              Thread.currentThread().interrupt();
            }
          }
          send(ex, 204, null);
          return;
        }
        Map<String, Object> j = new LinkedHashMap<String, Object>();
        j.put("task_id", t.id);
        j.put("type", t.type);
        j.put("config", t.config);
        j.put("arrays_bytes", (long) t.arrays.length);
        j.put("expires_in_s", expiresInS);
        if (t.program != null) {
          j.put("program", t.program);
        }
        send(ex, 200, Json.write(j));
        return;
      }
      Matcher m = TASK_PATH.matcher(path);
      FakeTask t = m.matches() ? tasks.get(m.group(1)) : null;
      if (t == null) {
        send(ex, 404, "{\"error\": \"unknown task\"}");
        return;
      }
      String what = m.group(2);
      if (what.equals("arrays")) {
        sendRanged(ex, t.arrays, range);
      } else if (what.equals("result")) {
        Map<String, String> q = params(query);
        long offset = Long.parseLong(q.get("offset"));
        long total = Long.parseLong(q.get("total"));
        if (total > maxUploadBytes) {
          queue.remove(t);
          send(ex, 413, "{\"error\": \"upload of " + total + " bytes exceeds the limit\"}");
          return;
        }
        synchronized (t.upload) {
          if (offset != t.upload.size()) {
            send(ex, 409, "{\"received\": " + t.upload.size() + "}");
            return;
          }
          t.upload.write(body);
          send(ex, 200, "{\"received\": " + t.upload.size() + "}");
        }
      } else if (what.equals("complete")) {
        @SuppressWarnings("unchecked")
        Map<String, Object> metrics =
            (Map<String, Object>)
                Json.parseObject(new String(body, StandardCharsets.UTF_8)).get("metrics");
        t.metrics = metrics;
        queue.remove(t);
        send(ex, 200, "{\"status\": \"accepted\"}");
      } else {
        t.failReason =
            (String) Json.parseObject(new String(body, StandardCharsets.UTF_8)).get("reason");
        queue.remove(t);
        send(ex, 200, "{\"status\": \"failed\"}");
      }
    } catch (IOException | RuntimeException e) {
      // Thrown out of the handler, the server closes the connection: the client sees it break.
      throw new IOException(e);
    }
  }

  private void sendRanged(HttpExchange ex, byte[] blob, String range) throws IOException {
    int start = 0;
    int status = 200;
    if (range != null) {
      Matcher r = Pattern.compile("bytes=(\\d+)-").matcher(range);
      if (!r.matches()) {
        send(ex, 416, "{\"error\": \"bad range\"}");
        return;
      }
      start = Integer.parseInt(r.group(1));
      status = 206;
      ex.getResponseHeaders()
          .set(
              "Content-Range",
              "bytes " + start + "-" + (blob.length - 1) + "/" + blob.length);
    }
    int len = blob.length - start;
    ex.getResponseHeaders().set("Content-Type", TensorCodec.CONTENT_TYPE);
    ex.sendResponseHeaders(status, len);
    OutputStream out = ex.getResponseBody();
    int cut = cutDownloadAt;
    if (cut >= 0) {
      cutDownloadAt = -1;
      out.write(blob, start, Math.min(cut, len));
      out.flush();
      throw new IOException("fault: cut the download after " + cut + " bytes");
    }
    out.write(blob, start, len);
    out.close();
  }

  private static void send(HttpExchange ex, int status, String json) throws IOException {
    if (json == null) {
      ex.sendResponseHeaders(status, -1);
      ex.close();
      return;
    }
    byte[] b = json.getBytes(StandardCharsets.UTF_8);
    ex.getResponseHeaders().set("Content-Type", "application/json");
    ex.sendResponseHeaders(status, b.length);
    OutputStream out = ex.getResponseBody();
    out.write(b);
    out.close();
  }

  private static Map<String, String> params(String query) {
    Map<String, String> q = new HashMap<String, String>();
    if (query != null) {
      for (String kv : query.split("&")) {
        int eq = kv.indexOf('=');
        q.put(kv.substring(0, eq), kv.substring(eq + 1));
      }
    }
    return q;
  }
}
