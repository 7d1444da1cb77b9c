"""Installing flowerbed adds one import namespace and nothing generic."""

import subprocess
import sys
import zipfile
from pathlib import Path

from fresh import python_prints

ROOT = Path(__file__).parents[1]


def test_wheel_holds_only_the_flowerbed_namespace(tmp_path: Path) -> None:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
    )
    [wheel] = tmp_path.glob("flowerbed-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names}
    assert top == {
        "flowerbed",
        f"{wheel.name.split('-')[0]}-{wheel.name.split('-')[1]}.dist-info",
    }
    for module in ("strategies", "clients", "sims", "bench", "core", "parallel"):
        assert not any(n.startswith(f"{module}/") for n in names)
    for package in ("strategies", "clients", "sims", "bench", "parallel"):
        assert f"flowerbed/{package}/__init__.py" in names
    assert "flowerbed/strategies/cluster_selection/__init__.py" in names
    assert "flowerbed/cli.py" in names


def test_generic_names_do_not_import_outside_the_source_tree(tmp_path: Path) -> None:
    names = ("strategies", "sims", "clients", "bench", "core", "parallel")
    code = f"import importlib.util as u; print([m for m in {names} if u.find_spec(m)])"
    assert python_prints(code, cwd=tmp_path).strip() == "[]"


def test_console_entry_point_is_flowerbed() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "flowerbed", "--help"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "sim" in done.stdout
