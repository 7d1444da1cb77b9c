"""Start-up: help imports nothing heavy, the strategies import nothing Flower's own
strategies do not, and digits loads without scikit-learn once cached.

Behaviour, not timing: each check runs a fresh interpreter and looks at
``sys.modules``. The seconds are measured by the bench (machinery, ``startup``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from flowerbed.cli import SUBCOMMANDS
from fresh import python_prints

HEAVY = ("torch", "flwr", "grpc", "sklearn", "matplotlib", "scipy", "ray", "executorch")
"""Packages that take a second or more to import on a small machine."""


def imported_after(code: str, env: dict[str, str] | None = None) -> dict[str, object]:
    """Run ``code`` in a fresh interpreter; return what it printed as JSON."""
    return dict(json.loads(python_prints(code, env=env).strip().splitlines()[-1]))


HELP = """
import contextlib, io, json, sys
from flowerbed.cli import main
out = io.StringIO()
with contextlib.redirect_stdout(out):
    try:
        code = main({argv!r})
    except SystemExit as stop:
        code = stop.code
print(json.dumps({{
    "code": code,
    "help": out.getvalue(),
    "heavy": sorted({{m.split('.')[0] for m in sys.modules}} & set({heavy!r})),
}}))
"""


@pytest.mark.parametrize(
    "argv", [["--help"], []] + [[name, "--help"] for name in SUBCOMMANDS]
)
def test_help_imports_nothing_heavy(argv: list[str]) -> None:
    result = imported_after(HELP.format(argv=argv, heavy=HEAVY))
    assert result["heavy"] == []
    assert result["code"] in (0, 2)
    help_text = str(result["help"])
    if argv and argv[0] in SUBCOMMANDS:
        assert f"usage: flowerbed {argv[0]}" in help_text
    else:
        for name, (_, text) in SUBCOMMANDS.items():
            assert name in help_text and text[:30] in " ".join(help_text.split())


def test_sim_help_lists_the_choices() -> None:
    result = imported_after(HELP.format(argv=["sim", "--help"], heavy=HEAVY))
    text = " ".join(str(result["help"]).split())
    for name in ("phones-10x", "deadline", "fedbuff", "mobilenet", "mnist1d"):
        assert name in text


def test_the_strategies_import_no_package_flowers_strategies_do_not() -> None:
    code = (
        "import json, sys\n"
        "import flwr.serverapp.strategy\n"
        "before = {m.split('.')[0] for m in sys.modules}\n"
        "import flowerbed.strategies\n"
        "after = {m.split('.')[0] for m in sys.modules}\n"
        "print(json.dumps({'new': sorted(after - before)}))\n"
    )
    assert imported_after(code)["new"] == ["flowerbed"]


def test_digits_load_without_scikit_learn_once_cached(tmp_path: Path) -> None:
    from flowerbed.data import _split_digits

    env = {**os.environ, "FLOWERBED_CACHE": str(tmp_path)}
    code = (
        "import json, sys\n"
        "from flowerbed.data import load_dataset\n"
        "d = load_dataset('digits')\n"
        "print(json.dumps({'sklearn': 'sklearn' in sys.modules,"
        " 'sizes': [len(d.y_train), len(d.y_test)]}))\n"
    )
    first = imported_after(code, env)
    assert first == {"sklearn": True, "sizes": [1437, 360]}
    [cached] = tmp_path.iterdir()
    assert cached.name.startswith("digits-split-sklearn-")
    second = imported_after(code, env)
    assert second == {"sklearn": False, "sizes": [1437, 360]}
    reference = _split_digits()
    with np.load(cached) as f:
        assert np.array_equal(f["x_tr"], reference.x_train)
        assert np.array_equal(f["y_te"], reference.y_test)


def test_a_corrupt_or_unwritable_cache_is_passed_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from flowerbed import data

    monkeypatch.setenv("FLOWERBED_CACHE", str(tmp_path))
    reference = data._split_digits()
    data._load_digits()
    [cached] = tmp_path.iterdir()
    cached.write_bytes(b"not an npz")
    loaded = data._load_digits()
    assert np.array_equal(loaded.x_train, reference.x_train)
    with np.load(cached) as f:  # rewritten
        assert np.array_equal(f["y_tr"], reference.y_train)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("FLOWERBED_CACHE", str(blocker / "sub"))
    assert np.array_equal(data._load_digits().y_test, reference.y_test)


CHECK = """
import contextlib, io, json, sys
from flowerbed.cli import main
with contextlib.redirect_stdout(io.StringIO()):
    code = main({argv!r})
print(json.dumps({{
    "code": code,
    "heavy": sorted({{m.split('.')[0] for m in sys.modules}} & set({heavy!r})),
}}))
"""


@pytest.mark.parametrize(
    ("config", "allowed"),
    [([], set()), (["-c", "fleet='phones-10x' num-rounds=20"], {"flwr", "grpc"})],
)
def test_sim_check_imports_no_torch(
    config: list[str], allowed: set[str], tmp_path: Path
) -> None:
    from flowerbed.data import load_dataset

    load_dataset("digits")  # cached for the child, which then needs no scikit-learn
    argv = ["sim", "--check", *config, "--out", str(tmp_path / "runs")]
    result = imported_after(CHECK.format(argv=argv, heavy=HEAVY))
    assert result["code"] == 0
    # -c is parsed by Flower's own parser, which imports Flower (not torch)
    assert set(result["heavy"]) <= allowed
    assert list(tmp_path.iterdir()) == []
