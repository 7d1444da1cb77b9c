package org.flowerbed.phone;

import java.io.IOException;

/**
 * The gateway answered with an error status ({@link #status()} is the HTTP code and the message its
 * {@code {"error": ...}} reason), or broke the protocol ({@link #PROTOCOL_VIOLATION}). Unlike a
 * network error, retrying the same request will not help.
 */
public final class GatewayException extends IOException {
  private static final long serialVersionUID = 1L;

  /** Status used when the gateway's answer does not follow PROTOCOL.md. */
  public static final int PROTOCOL_VIOLATION = -1;

  /**
   * Status used when the gateway's TLS certificate is not trusted (not the pinned key, or not
   * signed by a trusted CA): a wrong gateway or a man in the middle, never worth retrying.
   */
  public static final int CERTIFICATE_REFUSED = -2;

  private final int status;

  public GatewayException(int status, String message) {
    super(message);
    this.status = status;
  }

  /** HTTP status, or {@link #PROTOCOL_VIOLATION}. */
  public int status() {
    return status;
  }
}
