package org.flowerbed.phone;

/** A monotonic clock in nanoseconds; tests pass one they advance by hand. */
public interface Ticker {
  Ticker SYSTEM =
      new Ticker() {
        @Override
        public long nanoTime() {
          return System.nanoTime();
        }
      };

  long nanoTime();
}
