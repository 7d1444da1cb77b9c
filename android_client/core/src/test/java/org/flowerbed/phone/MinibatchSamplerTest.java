package org.flowerbed.phone;

import static org.junit.Assert.assertArrayEquals;
import static org.junit.Assert.assertEquals;

import java.util.Arrays;
import java.util.HashSet;
import java.util.Set;
import org.junit.Test;

public class MinibatchSamplerTest {
  private static Set<Integer> set(int[]... batches) {
    Set<Integer> s = new HashSet<Integer>();
    for (int[] b : batches) {
      for (int i : b) {
        s.add(i);
      }
    }
    return s;
  }

  @Test
  public void onePassVisitsEveryExampleOnce() {
    MinibatchSampler s = new MinibatchSampler(6, 1);
    int[] a = s.next(2);
    int[] b = s.next(2);
    int[] c = s.next(2);
    assertEquals(new HashSet<Integer>(Arrays.asList(0, 1, 2, 3, 4, 5)), set(a, b, c));
  }

  @Test
  public void aSliceThatWouldRunPastTheEndStartsANewPass() {
    // 5 examples, batch 2: two slices use 4 examples; the third starts a fresh permutation,
    // so the fifth example waits (as in train_steps).
    MinibatchSampler s = new MinibatchSampler(5, 2);
    assertEquals(4, set(s.next(2), s.next(2)).size());
    assertEquals(2, s.next(2).length);
  }

  @Test
  public void batchIsCappedAtTheNumberOfExamples() {
    assertEquals(3, new MinibatchSampler(3, 0).next(10).length);
  }

  @Test
  public void theSameSeedGivesTheSameBatches() {
    MinibatchSampler x = new MinibatchSampler(50, 9);
    MinibatchSampler y = new MinibatchSampler(50, 9);
    for (int i = 0; i < 20; i++) {
      assertArrayEquals(x.next(8), y.next(8));
    }
  }

  @Test(expected = IllegalArgumentException.class)
  public void aZeroBatchIsRefused() {
    new MinibatchSampler(3, 0).next(0);
  }
}
