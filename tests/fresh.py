"""Python code run in a fresh interpreter, for tests of what a process imports."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path


def python_prints(
    code: str, cwd: Path | None = None, env: Mapping[str, str] | None = None
) -> str:
    """What ``code`` prints when this environment's Python runs it as
    ``python -c`` in ``cwd`` with the environment ``env`` (the current one when
    not given); a non-zero exit or two minutes raise (its error output
    goes to the test's)."""
    return subprocess.check_output(
        [sys.executable, "-c", code], cwd=cwd, env=env, text=True, timeout=120
    )
