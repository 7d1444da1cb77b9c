"""scripts/setup.sh: quiet when pip succeeds, loud and non-zero when it fails.

A stand-in ``python`` (a shell script given as PYTHON) plays pip and the checks
setup.sh makes, so nothing is installed.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).parents[1]
SETUP = ROOT / "scripts" / "setup.sh"
NOISE = (
    "ERROR: pip's dependency resolver does not currently take into account all the "
    "packages that are installed. This behaviour is the source of the following "
    "dependency conflicts.\n"
    "executorch 1.5.1 requires torchao, which is not installed.\n"
)


def fake_python(tmp_path: Path, pip: str, managed: bool = False) -> Path:
    """A ``python`` whose ``-m pip`` runs ``pip`` (shell), whose torch check fails
    (so torch gets installed) and whose PEP 668 check answers ``managed``."""
    script = tmp_path / "python"
    script.write_text(
        "#!/usr/bin/env bash\n"
        f'echo "$*" >> {tmp_path}/calls\n'
        'if [ "$1" = "-" ]; then cat >/dev/null; '
        f"exit {0 if managed else 1}; fi\n"
        'if [ "$1" = "-m" ] && [ "$2" = "pip" ]; then ' + pip + "; fi\n"
        "exit 1\n"
    )
    script.chmod(0o755)
    return script


def run_setup(python: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHON": str(python)}
    env.pop("FLOWERBED_TORCH_INDEX", None)
    env.pop("FLOWERBED_TORCH", None)
    return subprocess.run(
        ["bash", str(SETUP), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )


def test_success_is_quiet_and_drops_executorchs_expected_conflicts(
    tmp_path: Path,
) -> None:
    noise = NOISE.replace("\n", "\\n")
    done = run_setup(fake_python(tmp_path, f'printf "{noise}"; exit 0'))
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    assert done.stdout == "flowerbed installed: try flowerbed --help\n"
    calls = (tmp_path / "calls").read_text().splitlines()
    assert "-m pip install -q torch==2.13.0" in calls
    assert "-m pip install -q -e ." in calls


def test_flwr_is_upgraded_to_the_newest_release_the_pin_allows(tmp_path: Path) -> None:
    """`pip install -e .` keeps an installed flwr that is inside the range (1.41 when
    1.42 is out), so setup.sh first asks for the newest one with --upgrade, in the
    words of pyproject.toml's requirement."""
    done = run_setup(fake_python(tmp_path, "exit 0"))
    assert done.returncode == 0, done.stderr
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    (pin,) = [
        requirement
        for requirement in pyproject["project"]["dependencies"]
        if requirement.startswith("flwr[simulation]")
    ]
    calls = (tmp_path / "calls").read_text().splitlines()
    upgrade = f"-m pip install -q --upgrade {pin}"
    assert upgrade in calls
    assert calls.index(upgrade) < calls.index("-m pip install -q -e .")


def test_a_failing_pip_shows_its_output_and_exits_non_zero(tmp_path: Path) -> None:
    done = run_setup(fake_python(tmp_path, 'echo "ERROR: no matching torch"; exit 1'))
    assert done.returncode == 1
    assert "ERROR: no matching torch" in done.stderr
    assert "error: pip install torch==2.13.0 failed (output above)" in done.stderr


def test_a_pip_message_other_than_the_expected_one_is_shown(tmp_path: Path) -> None:
    done = run_setup(fake_python(tmp_path, 'echo "WARNING: disk almost full"; exit 0'))
    assert done.returncode == 0
    assert "WARNING: disk almost full" in done.stderr


def test_a_system_managed_python_is_refused_with_the_venv_command(
    tmp_path: Path,
) -> None:
    done = run_setup(fake_python(tmp_path, "exit 0", managed=True))
    assert done.returncode == 1
    assert "python3 -m venv .venv && . .venv/bin/activate" in done.stderr
    assert not (tmp_path / "calls").read_text().count("pip")


def test_torch_comes_from_the_index_given(tmp_path: Path) -> None:
    python = fake_python(tmp_path, "exit 0")
    env = {**os.environ, "PYTHON": str(python)}
    env.pop("FLOWERBED_TORCH", None)
    env["FLOWERBED_TORCH_INDEX"] = "https://download.pytorch.org/whl/cpu"
    done = subprocess.run(
        ["bash", str(SETUP)], capture_output=True, text=True, env=env, check=False
    )
    assert done.returncode == 0, done.stderr
    calls = (tmp_path / "calls").read_text()
    assert (
        "-m pip install -q torch==2.13.0 --index-url "
        "https://download.pytorch.org/whl/cpu" in calls
    )


def test_torch_version_can_be_chosen(tmp_path: Path) -> None:
    python = fake_python(tmp_path, "exit 0")
    env = {**os.environ, "PYTHON": str(python), "FLOWERBED_TORCH": "2.15.0"}
    env.pop("FLOWERBED_TORCH_INDEX", None)
    done = subprocess.run(
        ["bash", str(SETUP)], capture_output=True, text=True, env=env, check=False
    )
    assert done.returncode == 0, done.stderr
    calls = (tmp_path / "calls").read_text()
    assert "-m pip install -q torch==2.15.0\n" in calls
    assert "torch==2.13.0" not in calls


@pytest.mark.parametrize("arg", ["--devv", "dev"])
def test_an_unknown_argument_is_refused(tmp_path: Path, arg: str) -> None:
    done = run_setup(fake_python(tmp_path, "exit 0"), arg)
    assert done.returncode == 2
    assert "usage: bash scripts/setup.sh [--dev]" in done.stderr
