package org.flowerbed.phone;

import java.util.ArrayList;
import java.util.List;

/** Picks the pure-Java model whose parameter names match the arrays a task brings. */
public final class Models {
  private Models() {}

  /**
   * A trainer over {@code data} holding {@code arrays}: {@link SoftmaxRegression} for {@code
   * fc.weight, fc.bias}, {@link Mlp} for {@code fc1.*, fc2.*}.
   *
   * @throws IllegalArgumentException naming the arrays and the layouts that are supported
   */
  public static DenseTrainer fromArrays(List<NamedArray> arrays, Dataset data, long seed) {
    List<String> names = new ArrayList<String>();
    for (NamedArray a : arrays) {
      names.add(a.name());
    }
    if (names.contains(SoftmaxRegression.WEIGHT)) {
      return new SoftmaxRegression(data, arrays, seed);
    }
    if (names.contains(Mlp.W1)) {
      return new Mlp(data, arrays, seed);
    }
    throw new IllegalArgumentException(
        "no pure-Java model has arrays "
            + names
            + "; supported: softmax regression ("
            + SoftmaxRegression.layout()
            + ") or MLP ("
            + Mlp.layout()
            + ")");
  }

  /**
   * The array called {@code name}.
   *
   * @throws IllegalArgumentException listing the names present if it is missing
   */
  static NamedArray find(List<NamedArray> arrays, String name) {
    for (NamedArray a : arrays) {
      if (a.name().equals(name)) {
        return a;
      }
    }
    List<String> names = new ArrayList<String>();
    for (NamedArray a : arrays) {
      names.add(a.name());
    }
    throw new IllegalArgumentException("missing array '" + name + "'; got " + names);
  }
}
