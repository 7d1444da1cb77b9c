"""The Java phone core's JUnit suite runs on a real JVM (android_client/core)."""

import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[1] / "android_client" / "core" / "run-tests.sh"


@pytest.mark.java
def test_phone_core_builds_with_java8_target_and_passes_junit() -> None:
    if shutil.which("javac") is None and shutil.which("apt-get") is None:
        pytest.skip("no JDK and no apt-get to install one (scripts/setup.sh --dev)")
    done = subprocess.run(
        ["bash", str(SCRIPT)], capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "OK (" in done.stdout and " 0 failed" in done.stdout
    assert (SCRIPT.parent / "build" / "flowerbed-phone.jar").is_file()
