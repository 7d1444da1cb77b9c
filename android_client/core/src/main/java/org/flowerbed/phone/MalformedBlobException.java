package org.flowerbed.phone;

/** A tensor blob that breaks the FBT1 encoding of PROTOCOL.md; the message says where. */
public final class MalformedBlobException extends Exception {
  private static final long serialVersionUID = 1L;

  public MalformedBlobException(String message) {
    super(message);
  }
}
