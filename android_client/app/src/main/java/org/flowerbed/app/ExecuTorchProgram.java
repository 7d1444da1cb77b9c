package org.flowerbed.app;

import java.io.File;
import java.nio.FloatBuffer;
import java.util.HashMap;
import java.util.List;
import java.util.Map;
import org.flowerbed.phone.NamedArray;
import org.flowerbed.phone.ProgramRunner;
import org.flowerbed.phone.ProgramTrainer;
import org.pytorch.executorch.EValue;
import org.pytorch.executorch.Module;
import org.pytorch.executorch.Tensor;
import org.pytorch.executorch.training.SGD;
import org.pytorch.executorch.training.TrainingModule;

/**
 * core's {@link ProgramRunner} on ExecuTorch's Android runtime: numbers in and out of the program,
 * nothing decided here ({@link ProgramTrainer} decides).
 *
 * <p>Training runs the joint method through {@link TrainingModule} and {@link SGD}: {@code
 * namedParameters} returns tensors that wrap the program's own parameter memory, and their {@code
 * getRawDataBuffer()} (public since ExecuTorch 1.4) is written in place. Evaluation runs the
 * program's evaluation method, a function of the batch, the parameters and the state with no
 * backward pass, through a plain {@link Module} of the same file, loaded on first use; it keeps no
 * weights of its own, so the two share nothing but the file.
 */
final class ExecuTorchProgram implements ProgramRunner {
  private final File pte;
  private final TrainingModule training;
  private Module evaluation;
  private SGD sgd;
  private double sgdLr = Double.NaN;

  /** @throws RuntimeException from ExecuTorch if the file is missing or not a program */
  ExecuTorchProgram(File pte) {
    this.pte = pte;
    this.training = TrainingModule.load(pte.getAbsolutePath());
  }

  @Override
  public Map<String, long[]> parameterShapes() {
    Map<String, long[]> shapes = new HashMap<String, long[]>();
    for (Map.Entry<String, Tensor> e : params().entrySet()) {
      shapes.put(e.getKey(), e.getValue().shape());
    }
    return shapes;
  }

  @Override
  public void writeParameters(List<NamedArray> parameters) {
    Map<String, Tensor> params = params();
    for (NamedArray a : parameters) {
      FloatBuffer buf = (FloatBuffer) params.get(a.name()).getRawDataBuffer();
      buf.rewind();
      buf.put(a.data());
    }
  }

  @Override
  public float[] readParameter(String name) {
    return params().get(name).getDataAsFloatArray();
  }

  @Override
  public float[][] trainStep(
      String method, float[] x, long[] xShape, long[] y, List<NamedArray> state, double lr) {
    EValue[] out = training.executeForwardBackward(method, inputs(x, xShape, y, state));
    if (sgd == null || lr != sgdLr) {
      sgd = SGD.create(params(), lr);
      sgdLr = lr;
    }
    sgd.step(training.namedGradients(method));
    return floats(out);
  }

  @Override
  public float[][] evaluate(
      String method, float[] x, long[] xShape, long[] y, List<NamedArray> inputs) {
    if (evaluation == null) {
      evaluation = Module.load(pte.getAbsolutePath());
    }
    return floats(evaluation.execute(method, inputs(x, xShape, y, inputs)));
  }

  private Map<String, Tensor> params() {
    return training.namedParameters(ProgramTrainer.TRAIN_METHOD);
  }

  private static EValue[] inputs(float[] x, long[] xShape, long[] y, List<NamedArray> arrays) {
    EValue[] in = new EValue[2 + arrays.size()];
    in[0] = EValue.from(Tensor.fromBlob(x, xShape));
    in[1] = EValue.from(Tensor.fromBlob(y, new long[] {y.length}));
    for (int i = 0; i < arrays.size(); i++) {
      NamedArray a = arrays.get(i);
      long[] shape = new long[a.shape().length];
      for (int d = 0; d < shape.length; d++) {
        shape[d] = a.shape()[d];
      }
      in[2 + i] = EValue.from(Tensor.fromBlob(a.data(), shape));
    }
    return in;
  }

  private static float[][] floats(EValue[] out) {
    float[][] values = new float[out.length][];
    for (int i = 0; i < out.length; i++) {
      values[i] = out[i].toTensor().getDataAsFloatArray();
    }
    return values;
  }
}
