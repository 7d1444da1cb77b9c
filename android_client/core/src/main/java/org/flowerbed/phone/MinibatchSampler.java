package org.flowerbed.phone;

import java.util.Random;

/**
 * Minibatch indices as {@code flowerbed.clients.training.train_steps} draws them: consecutive
 * slices of a seeded permutation of the examples, reshuffled when the next slice would run past the
 * end, batch = min(batch_size, examples). Every trainer on the phone (pure Java or ExecuTorch)
 * samples this way, so {@code num-examples} means the same everywhere.
 */
public final class MinibatchSampler {
  private final int size;
  private final Random random;
  private int[] order;
  private int cursor;

  /**
   * @param size number of examples, >= 1
   * @param seed seed of the permutations
   */
  public MinibatchSampler(int size, long seed) {
    if (size < 1) {
      throw new IllegalArgumentException("need at least one example, got " + size);
    }
    this.size = size;
    this.random = new Random(seed);
    this.order = permutation();
  }

  /**
   * Indices of the next minibatch.
   *
   * @param batchSize wanted batch size, >= 1; capped at the number of examples
   */
  public int[] next(int batchSize) {
    if (batchSize < 1) {
      throw new IllegalArgumentException("batch size must be >= 1, got " + batchSize);
    }
    int batch = Math.min(batchSize, size);
    if (cursor + batch > size) {
      order = permutation();
      cursor = 0;
    }
    int[] idx = new int[batch];
    System.arraycopy(order, cursor, idx, 0, batch);
    cursor += batch;
    return idx;
  }

  /** Fisher-Yates shuffle of 0..size-1. */
  private int[] permutation() {
    int[] p = new int[size];
    for (int i = 0; i < size; i++) {
      p[i] = i;
    }
    for (int i = size - 1; i > 0; i--) {
      int j = random.nextInt(i + 1);
      int t = p[i];
      p[i] = p[j];
      p[j] = t;
    }
    return p;
  }
}
