package org.flowerbed.phone;

import java.util.ArrayList;
import java.util.Arrays;
import java.util.Collections;
import java.util.HashMap;
import java.util.List;
import java.util.Map;
import java.util.regex.Pattern;

/**
 * The training program a task needs (protocol revision 2): which ExecuTorch program, by SHA-256,
 * where to fetch it, the parameters it trains, the state it carries from step to step (batch-norm
 * running statistics), its evaluation method and the batch sizes it takes. See
 * android_client/PROTOCOL.md.
 */
public final class ProgramInfo {
  private static final Pattern SHA256 = Pattern.compile("[0-9a-f]{64}");
  private static final Pattern VERSION = Pattern.compile("\\d+(\\.\\d+){0,3}");

  private final String name;
  private final String sha256;
  private final long bytes;
  private final String minRuntime;
  private final String path;
  private final Map<String, int[]> parameters;
  private final List<String> order;
  private List<String> stateOrder = Collections.emptyList();
  private long[] sampleShape;
  private int minBatchSize = 1;
  private int maxBatchSize;
  private String evaluateMethod;

  ProgramInfo(
      String name,
      String sha256,
      long bytes,
      String minRuntime,
      String path,
      Map<String, int[]> parameters,
      List<String> order) {
    this.name = name;
    this.sha256 = sha256;
    this.bytes = bytes;
    this.minRuntime = minRuntime;
    this.path = path;
    this.parameters = parameters;
    this.order = Collections.unmodifiableList(order);
  }

  /**
   * Read the {@code program} object of a task.
   *
   * @throws GatewayException (protocol violation) naming the missing or ill-typed field
   */
  @SuppressWarnings("unchecked")
  public static ProgramInfo fromJson(Object value) throws GatewayException {
    if (!(value instanceof Map)) {
      throw violation("program must be an object", value);
    }
    Map<String, Object> json = (Map<String, Object>) value;
    Object name = json.get("name");
    Object sha = json.get("sha256");
    Object bytes = json.get("bytes");
    Object minRuntime = json.get("min_runtime");
    Object url = json.get("url");
    Object params = json.get("parameters");
    if (!(name instanceof String)) {
      throw violation("program.name must be a string", json);
    }
    if (!(sha instanceof String) || !SHA256.matcher((String) sha).matches()) {
      throw violation("program.sha256 must be 64 lowercase hex digits", json);
    }
    if (!(bytes instanceof Long) || (Long) bytes <= 0) {
      throw violation("program.bytes must be an integer > 0", json);
    }
    if (!(minRuntime instanceof String) || !VERSION.matcher((String) minRuntime).matches()) {
      throw violation("program.min_runtime must be a dotted version such as 1.5.1", json);
    }
    if (!(url instanceof String) || !((String) url).equals("/v1/program/" + sha)) {
      throw violation("program.url must be /v1/program/<sha256>", json);
    }
    if (!(params instanceof List) || ((List<Object>) params).isEmpty()) {
      throw violation("program.parameters must be a non-empty list", json);
    }
    Map<String, int[]> layout = new HashMap<String, int[]>();
    List<String> order = readLayout((List<Object>) params, layout, "parameter", json);
    ProgramInfo info =
        new ProgramInfo(
            (String) name,
            (String) sha,
            (Long) bytes,
            (String) minRuntime,
            (String) url,
            layout,
            order);
    Object state = json.get("state");
    if (state != null) {
      if (!(state instanceof List)) {
        throw violation("program.state must be a list", json);
      }
      info.stateOrder =
          Collections.unmodifiableList(
              readLayout((List<Object>) state, info.parameters, "state array", json));
    }
    Object evaluate = json.get("evaluate_method");
    if (evaluate != null) {
      if (!(evaluate instanceof String) || ((String) evaluate).isEmpty()) {
        throw violation("program.evaluate_method must be a method name", json);
      }
      info.evaluateMethod = (String) evaluate;
    }
    Object input = json.get("input");
    Object minBatch = json.get("min_batch_size");
    Object maxBatch = json.get("max_batch_size");
    if (input != null) {
      if (!(input instanceof List) || ((List<Object>) input).isEmpty()) {
        throw violation("program.input must be a list of sample dimensions", json);
      }
      List<Object> dims = (List<Object>) input;
      info.sampleShape = new long[dims.size()];
      for (int i = 0; i < dims.size(); i++) {
        Object d = dims.get(i);
        if (!(d instanceof Long) || (Long) d < 1) {
          throw violation("program.input holds integers >= 1", json);
        }
        info.sampleShape[i] = (Long) d;
      }
    }
    if (maxBatch != null) {
      if (!(maxBatch instanceof Long) || (Long) maxBatch < 1 || (Long) maxBatch > 1 << 20) {
        throw violation("program.max_batch_size must be an integer >= 1", json);
      }
      info.maxBatchSize = (int) (long) (Long) maxBatch;
    }
    if (minBatch != null) {
      if (!(minBatch instanceof Long)
          || (Long) minBatch < 1
          || (info.maxBatchSize > 0 && (Long) minBatch > info.maxBatchSize)) {
        throw violation("program.min_batch_size must be an integer from 1 to max_batch_size", json);
      }
      info.minBatchSize = (int) (long) (Long) minBatch;
    }
    return info;
  }

  /**
   * Read {@code [{name, shape}, ...]} into {@code shapes}; returns the names in order.
   *
   * @throws GatewayException (protocol violation) for a bad entry or a name seen before
   */
  @SuppressWarnings("unchecked")
  private static List<String> readLayout(
      List<Object> entries, Map<String, int[]> shapes, String what, Object json)
      throws GatewayException {
    List<String> order = new ArrayList<String>();
    for (Object p : entries) {
      Object pname = p instanceof Map ? ((Map<String, Object>) p).get("name") : null;
      Object shape = p instanceof Map ? ((Map<String, Object>) p).get("shape") : null;
      if (!(pname instanceof String) || !(shape instanceof List)) {
        throw violation("each " + what + " needs a name and a shape", json);
      }
      List<Object> dims = (List<Object>) shape;
      int[] s = new int[dims.size()];
      for (int i = 0; i < s.length; i++) {
        Object d = dims.get(i);
        if (!(d instanceof Long) || (Long) d < 0 || (Long) d > Integer.MAX_VALUE) {
          throw violation(what + " shapes hold integers >= 0", json);
        }
        s[i] = (int) (long) (Long) d;
      }
      if (shapes.put((String) pname, s) != null) {
        throw violation(what + " " + pname + " appears twice", json);
      }
      order.add((String) pname);
    }
    return order;
  }

  private static GatewayException violation(String what, Object json) {
    return new GatewayException(
        GatewayException.PROTOCOL_VIOLATION, "bad task from gateway: " + what + ": " + json);
  }

  /**
   * Refuse arrays that are not exactly this program's parameters and state (names and shapes).
   *
   * @throws IllegalArgumentException starting "program:" and naming the arrays at fault
   */
  public void checkArrays(List<NamedArray> arrays) {
    List<String> problems = new ArrayList<String>();
    Map<String, int[]> seen = new HashMap<String, int[]>();
    for (NamedArray a : arrays) {
      seen.put(a.name(), a.shape());
      int[] want = parameters.get(a.name());
      if (want == null) {
        problems.add("unexpected " + a.name());
      } else if (!Arrays.equals(want, a.shape())) {
        problems.add(
            a.name() + " " + Arrays.toString(a.shape()) + " (program: " + Arrays.toString(want) + ")");
      }
    }
    for (String p : order) {
      if (!seen.containsKey(p)) {
        problems.add("missing " + p);
      }
    }
    for (String p : stateOrder) {
      if (!seen.containsKey(p)) {
        problems.add("missing " + p);
      }
    }
    if (!problems.isEmpty()) {
      throw new IllegalArgumentException(
          "program: the arrays do not match program '" + name + "': " + problems);
    }
  }

  /**
   * Refuse a runtime older than {@link #minRuntime()}.
   *
   * @param runtimeVersion this phone's ExecuTorch version, or null if it has none
   * @throws IllegalArgumentException starting "program:" saying what is needed
   */
  public void checkRuntime(String runtimeVersion) {
    if (runtimeVersion == null) {
      throw new IllegalArgumentException(
          "program: this phone has no ExecuTorch runtime to run program '" + name + "'");
    }
    if (compareVersions(runtimeVersion, minRuntime) < 0) {
      throw new IllegalArgumentException(
          "program: '"
              + name
              + "' needs ExecuTorch "
              + minRuntime
              + " or newer, this phone has "
              + runtimeVersion
              + "; update the app");
    }
  }

  /** Compare dotted versions number by number ("1.10" is newer than "1.9"); missing parts are 0. */
  public static int compareVersions(String a, String b) {
    if (!VERSION.matcher(a).matches() || !VERSION.matcher(b).matches()) {
      throw new IllegalArgumentException("versions are dotted numbers: '" + a + "', '" + b + "'");
    }
    String[] x = a.split("\\.");
    String[] y = b.split("\\.");
    for (int i = 0; i < Math.max(x.length, y.length); i++) {
      long u = i < x.length ? Long.parseLong(x[i]) : 0;
      long v = i < y.length ? Long.parseLong(y[i]) : 0;
      if (u != v) {
        return u < v ? -1 : 1;
      }
    }
    return 0;
  }

  public String name() {
    return name;
  }

  /** SHA-256 of the program's bytes: its identity and its cache key. */
  public String sha256() {
    return sha256;
  }

  public long bytes() {
    return bytes;
  }

  public String minRuntime() {
    return minRuntime;
  }

  /** Path under the gateway root, {@code /v1/program/<sha256>}. */
  public String path() {
    return path;
  }

  /** Parameter names in the program's own order. */
  public List<String> parameterNames() {
    return order;
  }

  /**
   * Names of the arrays the training method carries from step to step (its inputs and outputs
   * after the batch), in the program's order; empty for most programs.
   */
  public List<String> stateNames() {
    return stateOrder;
  }

  /** Shape of parameter or state array {@code name}, or null if the program has none such. */
  public int[] shapeOf(String name) {
    int[] s = parameters.get(name);
    return s == null ? null : s.clone();
  }

  /** The evaluation method (no backward pass), or null for a program exported without one. */
  public String evaluateMethod() {
    return evaluateMethod;
  }

  /** Smallest training batch the program takes (2 when it trains batch norm), default 1. */
  public int minBatchSize() {
    return minBatchSize;
  }

  /** Shape of one input sample the program takes (e.g. [3, 32, 32]), or null if not given. */
  public long[] sampleShape() {
    return sampleShape == null ? null : sampleShape.clone();
  }

  /** Largest batch the program accepts, or 0 if not given. */
  public int maxBatchSize() {
    return maxBatchSize;
  }
}
