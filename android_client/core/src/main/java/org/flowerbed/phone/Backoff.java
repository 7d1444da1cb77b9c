package org.flowerbed.phone;

import java.util.Random;

/**
 * Exponential backoff with jitter for retrying network errors: wait_k = min(maxMs, initialMs * 2^k)
 * * (1 - jitter * u), u uniform in [0, 1), for the k-th consecutive failure (k = 0, 1, ...). The
 * jitter spreads out the retries of many phones that lost the same Wi-Fi at once ("full jitter"
 * family, Brooker, "Exponential Backoff and Jitter", AWS Architecture Blog, 2015).
 */
public final class Backoff {
  private final long initialMs;
  private final long maxMs;
  private final double jitter;
  private final int maxAttempts;
  private final Random random;

  /**
   * @param initialMs first wait, > 0
   * @param maxMs cap on one wait, >= initialMs
   * @param jitter fraction in [0, 1] of each wait that is randomised away
   * @param maxAttempts attempts of one request before giving up (>= 1)
   * @param seed seed of the jitter
   */
  public Backoff(long initialMs, long maxMs, double jitter, int maxAttempts, long seed) {
    if (initialMs <= 0 || maxMs < initialMs) {
      throw new IllegalArgumentException(
          "need 0 < initialMs <= maxMs, got " + initialMs + " and " + maxMs);
    }
    if (!(jitter >= 0 && jitter <= 1)) {
      throw new IllegalArgumentException("jitter must be in [0, 1], got " + jitter);
    }
    if (maxAttempts < 1) {
      throw new IllegalArgumentException("maxAttempts must be >= 1, got " + maxAttempts);
    }
    this.initialMs = initialMs;
    this.maxMs = maxMs;
    this.jitter = jitter;
    this.maxAttempts = maxAttempts;
    this.random = new Random(seed);
  }

  /** 0.5 s doubling to 30 s, half jitter, 8 attempts: about two minutes of trying. */
  public static Backoff defaults() {
    return new Backoff(500, 30_000, 0.5, 8, System.nanoTime());
  }

  public int maxAttempts() {
    return maxAttempts;
  }

  /** Milliseconds to wait after the {@code failure}-th consecutive failure (0-based). */
  public synchronized long delayMs(int failure) {
    double base = initialMs * Math.pow(2, Math.min(failure, 40));
    double capped = Math.min(maxMs, base);
    return Math.round(capped * (1 - jitter * random.nextDouble()));
  }
}
