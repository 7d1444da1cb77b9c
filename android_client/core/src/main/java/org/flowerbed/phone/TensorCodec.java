package org.flowerbed.phone;

import java.nio.ByteBuffer;
import java.nio.ByteOrder;
import java.nio.CharBuffer;
import java.nio.charset.CharacterCodingException;
import java.nio.charset.CharsetDecoder;
import java.nio.charset.CodingErrorAction;
import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.HashSet;
import java.util.List;
import java.util.Set;

/**
 * The tensor encoding of PROTOCOL.md ({@code application/x-flowerbed-tensors}), little-endian:
 *
 * <pre>
 * magic "FBT1" | count uint32 | count x tensor
 * tensor: name_len uint16 | name UTF-8 | dtype uint8 (0 = float32) | ndim uint8
 *         | dims ndim x uint32 | data prod(dims) x float32
 * </pre>
 *
 * Decoding is strict: a bad magic, a truncated blob, trailing bytes, an unknown dtype, a dimension
 * above 2^31-1, a name that is empty, not valid UTF-8 or repeated are all malformed.
 */
public final class TensorCodec {
  /** The content type of an encoded blob. */
  public static final String CONTENT_TYPE = "application/x-flowerbed-tensors";

  private static final byte[] MAGIC = {'F', 'B', 'T', '1'};
  private static final int DTYPE_FLOAT32 = 0;
  private static final int MAX_NAME_BYTES = 0xFFFF;
  /** Most dimensions of a tensor (PROTOCOL.md; the gateway refuses more). */
  private static final int MAX_NDIM = 32;

  private TensorCodec() {}

  /** Size in bytes of the encoding of {@code arrays}. */
  public static long encodedSize(List<NamedArray> arrays) {
    long size = MAGIC.length + 4;
    for (NamedArray a : arrays) {
      size += 2 + a.name().getBytes(StandardCharsets.UTF_8).length + 1 + 1;
      size += 4L * a.shape().length + 4L * a.data().length;
    }
    return size;
  }

  /**
   * Encode arrays in the given order.
   *
   * @throws IllegalArgumentException if a name is longer than 65535 UTF-8 bytes, an array has more
   *     than 32 dimensions, names repeat, or the blob would exceed 2 GiB
   */
  public static byte[] encode(List<NamedArray> arrays) {
    long size = encodedSize(arrays);
    if (size > Integer.MAX_VALUE - 8) {
      throw new IllegalArgumentException("tensor blob of " + size + " bytes exceeds 2 GiB");
    }
    Set<String> seen = new HashSet<String>();
    ByteBuffer buf = ByteBuffer.allocate((int) size).order(ByteOrder.LITTLE_ENDIAN);
    buf.put(MAGIC);
    buf.putInt(arrays.size());
    for (NamedArray a : arrays) {
      if (!seen.add(a.name())) {
        throw new IllegalArgumentException("array name '" + a.name() + "' appears twice");
      }
      byte[] name = a.name().getBytes(StandardCharsets.UTF_8);
      if (name.length > MAX_NAME_BYTES) {
        throw new IllegalArgumentException(
            "array name '" + a.name() + "' is " + name.length + " bytes; the limit is 65535");
      }
      int[] shape = a.shape();
      if (shape.length > MAX_NDIM) {
        throw new IllegalArgumentException(
            "array '" + a.name() + "' has " + shape.length + " dimensions; the limit is " + MAX_NDIM);
      }
      buf.putShort((short) name.length);
      buf.put(name);
      buf.put((byte) DTYPE_FLOAT32);
      buf.put((byte) shape.length);
      for (int d : shape) {
        buf.putInt(d);
      }
      buf.asFloatBuffer().put(a.data());
      buf.position(buf.position() + 4 * a.data().length);
    }
    return buf.array();
  }

  /**
   * Decode a blob into arrays, in blob order.
   *
   * @throws MalformedBlobException naming the first defect and its byte offset
   */
  public static List<NamedArray> decode(byte[] blob) throws MalformedBlobException {
    ByteBuffer buf = ByteBuffer.wrap(blob).order(ByteOrder.LITTLE_ENDIAN);
    need(buf, MAGIC.length, "the magic");
    byte[] magic = new byte[MAGIC.length];
    buf.get(magic);
    if (!Arrays.equals(magic, MAGIC)) {
      throw new MalformedBlobException(
          "bad magic " + Arrays.toString(magic) + ": a tensor blob starts with \"FBT1\"");
    }
    need(buf, 4, "the tensor count");
    long count = buf.getInt() & 0xFFFFFFFFL;
    // Each tensor takes at least 4 bytes (name_len, dtype, ndim), so a count larger than
    // that allows is malformed; checking here avoids allocating for a hostile count.
    if (count > buf.remaining() / 4) {
      throw new MalformedBlobException(
          "truncated: tensor count "
              + count
              + " cannot fit in the remaining "
              + buf.remaining()
              + " bytes");
    }
    List<NamedArray> arrays = new ArrayList<NamedArray>((int) count);
    Set<String> seen = new HashSet<String>();
    for (long i = 0; i < count; i++) {
      String where = "tensor " + i;
      need(buf, 2, "the name length of " + where);
      int nameLen = buf.getShort() & 0xFFFF;
      if (nameLen == 0) {
        throw new MalformedBlobException(where + " has an empty name");
      }
      need(buf, nameLen, "the name of " + where);
      byte[] nameBytes = new byte[nameLen];
      buf.get(nameBytes);
      String name = utf8(nameBytes, where);
      where = "tensor " + i + " ('" + name + "')";
      if (!seen.add(name)) {
        throw new MalformedBlobException(where + ": the name appears twice");
      }
      need(buf, 2, "the dtype and ndim of " + where);
      int dtype = buf.get() & 0xFF;
      if (dtype != DTYPE_FLOAT32) {
        throw new MalformedBlobException(
            where + " has unknown dtype " + dtype + "; version 1 knows only 0 (float32)");
      }
      int ndim = buf.get() & 0xFF;
      if (ndim > MAX_NDIM) {
        throw new MalformedBlobException(
            where + " has " + ndim + " dimensions; the limit is " + MAX_NDIM);
      }
      need(buf, 4L * ndim, "the dims of " + where);
      int[] shape = new int[ndim];
      // The product is capped once it exceeds what the blob could hold, so it cannot overflow.
      long numel = 1;
      for (int d = 0; d < ndim; d++) {
        long dim = buf.getInt() & 0xFFFFFFFFL;
        if (dim > Integer.MAX_VALUE) {
          throw new MalformedBlobException(where + " has dimension " + dim + " above 2^31-1");
        }
        shape[d] = (int) dim;
        numel = Math.min(numel * dim, (long) blob.length + 1);
      }
      if (4 * numel > buf.remaining()) {
        throw new MalformedBlobException(
            "truncated at offset "
                + buf.position()
                + ": the data of "
                + where
                + " with shape "
                + Arrays.toString(shape)
                + " needs more bytes than the "
                + buf.remaining()
                + " that remain");
      }
      float[] data = new float[(int) numel];
      buf.asFloatBuffer().get(data);
      buf.position(buf.position() + 4 * data.length);
      arrays.add(new NamedArray(name, shape, data));
    }
    if (buf.hasRemaining()) {
      throw new MalformedBlobException(
          buf.remaining() + " trailing bytes after the last tensor at offset " + buf.position());
    }
    return arrays;
  }

  private static void need(ByteBuffer buf, long n, String what) throws MalformedBlobException {
    if (buf.remaining() < n) {
      throw new MalformedBlobException(
          "truncated at offset "
              + buf.position()
              + ": "
              + what
              + " needs "
              + n
              + " bytes but "
              + buf.remaining()
              + " remain");
    }
  }

  private static String utf8(byte[] bytes, String where) throws MalformedBlobException {
    CharsetDecoder decoder =
        StandardCharsets.UTF_8
            .newDecoder()
            .onMalformedInput(CodingErrorAction.REPORT)
            .onUnmappableCharacter(CodingErrorAction.REPORT);
    try {
      CharBuffer chars = decoder.decode(ByteBuffer.wrap(bytes));
      return chars.toString();
    } catch (CharacterCodingException e) {
      throw new MalformedBlobException(where + " has a name that is not valid UTF-8");
    }
  }
}
