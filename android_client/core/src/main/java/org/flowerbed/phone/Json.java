package org.flowerbed.phone;

import java.math.BigInteger;
import java.util.ArrayList;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;

/**
 * The little JSON the phone protocol needs, without a library (Android and a plain JVM share no
 * JSON API). Objects parse to {@code LinkedHashMap<String, Object>}, arrays to {@code
 * List<Object>}, integers without fraction or exponent to {@code Long} (or {@code BigInteger}
 * beyond its range), other numbers to {@code Double}, and {@code true}/{@code false}/{@code null}
 * to Boolean and null.
 */
public final class Json {
  /** The characters a JSON string may escape with a letter: quote, backslash, slash, b f n r t. */
  private static final String ESCAPED = "\"\\/\b\f\n\r\t";

  /** The letter after the backslash for each character of {@link #ESCAPED}. */
  private static final String ESCAPE_LETTERS = "\"\\/bfnrt";

  /**
   * The characters this writer escapes with a letter; it writes other control characters as a
   * {@code \\u} escape and the slash as itself.
   */
  private static final String WRITTEN = "\"\\\n\r\t";

  /** The letter after the backslash for each character of {@link #WRITTEN}. */
  private static final String WRITTEN_LETTERS = "\"\\nrt";

  private final String text;
  private int pos;

  private Json(String text) {
    this.text = text;
  }

  /**
   * Parse one JSON value that fills the whole text (surrounding whitespace allowed).
   *
   * @throws IllegalArgumentException naming the offset of the first syntax error
   */
  public static Object parse(String text) {
    Json p = new Json(text);
    p.skipSpace();
    Object value = p.value();
    p.skipSpace();
    if (p.pos != text.length()) {
      throw p.error("unexpected text after the JSON value");
    }
    return value;
  }

  /**
   * Parse a JSON object.
   *
   * @throws IllegalArgumentException if the text is not valid JSON or not an object
   */
  @SuppressWarnings("unchecked")
  public static Map<String, Object> parseObject(String text) {
    Object value = parse(text);
    if (!(value instanceof Map)) {
      throw new IllegalArgumentException("expected a JSON object, got: " + abbreviate(text));
    }
    return (Map<String, Object>) value;
  }

  /**
   * Serialise maps, lists, strings, numbers, booleans and null.
   *
   * @throws IllegalArgumentException for other types and for NaN or infinite numbers, which JSON
   *     cannot carry
   */
  public static String write(Object value) {
    StringBuilder out = new StringBuilder();
    write(value, out);
    return out.toString();
  }

  private static void write(Object value, StringBuilder out) {
    if (value == null) {
      out.append("null");
    } else if (value instanceof String) {
      quote((String) value, out);
    } else if (value instanceof Double || value instanceof Float) {
      double d = ((Number) value).doubleValue();
      if (Double.isNaN(d) || Double.isInfinite(d)) {
        throw new IllegalArgumentException("JSON cannot carry the number " + d);
      }
      out.append(d);
    } else if (value instanceof Number || value instanceof Boolean) {
      out.append(value);
    } else if (value instanceof Map) {
      out.append('{');
      boolean first = true;
      for (Map.Entry<?, ?> e : ((Map<?, ?>) value).entrySet()) {
        if (!first) {
          out.append(',');
        }
        first = false;
        quote(String.valueOf(e.getKey()), out);
        out.append(':');
        write(e.getValue(), out);
      }
      out.append('}');
    } else if (value instanceof List) {
      out.append('[');
      boolean first = true;
      for (Object item : (List<?>) value) {
        if (!first) {
          out.append(',');
        }
        first = false;
        write(item, out);
      }
      out.append(']');
    } else {
      throw new IllegalArgumentException(
          "cannot write a " + value.getClass().getName() + " as JSON");
    }
  }

  private static void quote(String s, StringBuilder out) {
    out.append('"');
    for (int i = 0; i < s.length(); i++) {
      char c = s.charAt(i);
      int k = WRITTEN.indexOf(c);
      if (k >= 0) {
        out.append('\\').append(WRITTEN_LETTERS.charAt(k));
      } else if (c < 0x20) {
        out.append(String.format("\\u%04x", (int) c));
      } else {
        out.append(c);
      }
    }
    out.append('"');
  }

  private Object value() {
    if (pos >= text.length()) {
      throw error("unexpected end of text");
    }
    char c = text.charAt(pos);
    switch (c) {
      case '{':
        return object();
      case '[':
        return array();
      case '"':
        return string();
      case 't':
        return literal("true", Boolean.TRUE);
      case 'f':
        return literal("false", Boolean.FALSE);
      case 'n':
        return literal("null", null);
      default:
        if (c == '-' || (c >= '0' && c <= '9')) {
          return number();
        }
        throw error("unexpected character '" + c + "'");
    }
  }

  private Map<String, Object> object() {
    Map<String, Object> map = new LinkedHashMap<String, Object>();
    if (isEmpty('}')) {
      return map;
    }
    while (true) {
      skipSpace();
      if (peek() != '"') {
        throw error("expected a string key");
      }
      String key = string();
      skipSpace();
      expect(':');
      skipSpace();
      map.put(key, value());
      if (atEnd('}')) {
        return map;
      }
    }
  }

  private List<Object> array() {
    List<Object> list = new ArrayList<Object>();
    if (isEmpty(']')) {
      return list;
    }
    while (true) {
      skipSpace();
      list.add(value());
      if (atEnd(']')) {
        return list;
      }
    }
  }

  private String string() {
    StringBuilder sb = new StringBuilder();
    pos++;
    while (true) {
      if (pos >= text.length()) {
        throw error("unterminated string");
      }
      char c = text.charAt(pos++);
      if (c == '"') {
        return sb.toString();
      }
      if (c < 0x20) {
        pos--;
        throw error("control character in string");
      }
      if (c != '\\') {
        sb.append(c);
        continue;
      }
      if (pos >= text.length()) {
        throw error("unterminated escape");
      }
      char e = text.charAt(pos++);
      int k = ESCAPE_LETTERS.indexOf(e);
      if (k >= 0) {
        sb.append(ESCAPED.charAt(k));
      } else if (e == 'u') {
        if (pos + 4 > text.length()) {
          throw error("short \\u escape");
        }
        try {
          sb.append((char) Integer.parseInt(text.substring(pos, pos + 4), 16));
        } catch (NumberFormatException ex) {
          throw error("bad \\u escape");
        }
        pos += 4;
      } else {
        pos--;
        throw error("unknown escape '\\" + e + "'");
      }
    }
  }

  /** Step over the opening bracket or brace; true if {@code close} follows (and read it too). */
  private boolean isEmpty(char close) {
    pos++;
    skipSpace();
    if (peek() == close) {
      pos++;
      return true;
    }
    return false;
  }

  /**
   * Read the comma or {@code close} after an item of an object or array: true at {@code close}.
   */
  private boolean atEnd(char close) {
    skipSpace();
    char c = peek();
    pos++;
    if (c == close) {
      return true;
    }
    if (c != ',') {
      pos--;
      throw error("expected ',' or '" + close + "'");
    }
    return false;
  }

  private Object number() {
    int start = pos;
    if (peek() == '-') {
      pos++;
    }
    boolean integral = true;
    while (pos < text.length()) {
      char c = text.charAt(pos);
      if (c >= '0' && c <= '9') {
        pos++;
      } else if (c == '.' || c == 'e' || c == 'E' || c == '+' || c == '-') {
        integral = false;
        pos++;
      } else {
        break;
      }
    }
    String s = text.substring(start, pos);
    try {
      if (integral) {
        try {
          return Long.valueOf(s);
        } catch (NumberFormatException tooLarge) {
          return new BigInteger(s); // Flower node ids are uint64 and may exceed a long
        }
      }
      return Double.valueOf(s);
    } catch (NumberFormatException e) {
      pos = start;
      throw error("bad number '" + s + "'");
    }
  }

  private Object literal(String word, Object value) {
    if (!text.startsWith(word, pos)) {
      throw error("unexpected token");
    }
    pos += word.length();
    return value;
  }

  private char peek() {
    if (pos >= text.length()) {
      throw error("unexpected end of text");
    }
    return text.charAt(pos);
  }

  private void expect(char c) {
    if (peek() != c) {
      throw error("expected '" + c + "'");
    }
    pos++;
  }

  private void skipSpace() {
    while (pos < text.length()) {
      char c = text.charAt(pos);
      if (c != ' ' && c != '\t' && c != '\n' && c != '\r') {
        return;
      }
      pos++;
    }
  }

  private IllegalArgumentException error(String what) {
    return new IllegalArgumentException(
        "invalid JSON at offset " + pos + ": " + what + " in " + abbreviate(text));
  }

  private static String abbreviate(String s) {
    return s.length() <= 200 ? s : s.substring(0, 200) + "...";
  }
}
