package org.flowerbed.phone;

import java.io.UnsupportedEncodingException;
import java.net.URI;
import java.net.URISyntaxException;
import java.net.URLDecoder;
import java.util.LinkedHashMap;
import java.util.Map;
import java.util.regex.Pattern;

/**
 * What {@code flowerbed bridge enroll} prints and the app scans: {@code
 * flowerbed://enroll?v=1&gateway=<url>&phone=<name>&token=<token>[&pin=sha256/<base64>]}.
 *
 * <p>Parsing is strict: every field is checked, unknown versions are refused, and a plain-HTTP
 * gateway is accepted only when the caller allows cleartext to that host (a lab network), since
 * the token travels in every request.
 */
public final class EnrolmentUri {
  private static final Pattern NAME = Pattern.compile("[A-Za-z0-9._-]{1,64}");
  private static final Pattern TOKEN = Pattern.compile("[A-Za-z0-9._~+/=-]{16,512}");

  /** Gateway root URL, e.g. {@code https://gateway.lan:8470}. */
  public final String gateway;

  public final String phone;

  /** The bearer token: store it in Keystore-backed storage, never in plain preferences. */
  public final String token;

  /** The gateway certificate's public-key pin ({@code sha256/<base64>}), or null. */
  public final String pin;

  private EnrolmentUri(String gateway, String phone, String token, String pin) {
    this.gateway = gateway;
    this.phone = phone;
    this.token = token;
    this.pin = pin;
  }

  /**
   * Parse and check an enrolment URI.
   *
   * @param allowCleartext whether an {@code http://} gateway is acceptable
   * @throws IllegalArgumentException naming the field at fault
   */
  public static EnrolmentUri parse(String text, boolean allowCleartext) {
    URI uri;
    try {
      uri = new URI(text.trim());
    } catch (URISyntaxException e) {
      throw new IllegalArgumentException("not an enrolment URI: " + e.getMessage());
    }
    if (!"flowerbed".equals(uri.getScheme()) || !"enroll".equals(uri.getHost())) {
      throw new IllegalArgumentException(
          "an enrolment URI starts with flowerbed://enroll?, got '" + uri.getScheme() + "://...'");
    }
    Map<String, String> q = query(uri.getRawQuery());
    if (!"1".equals(q.get("v"))) {
      throw new IllegalArgumentException(
          "enrolment URI version " + q.get("v") + " is not supported (this app reads v=1)");
    }
    String gateway = required(q, "gateway");
    URI g;
    try {
      g = new URI(gateway);
    } catch (URISyntaxException e) {
      throw new IllegalArgumentException("gateway is not a URL: " + gateway);
    }
    if (g.getHost() == null || !("https".equals(g.getScheme()) || "http".equals(g.getScheme()))) {
      throw new IllegalArgumentException("gateway must be http(s)://host[:port], got " + gateway);
    }
    if ("http".equals(g.getScheme()) && !allowCleartext) {
      throw new IllegalArgumentException(
          "gateway " + gateway + " is plain HTTP: tokens would travel in the clear; use HTTPS");
    }
    String phone = required(q, "phone");
    if (!NAME.matcher(phone).matches()) {
      throw new IllegalArgumentException("phone name '" + phone + "' is not A-Z a-z 0-9 . _ -");
    }
    String token = required(q, "token");
    if (!TOKEN.matcher(token).matches()) {
      throw new IllegalArgumentException("token is not 16-512 URL-safe characters");
    }
    String pin = q.get("pin");
    if (pin != null) {
      CertificatePin.check(pin);
      if (!"https".equals(g.getScheme())) {
        throw new IllegalArgumentException("a pin needs an https:// gateway");
      }
    }
    return new EnrolmentUri(gateway, phone, token, pin);
  }

  private static Map<String, String> query(String raw) {
    Map<String, String> out = new LinkedHashMap<String, String>();
    if (raw == null) {
      return out;
    }
    for (String pair : raw.split("&")) {
      int eq = pair.indexOf('=');
      if (eq <= 0) {
        throw new IllegalArgumentException("malformed query part '" + pair + "'");
      }
      String key = decode(pair.substring(0, eq));
      if (out.put(key, decode(pair.substring(eq + 1))) != null) {
        throw new IllegalArgumentException("field " + key + " appears twice");
      }
    }
    return out;
  }

  private static String decode(String s) {
    try {
      // URLDecoder turns '+' into a space; the URI percent-encodes a literal '+'.
      return URLDecoder.decode(s.replace("+", "%2B"), "UTF-8");
    } catch (UnsupportedEncodingException e) {
      throw new IllegalStateException("UTF-8 is always supported", e);
    }
  }

  private static String required(Map<String, String> q, String key) {
    String v = q.get(key);
    if (v == null || v.isEmpty()) {
      throw new IllegalArgumentException("enrolment URI has no " + key);
    }
    return v;
  }
}
