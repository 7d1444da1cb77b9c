"""parallel/'s old module paths keep working for one release, with a warning.

The modules moved into one subpackage per kind of job (flowerbed.parallel's
docstring); each old path imports as its new module (no alias file), and the
names of the three former modules that are packages now resolve from them.
"""

from __future__ import annotations

import importlib
import sys

import pytest
from flowerbed.parallel import MOVED_MODULES
from fresh import python_prints


@pytest.mark.parametrize("old", sorted(MOVED_MODULES))
def test_an_old_module_path_imports_as_the_new_module_with_a_warning(
    old: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    new = MOVED_MODULES[old]
    monkeypatch.delitem(sys.modules, old, raising=False)
    with pytest.warns(DeprecationWarning, match=f"{old} moved to {new}") as caught:
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)
    assert module.__name__ == new
    assert caught[0].filename == __file__


def test_from_import_of_an_old_path_gives_the_new_objects(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delitem(sys.modules, "flowerbed.parallel.data", raising=False)
    with pytest.warns(DeprecationWarning, match="flowerbed.parallel.job_data"):
        from flowerbed.parallel.data import batch_indices
    from flowerbed.parallel.job_data import batch_indices as new

    assert batch_indices is new


@pytest.mark.parametrize(
    ("old", "home"),
    [
        (
            "flowerbed.parallel.pipeline.run_segment",
            "flowerbed.parallel.pipeline.stage",
        ),
        (
            "flowerbed.parallel.pipeline.LOCAL_DATASET",
            "flowerbed.parallel.pipeline.stage",
        ),
        (
            "flowerbed.parallel.large_batch.LrSchedule",
            "flowerbed.parallel.large_batch.recipe",
        ),
        ("flowerbed.parallel.tiles.TileError", "flowerbed.parallel.tiles.regions"),
    ],
)
def test_a_former_module_s_names_resolve_from_its_package(old: str, home: str) -> None:
    package, _, name = old.rpartition(".")
    with pytest.warns(DeprecationWarning, match=f"moved to {home}.{name}") as caught:
        value = getattr(importlib.import_module(package), name)
    assert value is getattr(importlib.import_module(home), name)
    assert caught[0].filename == __file__


def test_an_unknown_name_or_module_is_still_an_error() -> None:
    import flowerbed.parallel.tiles

    with pytest.raises(AttributeError, match="no attribute 'nonsense'"):
        _ = flowerbed.parallel.tiles.nonsense
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("flowerbed.parallel.nonsense")


def test_the_planning_modules_import_no_torch() -> None:
    code = (
        "import sys\n"
        "import flowerbed.parallel.pipeline.planner\n"
        "import flowerbed.parallel.pipeline.recovery\n"
        "import flowerbed.parallel.large_batch.recipe\n"
        "import flowerbed.parallel.large_batch.optimizers\n"
        "import flowerbed.parallel.tiles.grouping, flowerbed.parallel.tiles.layout\n"
        "print('torch' in sys.modules)\n"
    )
    assert python_prints(code).strip() == "False"
