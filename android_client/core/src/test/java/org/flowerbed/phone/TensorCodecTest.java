package org.flowerbed.phone;

import static org.junit.Assert.assertArrayEquals;
import static org.junit.Assert.assertEquals;
import static org.junit.Assert.assertTrue;
import static org.junit.Assert.fail;

import java.nio.ByteBuffer;
import java.nio.ByteOrder;
import java.util.Arrays;
import java.util.Collections;
import java.util.List;
import org.junit.Test;

public class TensorCodecTest {
  /** One tensor "w" of shape [2] holding 1.0, -2.0, written out byte by byte. */
  private static final byte[] TINY = {
    'F',
    'B',
    'T',
    '1', // magic
    1,
    0,
    0,
    0, // count = 1
    1,
    0, // name_len = 1
    'w', // name
    0, // dtype float32
    1, // ndim
    2,
    0,
    0,
    0, // dims[0] = 2
    0,
    0,
    (byte) 0x80,
    0x3f, // 1.0f  = 0x3f800000
    0,
    0,
    0,
    (byte) 0xc0, // -2.0f = 0xc0000000
  };

  private static NamedArray array(String name, int[] shape, float... data) {
    return new NamedArray(name, shape, data);
  }

  private static void assertMalformed(byte[] blob, String expectedFragment) {
    try {
      TensorCodec.decode(blob);
      fail("expected MalformedBlobException containing '" + expectedFragment + "'");
    } catch (MalformedBlobException e) {
      assertTrue(
          "message '" + e.getMessage() + "' should mention '" + expectedFragment + "'",
          e.getMessage().contains(expectedFragment));
    }
  }

  @Test
  public void encodesTheByteLayoutOfTheProtocol() {
    byte[] blob = TensorCodec.encode(Collections.singletonList(array("w", new int[] {2}, 1f, -2f)));
    assertArrayEquals(TINY, blob);
    assertEquals(
        TINY.length,
        TensorCodec.encodedSize(Collections.singletonList(array("w", new int[] {2}, 1f, -2f))));
  }

  @Test
  public void decodesTheByteLayoutOfTheProtocol() throws Exception {
    List<NamedArray> a = TensorCodec.decode(TINY);
    assertEquals(1, a.size());
    assertEquals("w", a.get(0).name());
    assertArrayEquals(new int[] {2}, a.get(0).shape());
    assertArrayEquals(new float[] {1f, -2f}, a.get(0).data(), 0f);
  }

  @Test
  public void roundTripKeepsNamesOrderShapesAndEveryBit() throws Exception {
    List<NamedArray> in =
        Arrays.asList(
            array("fc2.weight", new int[] {2, 3}, 1, 2, 3, 4, 5, 6),
            array("scalar", new int[] {}, 7.5f),
            array("empty", new int[] {0, 3}),
            array("gewicht.é✓", new int[] {1, 1, 1, 2}, Float.NaN, Float.NEGATIVE_INFINITY),
            array("a", new int[] {1}, -0.0f));
    List<NamedArray> out = TensorCodec.decode(TensorCodec.encode(in));
    assertEquals(in.size(), out.size());
    for (int i = 0; i < in.size(); i++) {
      assertEquals(in.get(i).name(), out.get(i).name());
      assertArrayEquals(in.get(i).shape(), out.get(i).shape());
      float[] x = in.get(i).data();
      float[] y = out.get(i).data();
      assertEquals(x.length, y.length);
      for (int j = 0; j < x.length; j++) {
        assertEquals(Float.floatToRawIntBits(x[j]), Float.floatToRawIntBits(y[j]));
      }
    }
  }

  @Test
  public void emptyListIsEightBytes() throws Exception {
    byte[] blob = TensorCodec.encode(Collections.<NamedArray>emptyList());
    assertArrayEquals(new byte[] {'F', 'B', 'T', '1', 0, 0, 0, 0}, blob);
    assertEquals(0, TensorCodec.decode(blob).size());
  }

  @Test
  public void everyProperPrefixIsTruncated() {
    for (int n = 0; n < TINY.length; n++) {
      assertMalformed(Arrays.copyOf(TINY, n), "truncated");
    }
  }

  @Test
  public void trailingBytesAreMalformed() {
    assertMalformed(Arrays.copyOf(TINY, TINY.length + 1), "1 trailing bytes");
  }

  @Test
  public void badMagicIsMalformed() {
    byte[] b = TINY.clone();
    b[3] = '2';
    assertMalformed(b, "bad magic");
  }

  @Test
  public void unknownDtypeIsMalformed() {
    byte[] b = TINY.clone();
    b[11] = 1; // dtype byte
    assertMalformed(b, "unknown dtype 1");
  }

  @Test
  public void countBeyondTheBlobIsMalformed() {
    byte[] b = TINY.clone();
    b[4] = 2; // claims two tensors, holds one
    assertMalformed(b, "truncated");
    byte[] huge = TINY.clone();
    huge[4] = huge[5] = huge[6] = huge[7] = (byte) 0xff; // 2^32-1 tensors
    assertMalformed(huge, "tensor count 4294967295 cannot fit");
  }

  @Test
  public void emptyNameIsMalformed() {
    byte[] b = {'F', 'B', 'T', '1', 1, 0, 0, 0, 0, 0, 0, 0};
    assertMalformed(b, "empty name");
  }

  @Test
  public void invalidUtf8NameIsMalformed() {
    byte[] b = TINY.clone();
    b[10] = (byte) 0xff;
    assertMalformed(b, "not valid UTF-8");
  }

  @Test
  public void repeatedNameIsMalformed() {
    byte[] one = Arrays.copyOfRange(TINY, 8, TINY.length);
    ByteBuffer b = ByteBuffer.allocate(8 + 2 * one.length).order(ByteOrder.LITTLE_ENDIAN);
    b.put(new byte[] {'F', 'B', 'T', '1'}).putInt(2).put(one).put(one);
    assertMalformed(b.array(), "appears twice");
  }

  @Test
  public void dimensionAboveIntRangeIsMalformed() {
    byte[] b = TINY.clone();
    b[13] = b[14] = b[15] = b[16] = (byte) 0xff; // dims[0] = 2^32-1
    assertMalformed(b, "above 2^31-1");
  }

  @Test
  public void shapeWhoseDataCannotFitIsMalformedWithoutAllocating() {
    // ndim 4 with every dim 2^31-1: the product overflows a long if computed naively.
    ByteBuffer b = ByteBuffer.allocate(8 + 2 + 1 + 2 + 16).order(ByteOrder.LITTLE_ENDIAN);
    b.put(new byte[] {'F', 'B', 'T', '1'}).putInt(1).putShort((short) 1).put((byte) 'w');
    b.put((byte) 0).put((byte) 4);
    for (int i = 0; i < 4; i++) {
      b.putInt(Integer.MAX_VALUE);
    }
    assertMalformed(b.array(), "truncated");
  }

  @Test(expected = IllegalArgumentException.class)
  public void encodingRepeatedNamesIsRefused() {
    TensorCodec.encode(Arrays.asList(array("w", new int[] {1}, 1), array("w", new int[] {1}, 2)));
  }

  @Test
  public void arrayRejectsDataThatDoesNotFitItsShape() {
    try {
      array("w", new int[] {2, 2}, 1, 2, 3);
      fail("expected IllegalArgumentException");
    } catch (IllegalArgumentException e) {
      assertEquals("array 'w' has shape [2, 2] (4 values) but 3 values were given", e.getMessage());
    }
  }

  @Test
  public void moreThan32DimensionsAreRefusedBothWays() throws Exception {
    int[] shape = new int[33];
    java.util.Arrays.fill(shape, 1);
    try {
      TensorCodec.encode(
          java.util.Collections.singletonList(new NamedArray("x", shape, new float[1])));
      org.junit.Assert.fail("encoded 33 dimensions");
    } catch (IllegalArgumentException e) {
      org.junit.Assert.assertTrue(e.getMessage(), e.getMessage().contains("the limit is 32"));
    }
    // "FBT1", count 1, name "x", float32, ndim 33, 33 dims of 1, one float.
    java.nio.ByteBuffer b =
        java.nio.ByteBuffer.allocate(4 + 4 + 2 + 1 + 2 + 33 * 4 + 4)
            .order(java.nio.ByteOrder.LITTLE_ENDIAN);
    b.put("FBT1".getBytes("US-ASCII")).putInt(1).putShort((short) 1).put((byte) 'x');
    b.put((byte) 0).put((byte) 33);
    for (int i = 0; i < 33; i++) {
      b.putInt(1);
    }
    b.putFloat(1f);
    try {
      TensorCodec.decode(b.array());
      org.junit.Assert.fail("decoded 33 dimensions");
    } catch (MalformedBlobException e) {
      org.junit.Assert.assertTrue(e.getMessage(), e.getMessage().contains("the limit is 32"));
    }
  }
}
