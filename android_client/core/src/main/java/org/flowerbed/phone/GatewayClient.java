package org.flowerbed.phone;

import java.io.ByteArrayOutputStream;
import java.io.File;
import java.io.IOException;
import java.io.InputStream;
import java.io.InterruptedIOException;
import java.io.OutputStream;
import java.io.RandomAccessFile;
import java.io.UnsupportedEncodingException;
import java.net.HttpURLConnection;
import java.net.URL;
import java.net.URLEncoder;
import java.nio.charset.StandardCharsets;
import java.security.cert.CertificateException;
import java.util.ArrayList;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.regex.Matcher;
import java.util.regex.Pattern;
import javax.net.ssl.HttpsURLConnection;
import javax.net.ssl.SSLSocketFactory;

/**
 * The phone side of protocol revisions 1 and 2 (android_client/PROTOCOL.md) over {@link
 * HttpURLConnection}, which Android and every JVM have.
 *
 * <p>Every request carries {@code Authorization: Bearer <token>}; the token is the phone's
 * identity, so calling {@link #hello} again after sleep or a network change returns the same node
 * id. Network errors and 5xx answers are retried with {@link Backoff}; other error answers raise
 * {@link GatewayException} at once. Downloads resume with {@code Range} and uploads resume from the
 * offset a {@code 409} names, so a flaky Wi-Fi link costs only the bytes in flight.
 *
 * <p>One client serves one thread; {@link #close} may be called from any thread to abort.
 */
public final class GatewayClient {
  /** The newest protocol revision this client speaks. */
  public static final int PROTOCOL_VERSION = 2;

  /** Every revision this client speaks, oldest first. */
  static final int[] PROTOCOLS = {1, 2};

  /** The version in the API path; every revision lives under {@code /v1}. */
  static final int PATH_VERSION = 1;

  private static final Pattern CONTENT_RANGE = Pattern.compile("bytes (\\d+)-(\\d+)/(\\d+|\\*)");
  private static final int MAX_CONFLICTS_IN_A_ROW = 3;

  private final String root;
  private final String base;
  private final String token;
  private final Backoff backoff;
  private final Sleeper sleeper;
  private final int connectTimeoutMs;
  private final int readTimeoutMs;
  private volatile boolean closed;
  private volatile HttpURLConnection active;
  private SSLSocketFactory pinned;
  private Map<String, Object> app = new LinkedHashMap<String, Object>();

  /**
   * @param gatewayUrl gateway root such as {@code https://192.168.1.10:8470} (the client adds {@code
   *     /v1})
   * @param token this phone's bearer token
   * @param backoff retry policy for network errors
   * @param sleeper how to wait between retries
   * @param connectTimeoutMs connect timeout of each request
   * @param readTimeoutMs read timeout of each request (long polls add their wait to it)
   */
  public GatewayClient(
      String gatewayUrl,
      String token,
      Backoff backoff,
      Sleeper sleeper,
      int connectTimeoutMs,
      int readTimeoutMs) {
    if (!gatewayUrl.startsWith("http://") && !gatewayUrl.startsWith("https://")) {
      throw new IllegalArgumentException(
          "gateway URL must start with http:// or https://, got '" + gatewayUrl + "'");
    }
    if (token == null || token.isEmpty()) {
      throw new IllegalArgumentException("token must be a non-empty string");
    }
    String root = gatewayUrl;
    while (root.endsWith("/")) {
      root = root.substring(0, root.length() - 1);
    }
    this.root = root;
    this.base = root + "/v" + PATH_VERSION;
    this.token = token;
    this.backoff = backoff;
    this.sleeper = sleeper;
    this.connectTimeoutMs = connectTimeoutMs;
    this.readTimeoutMs = readTimeoutMs;
  }

  /** A client with {@link Backoff#defaults()}, real sleeping and 10 s / 60 s timeouts. */
  public GatewayClient(String gatewayUrl, String token) {
    this(gatewayUrl, token, Backoff.defaults(), Sleeper.SYSTEM, 10_000, 60_000);
  }

  /** Whether this client speaks protocol revision {@code revision}. */
  public static boolean speaks(long revision) {
    for (int p : PROTOCOLS) {
      if (p == revision) {
        return true;
      }
    }
    return false;
  }

  /**
   * Trust exactly the gateway certificate whose public key has {@code pin} (from the enrolment
   * URI; see {@link CertificatePin}) instead of the platform's CAs. HTTPS gateways only.
   */
  public GatewayClient pinCertificate(String pin) {
    if (!root.startsWith("https://")) {
      throw new IllegalArgumentException("a certificate pin needs an https:// gateway URL");
    }
    this.pinned = CertificatePin.socketFactory(pin);
    return this;
  }

  /** Versions sent with hello: the app's and its ExecuTorch runtime's (null: none). */
  public GatewayClient appVersions(String appVersion, String runtimeVersion) {
    Map<String, Object> versions = new LinkedHashMap<String, Object>();
    versions.put("version", appVersion);
    if (runtimeVersion != null) {
      versions.put("runtime", runtimeVersion);
    }
    this.app = versions;
    return this;
  }

  /**
   * {@code POST /v1/hello}: announce this phone, agree on a protocol revision, learn its node id
   * and limits.
   *
   * @param device free-form device facts (model, cores, ...), logged by the gateway
   * @throws GatewayException 426 when the gateway speaks none of this app's revisions (the message
   *     lists the ones it speaks: the app needs an update)
   */
  public Hello hello(Map<String, Object> device) throws IOException {
    Map<String, Object> body = new LinkedHashMap<String, Object>();
    body.put("protocol", PROTOCOL_VERSION);
    List<Object> offered = new ArrayList<Object>();
    for (int p : PROTOCOLS) {
      offered.add((long) p);
    }
    body.put("protocols", offered);
    body.put("device", device);
    if (!app.isEmpty()) {
      body.put("app", app);
    }
    Response r = withRetry("hello", "POST", "/hello", json(body), readTimeoutMs);
    expect(r, 200);
    return Hello.fromJson(r.json());
  }

  /**
   * {@code GET /v1/task?wait=waitS}: long-poll for work.
   *
   * @return the task, or null when the gateway has none now (204)
   */
  public Task pollTask(int waitS) throws IOException {
    Response r =
        withRetry("poll", "GET", "/task?wait=" + waitS, null, readTimeoutMs + 1000 * waitS);
    if (r.status == 204) {
      return null;
    }
    expect(r, 200);
    return Task.fromJson(r.json());
  }

  /**
   * {@code GET /v1/task/<id>/arrays}: the global model as a tensor blob. After a broken connection
   * the download resumes with {@code Range: bytes=<received>-}.
   *
   * @throws GatewayException 404 if the task expired, or a protocol violation if the blob's length
   *     differs from the task's {@code arrays_bytes}
   */
  public byte[] downloadArrays(Task task) throws IOException {
    long total = task.arraysBytes;
    if (total > Integer.MAX_VALUE - 8) {
      throw new GatewayException(
          GatewayException.PROTOCOL_VIOLATION, "arrays of " + total + " bytes exceed 2 GiB");
    }
    String path = "/task/" + segment(task.id) + "/arrays";
    ByteArrayOutputStream got = new ByteArrayOutputStream((int) Math.min(total, 1 << 20));
    int failures = 0;
    while (true) {
      checkOpen();
      int before = got.size();
      try {
        downloadOnce(path, new MemorySink(got), total);
        return got.toByteArray();
      } catch (GatewayException e) {
        throw e;
      } catch (IOException e) {
        if (got.size() > before) {
          failures = 0; // the link works, it is only flaky: keep going while bytes arrive
        }
        failures = waitBeforeRetry("download of " + task, failures, e);
      }
    }
  }

  /**
   * {@code GET /v1/program/<sha256>} into {@code part}, appending to the bytes it already holds
   * ({@code Range}), so an interrupted download resumes. The caller checks the hash.
   *
   * @throws GatewayException 404 if the gateway no longer serves the program
   */
  public void downloadProgram(ProgramInfo program, File part) throws IOException {
    String path = "/program/" + segment(program.sha256());
    int failures = 0;
    while (true) {
      checkOpen();
      FileSink sink = new FileSink(part);
      long before = sink.size();
      try {
        downloadOnce(path, sink, program.bytes());
        return;
      } catch (GatewayException e) {
        throw e;
      } catch (IOException e) {
        if (sink.size() > before) {
          failures = 0;
        }
        failures = waitBeforeRetry("download of program " + program.name(), failures, e);
      } finally {
        sink.close();
      }
    }
  }

  /** Where a download's bytes go: memory for arrays, a file for programs. */
  private interface Sink {
    long size() throws IOException;

    void reset() throws IOException;

    void write(byte[] buf, int off, int len) throws IOException;
  }

  private static final class MemorySink implements Sink {
    final ByteArrayOutputStream bytes;

    MemorySink(ByteArrayOutputStream bytes) {
      this.bytes = bytes;
    }

    @Override
    public long size() {
      return bytes.size();
    }

    @Override
    public void reset() {
      bytes.reset();
    }

    @Override
    public void write(byte[] buf, int off, int len) {
      bytes.write(buf, off, len);
    }
  }

  private static final class FileSink implements Sink {
    final RandomAccessFile file;

    FileSink(File f) throws IOException {
      this.file = new RandomAccessFile(f, "rw");
      file.seek(file.length());
    }

    @Override
    public long size() throws IOException {
      return file.length();
    }

    @Override
    public void reset() throws IOException {
      file.setLength(0);
      file.seek(0);
    }

    @Override
    public void write(byte[] buf, int off, int len) throws IOException {
      file.write(buf, off, len);
    }

    void close() throws IOException {
      file.close();
    }
  }

  private void downloadOnce(String path, Sink got, long total) throws IOException {
    HttpURLConnection c = open("GET", path, readTimeoutMs);
    try {
      if (got.size() > 0) {
        c.setRequestProperty("Range", "bytes=" + got.size() + "-");
      }
      int status = c.getResponseCode();
      if (status == 200) {
        got.reset(); // the gateway sent the whole blob again
      } else if (status == 206) {
        String range = c.getHeaderField("Content-Range");
        Matcher m = range == null ? null : CONTENT_RANGE.matcher(range);
        if (m == null || !m.matches() || Long.parseLong(m.group(1)) != got.size()) {
          throw new GatewayException(
              GatewayException.PROTOCOL_VIOLATION,
              "asked for bytes " + got.size() + "- but got Content-Range '" + range + "'");
        }
      } else {
        Response r = new Response(status, readAll(c.getErrorStream()));
        if (status >= 500) {
          throw new IOException("gateway answered " + status + ": " + r.error());
        }
        throw r.failure("download");
      }
      InputStream in = c.getInputStream();
      try {
        byte[] buf = new byte[64 * 1024];
        int n;
        while ((n = in.read(buf)) >= 0) {
          got.write(buf, 0, n);
          if (got.size() > total) {
            throw new GatewayException(
                GatewayException.PROTOCOL_VIOLATION,
                "the download is longer than the " + total + " bytes the task announced");
          }
        }
      } finally {
        in.close();
      }
      if (got.size() < total) {
        throw new IOException("connection ended after " + got.size() + " of " + total + " bytes");
      }
    } finally {
      c.disconnect();
      active = null;
    }
  }

  /**
   * {@code PUT /v1/task/<id>/result?offset=&total=}: upload the updated tensors in chunks of at
   * most {@code chunkBytes}. After a broken connection the same chunk is sent again; a {@code 409}
   * names the bytes the gateway holds and the upload goes on from there.
   *
   * @throws GatewayException 413 if the blob exceeds the gateway's limit (the task is then failed
   *     for this phone), 404 if the task expired
   */
  public void uploadResult(String taskId, byte[] blob, int chunkBytes) throws IOException {
    if (chunkBytes <= 0) {
      throw new IllegalArgumentException("chunkBytes must be > 0, got " + chunkBytes);
    }
    if (blob.length == 0) {
      throw new IllegalArgumentException("an upload has at least the 8-byte blob header");
    }
    String path = "/task/" + segment(taskId) + "/result";
    long total = blob.length;
    long offset = 0;
    int failures = 0;
    int conflicts = 0;
    while (offset < total) {
      checkOpen();
      int len = (int) Math.min(chunkBytes, total - offset);
      Response r;
      try {
        r =
            exchange(
                "PUT",
                path + "?offset=" + offset + "&total=" + total,
                TensorCodec.CONTENT_TYPE,
                blob,
                (int) offset,
                len,
                readTimeoutMs,
                true);
        if (r.status >= 500) {
          throw new IOException("gateway answered " + r.status + ": " + r.error());
        }
      } catch (GatewayException e) {
        throw e;
      } catch (IOException e) {
        failures = waitBeforeRetry("upload of task " + taskId, failures, e);
        continue;
      }
      failures = 0;
      if (r.status != 200 && r.status != 409) {
        throw r.failure("upload");
      }
      long received = r.received(total);
      if (r.status == 409) {
        if (received == offset || ++conflicts > MAX_CONFLICTS_IN_A_ROW) {
          throw new GatewayException(
              GatewayException.PROTOCOL_VIOLATION,
              "upload conflict the gateway does not resolve: sent offset "
                  + offset
                  + ", it holds "
                  + received);
        }
      } else {
        conflicts = 0;
        if (received <= offset) {
          throw new GatewayException(
              GatewayException.PROTOCOL_VIOLATION,
              "gateway accepted " + len + " bytes at " + offset + " but holds only " + received);
        }
      }
      offset = received;
    }
  }

  /**
   * {@code POST /v1/task/<id>/complete} with the task's metrics (wire keys).
   *
   * @throws GatewayException 400 with the gateway's reason if it rejected the result, 404 if the
   *     task expired
   */
  public void complete(String taskId, Map<String, Object> metrics) throws IOException {
    Map<String, Object> body = new LinkedHashMap<String, Object>();
    body.put("metrics", metrics);
    Response r =
        withRetry(
            "complete",
            "POST",
            "/task/" + segment(taskId) + "/complete",
            json(body),
            readTimeoutMs,
            true);
    expect(r, 200);
  }

  /** {@code POST /v1/task/<id>/fail}: give the task up, saying why. */
  public void fail(String taskId, String reason) throws IOException {
    Map<String, Object> body = new LinkedHashMap<String, Object>();
    body.put("reason", reason);
    Response r =
        withRetry("fail", "POST", "/task/" + segment(taskId) + "/fail", json(body), readTimeoutMs);
    expect(r, 200);
  }

  /** Abort the request in flight and refuse new ones; safe from any thread. */
  public void close() {
    closed = true;
    HttpURLConnection c = active;
    if (c != null) {
      c.disconnect();
    }
  }

  private Response withRetry(String what, String method, String path, byte[] body, int timeoutMs)
      throws IOException {
    return withRetry(what, method, path, body, timeoutMs, false);
  }

  private Response withRetry(
      String what, String method, String path, byte[] body, int timeoutMs, boolean stream)
      throws IOException {
    int failures = 0;
    while (true) {
      checkOpen();
      try {
        Response r =
            exchange(
                method,
                path,
                "application/json",
                body,
                0,
                body == null ? 0 : body.length,
                timeoutMs,
                stream);
        if (r.status < 500) {
          return r;
        }
        throw new IOException("gateway answered " + r.status + ": " + r.error());
      } catch (GatewayException e) {
        throw e;
      } catch (IOException e) {
        failures = waitBeforeRetry(what, failures, e);
      }
    }
  }

  /** Count one more failure and wait, or give up if closed or out of attempts. */
  private int waitBeforeRetry(String what, int failures, IOException cause) throws IOException {
    for (Throwable t = cause; t != null; t = t.getCause()) {
      if (t instanceof CertificateException) {
        throw new GatewayException(
            GatewayException.CERTIFICATE_REFUSED,
            what + ": gateway certificate refused: " + t.getMessage());
      }
    }
    if (closed) {
      throw new InterruptedIOException("gateway client closed during " + what);
    }
    int count = failures + 1;
    if (count >= backoff.maxAttempts()) {
      throw new IOException(
          what + " failed " + count + " times in a row; last error: " + cause.getMessage(), cause);
    }
    sleeper.sleep(backoff.delayMs(failures));
    return count;
  }

  private void checkOpen() throws InterruptedIOException {
    if (closed) {
      throw new InterruptedIOException("gateway client closed");
    }
  }

  private HttpURLConnection open(String method, String path, int timeoutMs) throws IOException {
    HttpURLConnection c = (HttpURLConnection) new URL(base + path).openConnection();
    if (pinned != null && c instanceof HttpsURLConnection) {
      ((HttpsURLConnection) c).setSSLSocketFactory(pinned);
    }
    active = c;
    if (closed) {
      c.disconnect();
      throw new InterruptedIOException("gateway client closed");
    }
    c.setRequestMethod(method);
    c.setConnectTimeout(connectTimeoutMs);
    c.setReadTimeout(timeoutMs);
    c.setUseCaches(false);
    c.setInstanceFollowRedirects(false);
    c.setRequestProperty("Authorization", "Bearer " + token);
    return c;
  }

  private Response exchange(
      String method,
      String path,
      String contentType,
      byte[] body,
      int offset,
      int len,
      int timeoutMs,
      boolean stream)
      throws IOException {
    HttpURLConnection c = open(method, path, timeoutMs);
    try {
      if (body != null) {
        c.setDoOutput(true);
        c.setRequestProperty("Content-Type", contentType);
        if (stream) {
          // Streaming mode sends the body without buffering it again and stops the JDK from
          // silently re-sending the request on a stale connection; but a 401 answer then
          // loses its {"error": ...} body, so the idempotent hello and fail are buffered.
          c.setFixedLengthStreamingMode(len);
        }
        OutputStream out = c.getOutputStream();
        try {
          out.write(body, offset, len);
        } finally {
          out.close();
        }
      }
      int status = c.getResponseCode();
      InputStream in = status >= 400 ? c.getErrorStream() : c.getInputStream();
      return new Response(status, readAll(in));
    } finally {
      c.disconnect();
      active = null;
    }
  }

  private static void expect(Response r, int status) throws GatewayException {
    if (r.status != status) {
      throw r.failure("request");
    }
  }

  private static byte[] json(Map<String, Object> body) {
    return Json.write(body).getBytes(StandardCharsets.UTF_8);
  }

  /** Everything {@code in} holds (nothing for null), after which it is closed. */
  static byte[] readAll(InputStream in) throws IOException {
    if (in == null) {
      return new byte[0];
    }
    try {
      ByteArrayOutputStream out = new ByteArrayOutputStream();
      byte[] buf = new byte[8192];
      int n;
      while ((n = in.read(buf)) >= 0) {
        out.write(buf, 0, n);
      }
      return out.toByteArray();
    } finally {
      in.close();
    }
  }

  private static String segment(String s) {
    try {
      return URLEncoder.encode(s, "UTF-8").replace("+", "%20");
    } catch (UnsupportedEncodingException e) {
      throw new IllegalStateException("UTF-8 is always supported", e);
    }
  }

  /** One HTTP answer, body read in full. */
  private static final class Response {
    final int status;
    final byte[] body;

    Response(int status, byte[] body) {
      this.status = status;
      this.body = body;
    }

    String text() {
      return new String(body, StandardCharsets.UTF_8);
    }

    Map<String, Object> json() throws GatewayException {
      try {
        return Json.parseObject(text());
      } catch (IllegalArgumentException e) {
        throw new GatewayException(
            GatewayException.PROTOCOL_VIOLATION,
            "gateway answered "
                + status
                + " with a body that is not a JSON object: "
                + e.getMessage());
      }
    }

    /** The {"error": ...} reason, or the raw body if it is not one. */
    String error() {
      try {
        Object reason = Json.parseObject(text()).get("error");
        if (reason != null) {
          return String.valueOf(reason);
        }
      } catch (IllegalArgumentException e) {
        // not JSON: the raw text is the best reason there is
      }
      return text().isEmpty() ? "(no reason given)" : text();
    }

    GatewayException failure(String what) {
      String reason;
      if (status == 401) {
        reason = "token refused by the gateway";
      } else if (status == 426) {
        reason = "gateway speaks none of this app's protocol revisions; update the app";
      } else {
        reason = what + " answered " + status;
      }
      return new GatewayException(status, reason + ": " + error());
    }

    long received(long total) throws GatewayException {
      Object v = json().get("received");
      if (!(v instanceof Long) || (Long) v < 0 || (Long) v > total) {
        throw new GatewayException(
            GatewayException.PROTOCOL_VIOLATION,
            "upload answer " + status + " needs \"received\" in [0, " + total + "]: " + text());
      }
      return (Long) v;
    }
  }
}
