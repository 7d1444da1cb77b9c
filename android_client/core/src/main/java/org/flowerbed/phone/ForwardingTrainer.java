package org.flowerbed.phone;

import java.util.List;

/**
 * A trainer that passes every call on to another one: the base of a wrapper that changes one call
 * (a slow phone's step, a test's clock) and keeps the rest.
 */
public abstract class ForwardingTrainer implements Trainer {
  /** The trainer every call goes to. */
  protected final Trainer inner;

  protected ForwardingTrainer(Trainer inner) {
    this.inner = inner;
  }

  @Override
  public void setParameters(List<NamedArray> arrays) {
    inner.setParameters(arrays);
  }

  @Override
  public List<NamedArray> getParameters() {
    return inner.getParameters();
  }

  @Override
  public int numExamples() {
    return inner.numExamples();
  }

  @Override
  public StepResult step(int batchSize, double lr) {
    return inner.step(batchSize, lr);
  }

  @Override
  public Evaluation evaluate() {
    return inner.evaluate();
  }
}
