package org.flowerbed.phone;

import org.junit.internal.TextListener;
import org.junit.runner.JUnitCore;
import org.junit.runner.Result;

/**
 * JUnit 4's console run (the same listener and summary as {@code JUnitCore.main}) followed by a
 * plain {@code junit: N passed, N failed, N skipped} line, exiting 1 on any failure.
 */
public final class JUnitMain {
  private JUnitMain() {}

  public static void main(String[] args) throws ClassNotFoundException {
    if (args.length == 0) {
      System.err.println("usage: JUnitMain <test class>...; no test class given");
      System.exit(2);
    }
    Class<?>[] classes = new Class<?>[args.length];
    for (int i = 0; i < args.length; i++) {
      classes[i] = Class.forName(args[i]);
    }
    JUnitCore core = new JUnitCore();
    core.addListener(new TextListener(System.out));
    Result r = core.run(classes);
    int skipped = r.getIgnoreCount() + r.getAssumptionFailureCount();
    int passed = r.getRunCount() - r.getFailureCount() - r.getAssumptionFailureCount();
    System.out.println(
        "junit: "
            + passed
            + " passed, "
            + r.getFailureCount()
            + " failed, "
            + skipped
            + " skipped");
    System.exit(r.wasSuccessful() && r.getRunCount() > 0 ? 0 : 1);
  }
}
