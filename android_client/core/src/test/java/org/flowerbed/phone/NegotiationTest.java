package org.flowerbed.phone;

import static org.junit.Assert.assertEquals;
import static org.junit.Assert.assertTrue;

import java.io.IOException;
import java.util.Arrays;
import java.util.HashMap;
import java.util.List;
import java.util.Map;
import org.junit.Test;

/** Protocol revision negotiation and what a phone does when it needs an update. */
public class NegotiationTest extends GatewayFixture {
  @Test
  public void helloOffersEveryRevisionAndTheVersions() throws IOException {
    Hello h = client().appVersions("0.2.0", "1.5.1").hello(new HashMap<String, Object>());
    Map<String, Object> sent = gw.hellos.get(0);
    assertEquals(2L, sent.get("protocol"));
    assertEquals(Arrays.asList((Object) 1L, 2L), sent.get("protocols"));
    Map<String, Object> app = new HashMap<String, Object>();
    app.put("version", "0.2.0");
    app.put("runtime", "1.5.1");
    assertEquals(app, sent.get("app"));
    assertEquals(2, h.protocol);
  }

  @Test
  public void aRevisionOneGatewayIsSpokenToInRevisionOne() throws IOException {
    gw.protocol = 0; // answers without "protocol", as revision-1 gateways do
    assertEquals(1, client().hello(new HashMap<String, Object>()).protocol);
  }

  @Test
  public void aGatewayChoosingARevisionNeverOfferedIsAViolation() throws IOException {
    gw.protocol = 9;
    try {
      client().hello(new HashMap<String, Object>());
    } catch (GatewayException e) {
      assertEquals(GatewayException.PROTOCOL_VIOLATION, e.status());
      assertTrue(e.getMessage(), e.getMessage().contains("chose protocol 9"));
      return;
    }
    throw new AssertionError("expected a violation");
  }

  @Test
  public void aPhoneTooOldWaitsForAnUpdateInsteadOfStopping() throws IOException {
    gw.fault("/v1/hello", 426, "{\"error\": \"update the flowerbed app\", \"supported\": [3]}");
    gw.fault("/v1/hello", 426, "{\"error\": \"update the flowerbed app\", \"supported\": [3]}");
    PhoneAgent agent =
        agent(
            client(),
            new PhoneAgent.TrainerFactory() {
              @Override
              public Trainer create(List<NamedArray> arrays) {
                return Models.fromArrays(
                    arrays, new Dataset(new float[][] {{1, 0}}, new int[] {0}), 0);
              }
            },
            DeviceStatus.NONE,
            Ticker.SYSTEM,
            recorder,
            new HashMap<String, Object>());
    gw.addTask("t1", "evaluate", new HashMap<String, Object>(), identity());
    assertEquals(1, agent.run(1)); // the third hello (gateway rolled back) works
    assertEquals(
        "update required reason=\"gateway speaks none of this app's protocol revisions; update the"
            + " app: update the flowerbed app\"",
        log.get(0));
    assertEquals(Arrays.asList(PhoneAgent.UPDATE_RETRY_MS, PhoneAgent.UPDATE_RETRY_MS), sleeps);
  }

  private static byte[] identity() {
    return TensorCodec.encode(
        Arrays.asList(
            new NamedArray("fc.weight", new int[] {2, 2}, new float[] {1, 0, 0, 1}),
            new NamedArray("fc.bias", new int[] {2}, new float[] {0, 0})));
  }
}
