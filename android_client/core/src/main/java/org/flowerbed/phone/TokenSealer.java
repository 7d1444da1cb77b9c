package org.flowerbed.phone;

import java.nio.charset.StandardCharsets;
import java.security.GeneralSecurityException;
import java.security.SecureRandom;
import java.util.Base64;
import javax.crypto.Cipher;
import javax.crypto.SecretKey;
import javax.crypto.spec.GCMParameterSpec;

/**
 * Seals the phone's bearer token for storage: AES-256-GCM (NIST SP 800-38D) under a key the
 * caller holds, with the phone name as associated data, so a sealed token copied to another
 * phone's preferences or name does not open. On Android the key lives in the Android Keystore
 * (hardware-backed where available) and never leaves it; the app stores only {@link #seal}'s text
 * in its preferences.
 *
 * <p>Format: {@code v1:<base64 12-byte IV>:<base64 ciphertext and 16-byte tag>}.
 */
public final class TokenSealer {
  private static final String PREFIX = "v1:";
  private static final int IV_BYTES = 12;
  private static final int TAG_BITS = 128;

  private final SecretKey key;
  private final SecureRandom random;

  public TokenSealer(SecretKey key) {
    this(key, new SecureRandom());
  }

  TokenSealer(SecretKey key, SecureRandom random) {
    this.key = key;
    this.random = random;
  }

  /** The token sealed for {@code phone}: a fresh IV each time. */
  public String seal(String token, String phone) throws GeneralSecurityException {
    byte[] iv = new byte[IV_BYTES];
    random.nextBytes(iv);
    Cipher c = Cipher.getInstance("AES/GCM/NoPadding");
    c.init(Cipher.ENCRYPT_MODE, key, new GCMParameterSpec(TAG_BITS, iv));
    c.updateAAD(phone.getBytes(StandardCharsets.UTF_8));
    byte[] sealed = c.doFinal(token.getBytes(StandardCharsets.UTF_8));
    Base64.Encoder b64 = Base64.getEncoder();
    return PREFIX + b64.encodeToString(iv) + ":" + b64.encodeToString(sealed);
  }

  /**
   * The token sealed for {@code phone}.
   *
   * @throws GeneralSecurityException if the text was altered, sealed for another phone or under
   *     another key (the phone must then be enrolled again)
   * @throws IllegalArgumentException if the text is not in the sealed format
   */
  public String open(String sealedText, String phone) throws GeneralSecurityException {
    if (sealedText == null || !sealedText.startsWith(PREFIX)) {
      throw new IllegalArgumentException("not a sealed token (expected v1:...)");
    }
    String[] parts = sealedText.substring(PREFIX.length()).split(":", -1);
    if (parts.length != 2) {
      throw new IllegalArgumentException("a sealed token is v1:<iv>:<ciphertext>");
    }
    Base64.Decoder b64 = Base64.getDecoder();
    byte[] iv = b64.decode(parts[0]);
    if (iv.length != IV_BYTES) {
      throw new IllegalArgumentException("a sealed token's IV is " + IV_BYTES + " bytes");
    }
    Cipher c = Cipher.getInstance("AES/GCM/NoPadding");
    c.init(Cipher.DECRYPT_MODE, key, new GCMParameterSpec(TAG_BITS, iv));
    c.updateAAD(phone.getBytes(StandardCharsets.UTF_8));
    return new String(c.doFinal(b64.decode(parts[1])), StandardCharsets.UTF_8);
  }
}
