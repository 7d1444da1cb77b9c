package org.flowerbed.phone;

import java.util.Arrays;

/**
 * One named float32 array: a Flower array such as {@code fc1.weight}, with its shape and row-major
 * (C order) data, as PyTorch stores a tensor.
 */
public final class NamedArray {
  private final String name;
  private final int[] shape;
  private final float[] data;

  /**
   * @param name Flower array name, non-empty
   * @param shape dimensions, each >= 0 (an empty shape is a scalar holding one value)
   * @param data row-major values; its length must be the product of {@code shape}
   * @throws IllegalArgumentException if the name is empty, a dimension is negative or the data
   *     length does not match the shape
   */
  public NamedArray(String name, int[] shape, float[] data) {
    if (name == null || name.isEmpty()) {
      throw new IllegalArgumentException("array name must be a non-empty string");
    }
    long expected = numElements(shape);
    if (expected != data.length) {
      throw new IllegalArgumentException(
          "array '"
              + name
              + "' has shape "
              + Arrays.toString(shape)
              + " ("
              + expected
              + " values) but "
              + data.length
              + " values were given");
    }
    this.name = name;
    this.shape = shape.clone();
    this.data = data;
  }

  /**
   * Number of elements of an array of this shape.
   *
   * @throws IllegalArgumentException if a dimension is negative
   */
  public static long numElements(int[] shape) {
    long n = 1;
    for (int d : shape) {
      if (d < 0) {
        throw new IllegalArgumentException("negative dimension in shape " + Arrays.toString(shape));
      }
      n *= d;
    }
    return n;
  }

  public String name() {
    return name;
  }

  /** A copy of the shape. */
  public int[] shape() {
    return shape.clone();
  }

  /** The values themselves (not a copy): trainers update them in place. */
  public float[] data() {
    return data;
  }

  /** A deep copy, so that training one copy leaves the other untouched. */
  public NamedArray copy() {
    return new NamedArray(name, shape, data.clone());
  }

  /** True when {@code other} has the same name and shape. */
  public boolean sameLayout(NamedArray other) {
    return name.equals(other.name) && Arrays.equals(shape, other.shape);
  }

  @Override
  public String toString() {
    return name + Arrays.toString(shape);
  }
}
