package org.flowerbed.phone;

import java.io.IOException;
import java.util.ArrayList;
import java.util.Collections;
import java.util.List;
import java.util.Map;
import org.junit.After;
import org.junit.Before;

/**
 * Set-up shared by the tests that talk to a {@link FakeGateway}: a gateway started before each
 * test and closed after it, which knows token {@code tok-a} as node 7, and the waits and log lines
 * of the clients and agents built here.
 */
abstract class GatewayFixture {
  protected FakeGateway gw;

  /** Every wait a {@link #recorder} was asked for, in milliseconds. */
  protected final List<Long> sleeps = Collections.synchronizedList(new ArrayList<Long>());

  /** Every line an agent built by {@link #agent} logged. */
  protected final List<String> log = Collections.synchronizedList(new ArrayList<String>());

  /** Records each wait in {@link #sleeps} instead of waiting. */
  protected final Sleeper recorder =
      new Sleeper() {
        @Override
        public void sleep(long millis) {
          sleeps.add(millis);
        }
      };

  @Before
  public void startGateway() throws IOException {
    gw = new FakeGateway();
    gw.tokens.put("tok-a", 7L);
  }

  @After
  public void stopGateway() {
    gw.close();
  }

  /** Waits 10, 20, 40 ms ... (no jitter), at most 4 attempts per request. */
  protected static Backoff fastBackoff() {
    return new Backoff(10, 100, 0, 4, 0);
  }

  /** A client of the gateway with {@code token}, waiting by {@code sleeper}. */
  protected GatewayClient client(String token, Sleeper sleeper) {
    return new GatewayClient(gw.url(), token, fastBackoff(), sleeper, 2000, 5000);
  }

  /** A client of the gateway as node 7 whose waits go to {@link #sleeps}. */
  protected GatewayClient client() {
    return client("tok-a", recorder);
  }

  /** An agent that reconnects after {@link #fastBackoff} and logs to {@link #log}. */
  protected PhoneAgent agent(
      GatewayClient client,
      PhoneAgent.TrainerFactory factory,
      DeviceStatus device,
      Ticker ticker,
      Sleeper sleeper,
      Map<String, Object> info) {
    return new PhoneAgent(
        client,
        factory,
        device,
        ticker,
        sleeper,
        fastBackoff(),
        info,
        new PhoneAgent.Log() {
          @Override
          public void line(String text) {
            log.add(text);
          }
        },
        0);
  }
}
