package org.flowerbed.phone;

import static org.junit.Assert.assertEquals;
import static org.junit.Assert.assertNull;
import static org.junit.Assert.fail;

import java.io.ByteArrayInputStream;
import java.nio.charset.StandardCharsets;
import java.security.cert.CertificateException;
import java.security.cert.CertificateFactory;
import java.security.cert.X509Certificate;
import javax.net.ssl.X509TrustManager;
import org.junit.Test;

/** Enrolment URIs (as `flowerbed bridge enroll` prints them) and certificate pins. */
public class EnrolmentTest {
  /** Two self-signed P-256 certificates; pins computed with Python's cryptography package. */
  static final String CERT_A =
      "-----BEGIN CERTIFICATE-----\n"
          + "MIIBFDCBu6ADAgECAgEBMAoGCCqGSM49BAMCMBQxEjAQBgNVBAMMCWdhdGV3YXkt\n"
          + "YTAeFw0yNjAxMDEwMDAwMDBaFw0zNTEyMzAwMDAwMDBaMBQxEjAQBgNVBAMMCWdh\n"
          + "dGV3YXktYTBZMBMGByqGSM49AgEGCCqGSM49AwEHA0IABMJVlzhl9FlHA+DlQ3+F\n"
          + "vSL7r4stbvVTjH80T5xSN/cUR7XLDFPUrNYXyQV4e8WIMwnOXPw+Q1P4SB4HHM/G\n"
          + "TzgwCgYIKoZIzj0EAwIDSAAwRQIgTuS0KnSAjcMbQKhUlJrls+pI+YRGcy5qzPcs\n"
          + "2vJlvOYCIQCu7qXTNON1WiTswgKZN9nLvm3kdAfQiLsrCT0i8Q9ajg==\n"
          + "-----END CERTIFICATE-----\n";

  static final String PIN_A = "sha256/iz2dgVNk8GbaBhbXwIBB1kOUTEMvCUiFs3yuEIjTSwk=";

  static final String CERT_B =
      "-----BEGIN CERTIFICATE-----\n"
          + "MIIBFTCBu6ADAgECAgEBMAoGCCqGSM49BAMCMBQxEjAQBgNVBAMMCWdhdGV3YXkt\n"
          + "YjAeFw0yNjAxMDEwMDAwMDBaFw0zNTEyMzAwMDAwMDBaMBQxEjAQBgNVBAMMCWdh\n"
          + "dGV3YXktYjBZMBMGByqGSM49AgEGCCqGSM49AwEHA0IABFJUGRn5gKGZ7WTP7fwF\n"
          + "l+ninsl6D0zVaL0jjWT+66m2/ePLNuYv0SuboII3WUi2C80WnN5e8QaKnh4+C7hd\n"
          + "KJ8wCgYIKoZIzj0EAwIDSQAwRgIhAKcir7lIxjw7nte7qTuE4wUZQbFujTtD9vz9\n"
          + "tvwKwQtdAiEArpEValRl4gJUYlsRLRhcb2cSNocvzjYYWEkZkNh+PmI=\n"
          + "-----END CERTIFICATE-----\n";

  static X509Certificate cert(String pem) throws CertificateException {
    return (X509Certificate)
        CertificateFactory.getInstance("X.509")
            .generateCertificate(new ByteArrayInputStream(pem.getBytes(StandardCharsets.US_ASCII)));
  }

  private static final String URI =
      "flowerbed://enroll?v=1&gateway=https%3A%2F%2F10.0.0.5%3A8470&phone=pixel-7"
          + "&token=FY_2ibcLdbKLLz3qEJk3Yw7euYXYMWERLdtiJj0ebTE"
          + "&pin=sha256%2Fiz2dgVNk8GbaBhbXwIBB1kOUTEMvCUiFs3yuEIjTSwk%3D";

  @Test
  public void theUriGivesGatewayPhoneTokenAndPin() {
    EnrolmentUri e = EnrolmentUri.parse(URI, false);
    assertEquals("https://10.0.0.5:8470", e.gateway);
    assertEquals("pixel-7", e.phone);
    assertEquals("FY_2ibcLdbKLLz3qEJk3Yw7euYXYMWERLdtiJj0ebTE", e.token);
    assertEquals(PIN_A, e.pin);
  }

  @Test
  public void aUriWithoutPinHasNone() {
    String plain = "flowerbed://enroll?v=1&gateway=http%3A%2F%2F192.168.1.5%3A8470&phone=a"
        + "&token=0123456789abcdefXYZ";
    assertNull(EnrolmentUri.parse(plain, true).pin);
  }

  @Test
  public void badUrisAreRefusedNamingTheField() {
    String[][] cases = {
      {"https://example.com", "starts with flowerbed://enroll?"},
      {URI.replace("v=1", "v=2"), "version 2 is not supported"},
      {URI.replace("&phone=pixel-7", ""), "has no phone"},
      {URI.replace("phone=pixel-7", "phone=pixel%207"), "phone name 'pixel 7'"},
      {URI.replace("token=FY_2", "token=F%20Y"), "token is not"},
      {URI.replace("%3D", ""), "a certificate pin is sha256/"},
      {URI.replace("https%3A", "ftp%3A"), "gateway must be http(s)"},
      {URI.replace("https%3A", "http%3A"), "plain HTTP"},
      {URI + "&phone=again", "appears twice"},
    };
    for (String[] c : cases) {
      try {
        EnrolmentUri.parse(c[0], false);
        fail("accepted " + c[0]);
      } catch (IllegalArgumentException e) {
        if (!e.getMessage().contains(c[1])) {
          throw new AssertionError("'" + e.getMessage() + "' lacks '" + c[1] + "'", e);
        }
      }
    }
  }

  @Test
  public void aPinNeedsHttpsEvenWhenCleartextIsAllowed() {
    try {
      EnrolmentUri.parse(URI.replace("https%3A", "http%3A"), true);
      fail("accepted a pin for plain HTTP");
    } catch (IllegalArgumentException e) {
      assertEquals("a pin needs an https:// gateway", e.getMessage());
    }
  }

  @Test
  public void thePinIsTheSha256OfTheCertificatesPublicKey() throws Exception {
    assertEquals(PIN_A, CertificatePin.of(cert(CERT_A)));
    assertEquals(
        "sha256/cwLxDGPLcLmV6AHvAVAPTWDD9I3p2F9yfXVtCxRinT8=", CertificatePin.of(cert(CERT_B)));
  }

  @Test
  public void thePinnedTrustManagerAcceptsOnlyThePinnedKey() throws Exception {
    X509TrustManager tm = CertificatePin.trustManager(PIN_A);
    tm.checkServerTrusted(new X509Certificate[] {cert(CERT_A)}, "ECDHE_ECDSA");
    try {
      tm.checkServerTrusted(new X509Certificate[] {cert(CERT_B)}, "ECDHE_ECDSA");
      fail("trusted another key");
    } catch (CertificateException e) {
      assertEquals(
          "gateway certificate key sha256/cwLxDGPLcLmV6AHvAVAPTWDD9I3p2F9yfXVtCxRinT8= is not the"
              + " enrolled "
              + PIN_A,
          e.getMessage());
    }
  }

  @Test
  public void aPinForAPlainHttpGatewayIsRefused() {
    try {
      new GatewayClient("http://127.0.0.1:8470", "tok").pinCertificate(PIN_A);
      fail("pinned a plain-HTTP gateway");
    } catch (IllegalArgumentException e) {
      assertEquals("a certificate pin needs an https:// gateway URL", e.getMessage());
    }
  }
}
