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
    not given); a non-zero exit or two minutes raise."""
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    return done.stdout
