package org.flowerbed.phone;

import static org.junit.Assert.assertEquals;
import static org.junit.Assert.assertTrue;
import static org.junit.Assert.fail;

import java.math.BigInteger;
import java.util.Arrays;
import java.util.LinkedHashMap;
import java.util.Map;
import org.junit.Test;

public class JsonTest {
  @Test
  public void parsesTheShapesOfTheProtocol() {
    Map<String, Object> m =
        Json.parseObject(
            "{\"task_id\": \"t-1\", \"config\": {\"lr\": 0.05, \"local-steps\": 10},"
                + " \"ok\": true, \"none\": null, \"list\": [1, -2.5e1, \"a\\\"b\\u00e9\"]}");
    assertEquals("t-1", m.get("task_id"));
    assertEquals(0.05, ((Map<?, ?>) m.get("config")).get("lr"));
    assertEquals(10L, ((Map<?, ?>) m.get("config")).get("local-steps"));
    assertEquals(Boolean.TRUE, m.get("ok"));
    assertTrue(m.containsKey("none"));
    assertEquals(Arrays.<Object>asList(1L, -25.0, "a\"bé"), m.get("list"));
  }

  @Test
  public void integersBeyondALongStayExact() {
    Map<String, Object> m = Json.parseObject("{\"node_id\": 16659729769155621624}");
    assertEquals(new BigInteger("16659729769155621624"), m.get("node_id"));
    assertEquals("{\"node_id\":16659729769155621624}", Json.write(m));
  }

  @Test
  public void writesWhatItParses() {
    Map<String, Object> m = new LinkedHashMap<String, Object>();
    m.put("num-examples", 32L);
    m.put("train-time-s", 1.5);
    m.put("reason", "line\nbreak \"quoted\"");
    String text = Json.write(m);
    assertEquals(
        "{\"num-examples\":32,\"train-time-s\":1.5,\"reason\":\"line\\nbreak \\\"quoted\\\"\"}",
        text);
    assertEquals(m, Json.parseObject(text));
  }

  @Test
  public void rejectsBrokenJsonWithItsOffset() {
    String[] bad = {"{\"a\": }", "{\"a\" 1}", "[1, 2", "{} x", "\"open", "tru"};
    for (String s : bad) {
      try {
        Json.parse(s);
        fail("expected IllegalArgumentException for " + s);
      } catch (IllegalArgumentException e) {
        assertTrue(e.getMessage(), e.getMessage().startsWith("invalid JSON at offset "));
      }
    }
  }

  @Test(expected = IllegalArgumentException.class)
  public void refusesToWriteNaN() {
    Json.write(Double.NaN);
  }
}
