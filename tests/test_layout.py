"""The layout's arrows point one way (docs/architecture.md, "Packages").

strategies/ and parallel/ never import the simulator (flowerbed.sims) or the
benchmark (flowerbed.bench); nothing but the benchmark imports the benchmark; the
core imports no other part. Imports are read with ``ast`` from the source, so an
import inside a function counts as much as one at the top of a module.

Two more rules keep the folders readable: no two modules share a name (a reader
who sees ``pipeline.py`` knows which one is meant), and nothing outside
strategies/ reads a strategy's private attributes (the simulator and the
benchmark read what a strategy documents, as a user's code would).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
GUARDED = {"strategies": "flowerbed.strategies", "parallel": "flowerbed.parallel"}
"""Folder -> the package it installs as (the two the issue names)."""
FORBIDDEN = ("flowerbed.sims", "flowerbed.bench")
PARTS = ("strategies", "parallel", "clients", "sims", "bench")
"""The sub-packages of flowerbed; any other ``flowerbed.x`` is the core (core/)."""
MAY_IMPORT = {
    "core": set(),
    "strategies": {"parallel"},
    "parallel": set(),
    "clients": {"strategies", "parallel"},
    "sims": {"strategies", "clients", "parallel"},
    "bench": {"strategies", "clients", "sims", "parallel"},
}
"""Folder -> the other parts its modules may import (each may import the core and
itself). The table of docs/architecture.md."""


def imported_modules(path: Path, package: str) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in ``path``, anywhere in it.

    ``package`` is the dotted package ``path`` belongs to, to resolve relative
    imports (``from ..sims import x`` inside ``flowerbed.strategies``).
    """
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            found.append((node.lineno, module))
            found += [(node.lineno, f"{module}.{a.name}") for a in node.names]
    return found


def package_of(path: Path, folder: str) -> str:
    """Dotted package of a module file under ``folder``."""
    rel = path.relative_to(ROOT / folder).parent
    top = "flowerbed" if folder == "core" else f"flowerbed.{folder}"
    return ".".join([top, *rel.parts])


def part_of(module: str) -> str | None:
    """The folder a ``flowerbed`` module lives in (None: not flowerbed)."""
    names = module.split(".")
    if names[0] != "flowerbed":
        return None
    if len(names) > 1 and names[1] in PARTS:
        return names[1]
    return "core"


def is_forbidden(module: str) -> bool:
    return any(module == f or module.startswith(f + ".") for f in FORBIDDEN)


def test_the_checker_sees_relative_and_function_level_imports(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text(
        "import os\n"
        "def f():\n"
        "    from flowerbed.sims import vclock\n"
        "    from ..bench import suite\n"
        "    import flowerbed.bench.cli\n"
        "from . import utils\n"
    )
    modules = [m for _, m in imported_modules(source, "flowerbed.strategies")]
    assert "flowerbed.sims" in modules
    assert "flowerbed.bench.suite" in modules
    assert "flowerbed.bench.cli" in modules
    assert "flowerbed.strategies.utils" in modules
    assert [m for m in modules if is_forbidden(m)] == [
        "flowerbed.sims",
        "flowerbed.sims.vclock",
        "flowerbed.bench",
        "flowerbed.bench.suite",
        "flowerbed.bench.cli",
    ]
    assert not is_forbidden("flowerbed.simsx")


@pytest.mark.parametrize("folder", sorted(GUARDED))
def test_folder_does_not_import_the_simulator_or_the_benchmark(folder: str) -> None:
    base = ROOT / folder
    if not base.is_dir():
        pytest.skip(f"{folder}/ does not exist yet")
    bad = [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for path in sorted(base.rglob("*.py"))
        for line, module in imported_modules(path, package_of(path, folder))
        if is_forbidden(module)
    ]
    assert bad == []


@pytest.mark.parametrize("folder", sorted(MAY_IMPORT))
def test_each_part_imports_only_what_the_architecture_page_allows(folder: str) -> None:
    base = ROOT / folder
    if not base.is_dir():
        pytest.skip(f"{folder}/ does not exist yet")
    allowed = MAY_IMPORT[folder] | {folder, "core"}
    bad = [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for path in sorted(base.rglob("*.py"))
        for line, module in imported_modules(path, package_of(path, folder))
        if part_of(module) not in allowed | {None}
    ]
    assert bad == []


def test_the_table_matches_the_architecture_page() -> None:
    page = (ROOT / "docs" / "architecture.md").read_text()
    for folder, allowed in MAY_IMPORT.items():
        names = ", ".join(sorted(allowed)) if allowed else "nothing else"
        assert f"| `{folder}/` | {names} |" in page, folder


# --- one name, one module --------------------------------------------------------

SOURCE_FOLDERS = ("core", "strategies", "clients", "sims", "bench", "parallel")
SHARED_NAMES = frozenset({"__init__.py", "__main__.py", "cli.py"})
"""Module names that mean the same role wherever they are. A module that moved
keeps its old import path through :mod:`flowerbed.moved`, without a file at the
old path, so deprecated aliases need no exception here."""


def duplicate_module_names(root: Path, folders: Iterable[str]) -> dict[str, list[str]]:
    """Module file name -> its paths, for names that occur more than once."""
    paths: dict[str, list[str]] = defaultdict(list)
    for folder in folders:
        for path in sorted((root / folder).rglob("*.py")):
            if path.name not in SHARED_NAMES:
                paths[path.name].append(path.relative_to(root).as_posix())
    return {name: found for name, found in paths.items() if len(found) > 1}


def test_the_name_checker_finds_a_repeated_module_name(tmp_path: Path) -> None:
    for name in ("a/data.py", "a/cli.py", "b/sub/data.py", "b/cli.py", "b/x.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    assert duplicate_module_names(tmp_path, ("a", "b")) == {
        "data.py": ["a/data.py", "b/sub/data.py"]
    }


def test_no_two_modules_share_a_name() -> None:
    assert duplicate_module_names(ROOT, SOURCE_FOLDERS) == {}


# --- a strategy's private attributes stay inside strategies/ ----------------------

OUTSIDE_STRATEGIES = ("sims", "bench", "clients", "parallel", "core")
FOREIGN_PRIVATE = {("parallel/group.py", "options._timeout")}
"""Reads of another library's private attribute whose name a strategy also uses
(torch's ``ProcessGroupGloo._Options._timeout``), not a strategy's state."""


def strategy_private_names(folder: Path) -> set[str]:
    """``_name`` of every private attribute (``self._name = ...``) and private
    method a class in ``folder`` defines."""
    names: set[str] = set()
    for path in folder.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name)
                and node.value.id == "self"
            ):
                names.add(node.attr)
            elif isinstance(node, ast.ClassDef):
                names |= {
                    item.name
                    for item in node.body
                    if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef)
                }
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def _looks_like_a_strategy(node: ast.expr) -> bool:
    """``strategy``, ``self.strategy``, ``inner_strategy`` ... (by name)."""
    name = node.id if isinstance(node, ast.Name) else getattr(node, "attr", "")
    return "strateg" in name.lower()


def private_strategy_reads(path: Path, private: set[str]) -> list[tuple[int, str]]:
    """(line, expression) of every ``x._name`` in ``path`` where ``x`` is
    (heuristically) a strategy: named like one, or ``_name`` is a private
    attribute of a strategy (``private``). An object's own (``self._x``,
    ``cls._x``) and dunder attributes are not reads of another's state."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if not (
            isinstance(node, ast.Attribute)
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ):
            continue
        if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            continue
        if _looks_like_a_strategy(node.value) or node.attr in private:
            found.append((node.lineno, ast.unparse(node)))
    return found


def test_the_private_read_checker_sees_strategy_state(tmp_path: Path) -> None:
    source = tmp_path / "harness.py"
    source.write_text(
        "def f(strategy, run, options):\n"
        "    a = strategy._global\n"
        "    b = run.strategy._sent\n"
        "    c = run._pending\n"
        "    d = options._unrelated\n"
        "    e = run.__class__\n"
        "    strategy.start()\n"
        "class H:\n"
        "    def g(self):\n"
        "        self._pending = 1\n"
        "        return self._pending\n"
    )
    assert private_strategy_reads(source, {"_pending"}) == [
        (2, "strategy._global"),
        (3, "run.strategy._sent"),
        (4, "run._pending"),
    ]


def test_the_private_names_are_collected_from_strategy_classes(tmp_path: Path) -> None:
    (tmp_path / "s.py").write_text(
        "class S:\n"
        "    def __init__(self):\n"
        "        self._inflight = None\n"
        "        self.public = 1\n"
        "    def _fold(self):\n"
        "        other._not_a_definition = 2\n"
    )
    assert strategy_private_names(tmp_path) == {"_inflight", "_fold"}


def test_nothing_outside_strategies_reads_a_strategy_s_private_attributes() -> None:
    private = strategy_private_names(ROOT / "strategies")
    bad = [
        f"{rel}:{line} reads {text}"
        for folder in OUTSIDE_STRATEGIES
        for path in sorted((ROOT / folder).rglob("*.py"))
        for rel in [path.relative_to(ROOT).as_posix()]
        for line, text in private_strategy_reads(path, private)
        if (rel, text) not in FOREIGN_PRIVATE
    ]
    assert bad == []
