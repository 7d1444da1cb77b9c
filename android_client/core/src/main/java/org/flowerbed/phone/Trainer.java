package org.flowerbed.phone;

import java.util.List;

/**
 * A model with local data that the phone trains: core's pure-Java {@link DenseTrainer}s in tests
 * and on a JVM, ExecuTorch's training runtime in the Android app.
 */
public interface Trainer {
  /**
   * Load the global model.
   *
   * @throws IllegalArgumentException if the names, order or shapes differ from the model's, saying
   *     which array is wrong
   */
  void setParameters(List<NamedArray> arrays);

  /** The current parameters, as new arrays in the order of {@link #setParameters}. */
  List<NamedArray> getParameters();

  /** Number of local training examples. */
  int numExamples();

  /**
   * One optimiser step on the next minibatch.
   *
   * @param batchSize examples wanted in the batch (a trainer with a fixed batch may use its own)
   * @param lr learning rate of this step
   * @return the examples used and the batch's mean loss
   */
  StepResult step(int batchSize, double lr);

  /** Mean loss and accuracy on the local data, with the current parameters. */
  Evaluation evaluate();

  /** What one step did. */
  final class StepResult {
    public final int examples;
    public final double loss;

    public StepResult(int examples, double loss) {
      this.examples = examples;
      this.loss = loss;
    }
  }

  /** What an evaluation found. */
  final class Evaluation {
    public final int examples;
    public final double loss;
    public final double accuracy;

    public Evaluation(int examples, double loss, double accuracy) {
      this.examples = examples;
      this.loss = loss;
      this.accuracy = accuracy;
    }
  }
}
