package org.flowerbed.phone;

import java.util.List;
import java.util.Map;

/**
 * An ExecuTorch training program as the phone's runtime runs it: the Android app implements it
 * on {@code org.pytorch.executorch} (TrainingModule, SGD and Module), tests with a fake. It only
 * moves numbers in and out of the program; {@link ProgramTrainer} decides what to run.
 */
public interface ProgramRunner {
  /** Names and shapes of the parameters the program holds, as its runtime reports them. */
  Map<String, long[]> parameterShapes();

  /** Write {@code parameters} into the program's own parameter memory, by name. */
  void writeParameters(List<NamedArray> parameters);

  /** The program's current values of parameter {@code name}. */
  float[] readParameter(String name);

  /**
   * One training step: the training method {@code method} on {@code (x, y, *state)}, then one
   * SGD step with learning rate {@code lr} on the gradients it computed.
   *
   * @param x the batch's samples, row-major, shape {@code xShape}
   * @param y the batch's labels
   * @param state the arrays the method carries, in the program's order
   * @return the method's outputs before its gradients: the mean loss (one value), the logits,
   *     then the updated state arrays in the program's order
   */
  float[][] trainStep(
      String method, float[] x, long[] xShape, long[] y, List<NamedArray> state, double lr);

  /**
   * The evaluation method {@code method} on {@code (x, y, *inputs)}: no backward pass, nothing in
   * the program changes.
   *
   * @param inputs the parameters then the state, in the program's order
   * @return the mean loss (one value) and the logits
   */
  float[][] evaluate(String method, float[] x, long[] xShape, long[] y, List<NamedArray> inputs);
}
