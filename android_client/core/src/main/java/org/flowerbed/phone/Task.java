package org.flowerbed.phone;

import java.util.Collections;
import java.util.Map;

/** A unit of work from {@code GET /v1/task}: train or evaluate the arrays it points to. */
public final class Task {
  /** Task types of protocol version 1. */
  public static final String TRAIN = "train";

  public static final String EVALUATE = "evaluate";

  public final String id;

  /** {@link #TRAIN} or {@link #EVALUATE}. */
  public final String type;

  /** The Flower ConfigRecord, keys as on the wire ({@code local-steps}, {@code lr}, ...). */
  public final Map<String, Object> config;

  public final long arraysBytes;
  public final double expiresInS;

  /** The training program the task must run with (protocol revision 2), or null. */
  public final ProgramInfo program;

  public Task(
      String id, String type, Map<String, Object> config, long arraysBytes, double expiresInS) {
    this(id, type, config, arraysBytes, expiresInS, null);
  }

  public Task(
      String id,
      String type,
      Map<String, Object> config,
      long arraysBytes,
      double expiresInS,
      ProgramInfo program) {
    this.id = id;
    this.type = type;
    this.config = Collections.unmodifiableMap(config);
    this.arraysBytes = arraysBytes;
    this.expiresInS = expiresInS;
    this.program = program;
  }

  /**
   * Read a task from its JSON answer.
   *
   * @throws GatewayException (protocol violation) naming the missing or ill-typed field
   */
  @SuppressWarnings("unchecked")
  public static Task fromJson(Map<String, Object> json) throws GatewayException {
    Object id = json.get("task_id");
    Object type = json.get("type");
    Object config = json.get("config");
    Object bytes = json.get("arrays_bytes");
    Object expires = json.get("expires_in_s");
    if (!(id instanceof String) || ((String) id).isEmpty()) {
      throw violation("task_id must be a non-empty string", json);
    }
    if (!TRAIN.equals(type) && !EVALUATE.equals(type)) {
      throw violation("type must be \"train\" or \"evaluate\"", json);
    }
    if (!(config instanceof Map)) {
      throw violation("config must be an object", json);
    }
    if (!(bytes instanceof Long) || (Long) bytes < 0) {
      throw violation("arrays_bytes must be an integer >= 0", json);
    }
    if (!(expires instanceof Number)) {
      throw violation("expires_in_s must be a number", json);
    }
    Object program = json.get("program");
    return new Task(
        (String) id,
        (String) type,
        (Map<String, Object>) config,
        (Long) bytes,
        ((Number) expires).doubleValue(),
        program == null ? null : ProgramInfo.fromJson(program));
  }

  private static GatewayException violation(String what, Map<String, Object> json) {
    return new GatewayException(
        GatewayException.PROTOCOL_VIOLATION, "bad task from gateway: " + what + ": " + json);
  }

  public boolean isTrain() {
    return TRAIN.equals(type);
  }

  @Override
  public String toString() {
    return type + " task " + id;
  }
}
