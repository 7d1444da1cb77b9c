"""The Java phone core's JUnit suite runs on a real JVM (android_client/core)."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[1] / "android_client" / "core" / "run-tests.sh"
JUNIT = Path("/usr/share/java/junit4.jar")
HAMCREST = Path("/usr/share/java/hamcrest-core.jar")
"""Where Debian's junit4 package puts them (run-tests.sh reads the same)."""


@pytest.mark.java
def test_phone_core_builds_with_java8_target_and_passes_junit() -> None:
    missing = [
        package
        for package, present in (
            ("default-jdk-headless", shutil.which("javac") is not None),
            ("junit4", JUNIT.is_file() and HAMCREST.is_file()),
        )
        if not present
    ]
    can_install = os.geteuid() == 0 and shutil.which("apt-get") is not None
    if missing and not can_install:  # run-tests.sh installs them only as root
        pytest.skip(
            f"missing {' '.join(missing)}: sudo apt-get install -y {' '.join(missing)}"
        )
    done = subprocess.run(
        ["bash", str(SCRIPT)], capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "OK (" in done.stdout and " 0 failed" in done.stdout
    assert (SCRIPT.parent / "build" / "flowerbed-phone.jar").is_file()
