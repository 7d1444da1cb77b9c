package org.flowerbed.phone;

import java.security.GeneralSecurityException;
import java.security.MessageDigest;
import java.security.NoSuchAlgorithmException;
import java.security.SecureRandom;
import java.security.cert.CertificateException;
import java.security.cert.X509Certificate;
import java.util.Base64;
import java.util.regex.Pattern;
import javax.net.ssl.SSLContext;
import javax.net.ssl.SSLSocketFactory;
import javax.net.ssl.TrustManager;
import javax.net.ssl.X509TrustManager;

/**
 * Public-key pinning (RFC 7469, section 2.4 pin format): trust a gateway whose certificate's
 * SubjectPublicKeyInfo hashes to the pin from the enrolment URI, whoever signed it. A self-signed
 * gateway certificate then works without installing it on the phone, and no other certificate
 * does, even one a public CA issued for the same name. Host names are still checked by the HTTPS
 * connection as usual.
 */
public final class CertificatePin {
  private static final Pattern FORMAT = Pattern.compile("sha256/[A-Za-z0-9+/]{43}=");

  private CertificatePin() {}

  /**
   * {@code pin} if it is {@code sha256/} and the 44-character base64 of a SHA-256 digest.
   *
   * @throws IllegalArgumentException otherwise
   */
  public static String check(String pin) {
    if (pin == null || !FORMAT.matcher(pin).matches()) {
      throw new IllegalArgumentException(
          "a certificate pin is sha256/<44 base64 characters>, got '" + pin + "'");
    }
    return pin;
  }

  /** {@code sha256/<base64>} of the certificate's SubjectPublicKeyInfo (its encoded public key). */
  public static String of(X509Certificate cert) {
    try {
      byte[] digest = MessageDigest.getInstance("SHA-256").digest(cert.getPublicKey().getEncoded());
      return "sha256/" + Base64.getEncoder().encodeToString(digest);
    } catch (NoSuchAlgorithmException e) {
      throw new IllegalStateException("every Java platform has SHA-256", e);
    }
  }

  /** A trust manager that accepts exactly the server certificates whose key has {@code pin}. */
  public static X509TrustManager trustManager(final String pin) {
    return new X509TrustManager() {
      @Override
      public void checkClientTrusted(X509Certificate[] chain, String authType)
          throws CertificateException {
        throw new CertificateException("a phone does not accept client connections");
      }

      @Override
      public void checkServerTrusted(X509Certificate[] chain, String authType)
          throws CertificateException {
        if (chain == null || chain.length == 0) {
          throw new CertificateException("the gateway sent no certificate");
        }
        chain[0].checkValidity();
        String got = of(chain[0]);
        if (!got.equals(pin)) {
          throw new CertificateException(
              "gateway certificate key " + got + " is not the enrolled " + pin);
        }
      }

      @Override
      public X509Certificate[] getAcceptedIssuers() {
        return new X509Certificate[0];
      }
    };
  }

  /** A socket factory for HTTPS connections that trust only {@code pin}. */
  public static SSLSocketFactory socketFactory(String pin) {
    check(pin);
    try {
      SSLContext context = SSLContext.getInstance("TLS");
      context.init(null, new TrustManager[] {trustManager(pin)}, new SecureRandom());
      return context.getSocketFactory();
    } catch (GeneralSecurityException e) {
      throw new IllegalStateException("TLS is unavailable: " + e.getMessage(), e);
    }
  }
}
