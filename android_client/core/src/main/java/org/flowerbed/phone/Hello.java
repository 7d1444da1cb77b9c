package org.flowerbed.phone;

import java.math.BigInteger;
import java.util.Map;

/** The gateway's answer to {@code POST /v1/hello}: who this phone is and the limits to keep. */
public final class Hello {
  /**
   * The Flower node id this phone is, the same after every reconnect with the same token. Node ids
   * are uint64: this is their bit pattern (negative above 2^63-1); print {@link #nodeIdText()}.
   */
  public final long nodeId;

  public final String phone;

  /** Suggested seconds between polls when the gateway has no work. */
  public final int pollS;

  public final long maxUploadBytes;

  /** Largest upload chunk the gateway accepts. */
  public final int chunkBytes;

  /** The protocol revision agreed with the gateway. */
  public final int protocol;

  public Hello(long nodeId, String phone, int pollS, long maxUploadBytes, int chunkBytes) {
    this(nodeId, phone, pollS, maxUploadBytes, chunkBytes, 1);
  }

  public Hello(
      long nodeId, String phone, int pollS, long maxUploadBytes, int chunkBytes, int protocol) {
    this.nodeId = nodeId;
    this.phone = phone;
    this.pollS = pollS;
    this.maxUploadBytes = maxUploadBytes;
    this.chunkBytes = chunkBytes;
    this.protocol = protocol;
  }

  /**
   * @throws GatewayException (protocol violation) naming the missing or ill-typed field
   */
  public static Hello fromJson(Map<String, Object> json) throws GatewayException {
    // Revision 1 gateways name no revision: they speak 1.
    long protocol = json.containsKey("protocol") ? integer(json, "protocol", 1) : 1;
    if (!GatewayClient.speaks(protocol)) {
      throw new GatewayException(
          GatewayException.PROTOCOL_VIOLATION,
          "bad hello from gateway: it chose protocol " + protocol + ", which this app never offered");
    }
    return new Hello(
        uint64(json, "node_id"),
        string(json, "phone"),
        (int) integer(json, "poll_s", 0),
        integer(json, "max_upload_bytes", 1),
        (int) Math.min(Integer.MAX_VALUE, integer(json, "chunk_bytes", 1)),
        (int) protocol);
  }

  /** A uint64 (Flower's node id type) as the bits of a long; see {@link #nodeIdText()}. */
  private static long uint64(Map<String, Object> json, String key) throws GatewayException {
    Object v = json.get(key);
    if (v instanceof Long && (Long) v >= 0) {
      return (Long) v;
    }
    if (v instanceof BigInteger
        && ((BigInteger) v).signum() >= 0
        && ((BigInteger) v).bitLength() <= 64) {
      return ((BigInteger) v).longValue();
    }
    throw new GatewayException(
        GatewayException.PROTOCOL_VIOLATION,
        "bad hello from gateway: " + key + " must be an integer in [0, 2^64): " + json);
  }

  private static long integer(Map<String, Object> json, String key, long min)
      throws GatewayException {
    Object v = json.get(key);
    if (!(v instanceof Long) || (Long) v < min) {
      throw new GatewayException(
          GatewayException.PROTOCOL_VIOLATION,
          "bad hello from gateway: " + key + " must be an integer >= " + min + ": " + json);
    }
    return (Long) v;
  }

  private static String string(Map<String, Object> json, String key) throws GatewayException {
    Object v = json.get(key);
    if (!(v instanceof String)) {
      throw new GatewayException(
          GatewayException.PROTOCOL_VIOLATION,
          "bad hello from gateway: " + key + " must be a string: " + json);
    }
    return (String) v;
  }

  /** The node id in decimal, as Flower prints it. */
  public String nodeIdText() {
    return Long.toUnsignedString(nodeId);
  }
}
