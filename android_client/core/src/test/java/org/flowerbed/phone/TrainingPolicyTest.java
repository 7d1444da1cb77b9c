package org.flowerbed.phone;

import static org.junit.Assert.assertEquals;
import static org.junit.Assert.assertNull;

import org.junit.Test;

/** Scheduling decisions under fake battery, charger, network, idle and thermal states. */
public class TrainingPolicyTest {
  private static final TrainingPolicy POLICY =
      new TrainingPolicy(true, true, true, 30, 60_000, 480_000);

  /** A phone that may train: charging at 80 %, on Wi-Fi, idle, cool. */
  private static DeviceState ok() {
    return state(80.0, true, false, true, true, Boolean.TRUE, DeviceState.THERMAL_NONE);
  }

  private static DeviceState state(
      Double pct,
      boolean charging,
      boolean low,
      boolean connected,
      boolean unmetered,
      Boolean idle,
      int thermal) {
    return new DeviceState(pct, charging, low, connected, unmetered, idle, thermal, 31.0);
  }

  @Test
  public void aChargingIdleCoolPhoneOnWifiMayStart() {
    assertNull(POLICY.startBlock(ok()));
    assertNull(POLICY.stopReason(ok()));
  }

  @Test
  public void eachConstraintBlocksTheStartWithItsReason() {
    int none = DeviceState.THERMAL_NONE;
    assertEquals("no network", POLICY.startBlock(state(80.0, true, false, false, false, true, none)));
    assertEquals(
        "metered network", POLICY.startBlock(state(80.0, true, false, true, false, true, none)));
    assertEquals("not charging", POLICY.startBlock(state(80.0, false, false, true, true, true, none)));
    assertEquals(
        "battery below 30%", POLICY.startBlock(state(29.0, true, false, true, true, true, none)));
    assertEquals(
        "battery below 30%", POLICY.startBlock(state(90.0, true, true, true, true, true, none)));
    assertEquals(
        "device in use", POLICY.startBlock(state(80.0, true, false, true, true, false, none)));
    assertEquals(
        "device too warm (thermal status 2)",
        POLICY.startBlock(
            state(80.0, true, false, true, true, true, DeviceState.THERMAL_MODERATE)));
  }

  @Test
  public void unknownIdlenessAndUnknownBatteryDoNotBlock() {
    int none = DeviceState.THERMAL_NONE;
    assertNull(POLICY.startBlock(state(null, true, false, true, true, null, none)));
  }

  @Test
  public void trainingStopsLaterThanItStarts() {
    // 27 % may not start (floor 30) but training in progress goes on until below 25 %.
    DeviceState at27 = state(27.0, true, false, true, false, false, DeviceState.THERMAL_MODERATE);
    assertEquals("metered network", POLICY.startBlock(at27));
    assertNull(POLICY.stopReason(at27));
    assertEquals(
        "battery below 25%",
        POLICY.stopReason(state(24.0, true, false, true, true, true, DeviceState.THERMAL_NONE)));
    assertEquals(
        "unplugged",
        POLICY.stopReason(state(90.0, false, false, true, true, true, DeviceState.THERMAL_NONE)));
    assertEquals(
        "device too hot (thermal status 3)",
        POLICY.stopReason(state(90.0, true, false, true, true, true, DeviceState.THERMAL_SEVERE)));
  }

  @Test
  public void coolDownsDoubleUpToTheCap() {
    assertEquals(0, POLICY.coolDownMs(0));
    assertEquals(60_000, POLICY.coolDownMs(1));
    assertEquals(120_000, POLICY.coolDownMs(2));
    assertEquals(240_000, POLICY.coolDownMs(3));
    assertEquals(480_000, POLICY.coolDownMs(4));
    assertEquals(480_000, POLICY.coolDownMs(40));
  }

  @Test
  public void wakeLocksAlwaysTimeOutAMinuteAfterTheTaskExpiresAndWithinAnHour() {
    assertEquals(90_000 + 60_000, TrainingPolicy.wakeLockTimeoutMs(90.0));
    assertEquals(60_000, TrainingPolicy.wakeLockTimeoutMs(0.0));
    assertEquals(60_000, TrainingPolicy.wakeLockTimeoutMs(Double.NaN));
    assertEquals(3_600_000, TrainingPolicy.wakeLockTimeoutMs(12 * 3600.0));
  }

  /** A device whose state the test sets, and a clock it advances. */
  private DeviceState now = ok();

  private long nanos;

  private PolicyStatus status() {
    return new PolicyStatus(
        POLICY,
        new DeviceState.Source() {
          @Override
          public DeviceState read() {
            return now;
          }
        },
        new Ticker() {
          @Override
          public long nanoTime() {
            return nanos;
          }
        });
  }

  @Test
  public void overheatingStopsTrainingThenCoolsDownLongerEachTime() {
    PolicyStatus s = status();
    DeviceState hot = state(90.0, true, false, true, true, true, DeviceState.THERMAL_SEVERE);
    now = hot;
    assertEquals("device too hot (thermal status 3)", s.stopReason());
    now = ok(); // cool again at once, but the cool-down holds
    assertEquals("cooling down after overheating (60 s left)", s.blockReason());
    nanos += 59_000_000_000L;
    assertEquals("cooling down after overheating (1 s left)", s.blockReason());
    nanos += 1_000_000_000L;
    assertNull(s.blockReason());
    now = hot; // second stop in a row: twice as long
    s.stopReason();
    now = ok();
    assertEquals("cooling down after overheating (120 s left)", s.blockReason());
    nanos += 120_000_000_000L;
    assertNull(s.blockReason());
    s.trained(); // a task trained to the end: back to the shortest cool-down
    now = hot;
    s.stopReason();
    now = ok();
    assertEquals("cooling down after overheating (60 s left)", s.blockReason());
  }

  @Test
  public void thePolicyGivesTheWorkManagerConstraints() {
    TrainingPolicy d = TrainingPolicy.defaults();
    assertEquals(true, d.requiresCharging());
    assertEquals(true, d.requiresUnmetered());
    assertEquals(true, d.requiresBatteryNotLow());
    assertEquals(false, d.requiresIdle());
  }
}
