"""The layout's arrows point one way (docs/architecture.md, "Packages").

strategies/ and parallel/ never import the simulator (flowerbed.sims) or the
benchmark (flowerbed.bench); nothing but the benchmark imports the benchmark; the
core imports no other part. Imports are read with ``ast`` from the source, so an
import inside a function counts as much as one at the top of a module.
"""

from __future__ import annotations

import ast
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
