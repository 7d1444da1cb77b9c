package org.flowerbed.phone;

import static org.junit.Assert.assertEquals;
import static org.junit.Assert.assertNotEquals;
import static org.junit.Assert.assertTrue;
import static org.junit.Assert.fail;

import java.security.GeneralSecurityException;
import javax.crypto.KeyGenerator;
import javax.crypto.SecretKey;
import javax.crypto.spec.SecretKeySpec;
import org.junit.Test;

/** The token at rest: AES-GCM sealed, bound to the phone name (the app's key is in the Keystore). */
public class TokenSealerTest {
  private static SecretKey key() throws GeneralSecurityException {
    KeyGenerator g = KeyGenerator.getInstance("AES");
    g.init(256);
    return g.generateKey();
  }

  @Test
  public void aSealedTokenOpensForItsPhoneAndNeverRepeatsItsText() throws Exception {
    TokenSealer s = new TokenSealer(key());
    String a = s.seal("FY_2ibcLdbKLLz3qEJk3Yw7euYXYMWERLdtiJj0ebTE", "pixel-7");
    String b = s.seal("FY_2ibcLdbKLLz3qEJk3Yw7euYXYMWERLdtiJj0ebTE", "pixel-7");
    assertTrue(a, a.startsWith("v1:"));
    assertNotEquals("a fresh IV every time", a, b);
    assertEquals("FY_2ibcLdbKLLz3qEJk3Yw7euYXYMWERLdtiJj0ebTE", s.open(a, "pixel-7"));
    assertTrue("no token text at rest", !a.contains("FY_2ib"));
  }

  @Test
  public void anAllZeroKeyAndIvGiveTheKnownCiphertextLength() throws Exception {
    // 12-byte IV -> 16 base64 chars; 5-byte token + 16-byte tag = 21 bytes -> 28 chars.
    SecretKey zero = new SecretKeySpec(new byte[32], "AES");
    String sealed =
        new TokenSealer(zero, new java.security.SecureRandom() {
          private static final long serialVersionUID = 1L;

          @Override
          public void nextBytes(byte[] bytes) {
            java.util.Arrays.fill(bytes, (byte) 0);
          }
        }).seal("abcde", "p");
    assertEquals("v1:AAAAAAAAAAAAAAAA:".length() + 28, sealed.length());
    assertTrue(sealed, sealed.startsWith("v1:AAAAAAAAAAAAAAAA:"));
  }

  @Test
  public void anotherPhoneAnotherKeyOrAlteredTextDoNotOpen() throws Exception {
    SecretKey k = key();
    String sealed = new TokenSealer(k).seal("token-0123456789abcdef", "pixel-7");
    String[] bad = {"a52", null, null};
    for (int i = 0; i < 3; i++) {
      try {
        if (i == 0) {
          new TokenSealer(k).open(sealed, "a52");
        } else if (i == 1) {
          new TokenSealer(key()).open(sealed, "pixel-7");
        } else {
          char last = sealed.charAt(sealed.length() - 3);
          String altered =
              sealed.substring(0, sealed.length() - 3)
                  + (last == 'A' ? 'B' : 'A')
                  + sealed.substring(sealed.length() - 2);
          new TokenSealer(k).open(altered, "pixel-7");
        }
        fail("opened case " + i + " " + bad[0]);
      } catch (GeneralSecurityException e) {
        // expected: GCM's tag check fails
      }
    }
  }

  @Test
  public void textThatIsNotASealedTokenIsRefusedWithTheFormat() throws Exception {
    try {
      new TokenSealer(key()).open("plain-token", "p");
      fail("opened plain text");
    } catch (IllegalArgumentException e) {
      assertEquals("not a sealed token (expected v1:...)", e.getMessage());
    }
  }
}
