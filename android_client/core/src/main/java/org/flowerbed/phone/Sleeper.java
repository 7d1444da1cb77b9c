package org.flowerbed.phone;

import java.io.InterruptedIOException;

/** Waits between retries; tests pass one that records the waits instead of sleeping. */
public interface Sleeper {
  /** The real one: {@link Thread#sleep}, turning an interrupt into InterruptedIOException. */
  Sleeper SYSTEM =
      new Sleeper() {
        @Override
        public void sleep(long millis) throws InterruptedIOException {
          try {
            Thread.sleep(millis);
          } catch (InterruptedException e) {
            Thread.currentThread().interrupt();
            throw new InterruptedIOException("interrupted while waiting to retry");
          }
        }
      };

  void sleep(long millis) throws InterruptedIOException;
}
