"""The sections of ``flowerbed bench``: what each measures and how it is shown.

``results.json`` holds one entry per section, and BENCHMARKS.md is rebuilt from
every section present, so one section can be regenerated without losing the
others (``flowerbed bench --sections selection``).

Adding a section
----------------
1. Write a module in ``bench/`` (import nothing heavy at its top: ``flowerbed
   bench --help`` imports it) with::

       TITLE = "Pipeline training"           # shown in progress and the run list

       def run(ctx: SectionRun) -> dict[str, Any]:
           '''Measure; return JSON-able data (the section's entry).'''

       def render(data: Mapping[str, Any]) -> list[str]:
           '''Markdown lines of the section, its own "## ..." heading first.'''

   ``render`` formats every figure and verdict from ``data``; its other text
   must be true of every run (no figures, dates or verdicts of one run written
   into it). A section whose figures a target judges records ``ctx.quick`` in
   its data where those figures live, and ``render`` judges no target on
   quick data: toy sizes check structure, they measure nothing.

   and, when the section has options of its own::

       def add_arguments(parser: argparse.ArgumentParser) -> None: ...
       def check(args: argparse.Namespace) -> None:
           '''Raise ValueError naming a bad option (called before anything runs).'''
       def choices() -> list[str]:
           '''Lines naming what the options take (``flowerbed bench --list``);
           may import the section's heavy modules, add_arguments may not.'''

   ``ctx`` (:class:`SectionRun`) gives the parsed options (``ctx.args``),
   ``ctx.quick``, the folder for files the page links to (``ctx.data_dir``,
   link them as ``benchmarks/<file>``), the section's previous entry
   (``ctx.previous``, to merge a partial rerun) and a progress bar
   (``ctx.tracker(total)``). A section that fails records ``{"error": ...}``;
   ``render`` is also given such entries.
2. Add one line to :data:`SECTIONS` below, in the order of the page.
3. A test runs its ``run`` at a toy size (``--quick``) and checks ``render``.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

SECTIONS: dict[str, str] = {
    "suite": "flowerbed.bench.suite_section",
    "machinery": "flowerbed.bench.machinery_section",
    "selection": "flowerbed.bench.selection_section",
    "large-batch": "flowerbed.bench.large_batch_section",
    "tiles": "flowerbed.bench.tiles_section",
    "pipeline": "flowerbed.bench.pipeline_section",
}
"""Section name -> module, in the order of the page."""


def app_root() -> Path:
    """The source checkout holding flowerbed (pyproject.toml, docs/): the Flower
    app folder ``flwr run`` needs."""
    return Path(__file__).resolve().parents[1]


def section_module(name: str) -> ModuleType:
    """The module of a registered section."""
    if name not in SECTIONS:
        raise ValueError(
            f"unknown section {name!r}; valid choices: {', '.join(SECTIONS)}"
        )
    return importlib.import_module(SECTIONS[name])


@dataclass(frozen=True)
class PartsOption:
    """A section's ``--<option>``: a comma-separated subset of its ``parts``.

    Its methods are the section's ``add_arguments``, ``check`` and ``choices``
    (``add_arguments = OPTION.add_arguments`` in the section's module).
    """

    option: str
    parts: tuple[str, ...]
    note: str = ""
    """Ends the option's help."""

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        """The option, in the argument group ``"<option> section"``."""
        g = p.add_argument_group(f"{self.option} section")
        g.add_argument(
            f"--{self.option}",
            help=f"comma-separated subset of: {', '.join(self.parts)} "
            f"(default all){self.note}",
        )

    def choices(self) -> list[str]:
        """What ``--<option>`` takes (``flowerbed bench --list``)."""
        return [f"--{self.option}: {', '.join(self.parts)}"]

    def chosen(self, args: argparse.Namespace) -> list[str]:
        """The parts ``--<option>`` names (all ``parts`` when it is not given);
        ``ValueError`` naming an unknown one."""
        raw = getattr(args, self.option.replace("-", "_"), None)
        if not raw:
            return list(self.parts)
        chosen = [p.strip() for p in raw.split(",") if p.strip()]
        for part in chosen:
            if part not in self.parts:
                raise ValueError(
                    f"unknown {self.option} part {part!r}; valid choices: "
                    f"{', '.join(self.parts)}"
                )
        return chosen

    def check(self, args: argparse.Namespace) -> None:
        """``ValueError`` if ``--<option>`` names an unknown part."""
        self.chosen(args)


@dataclass
class SectionRun:
    """What a section's ``run`` is given."""

    name: str
    args: argparse.Namespace
    """Every parsed ``flowerbed bench`` option (the section's own included)."""
    data_dir: Path
    """Folder for files the page links to (``benchmarks/`` beside the page)."""
    previous: Mapping[str, Any] | None = None
    """The section's entry in the results.json being updated, if any."""
    progress: Any = None
    """A ``rich.progress.Progress`` (None: no display)."""
    _tasks: list[Any] = field(default_factory=list)

    @property
    def quick(self) -> bool:
        """``--quick``: toy sizes that prove the section works."""
        return bool(getattr(self.args, "quick", False))

    def tracker(self, total: int) -> Callable[[str], None]:
        """A progress bar of ``total`` steps; call the result once per step done,
        with a short note of what finished."""
        if self.progress is None:
            return lambda note: None
        task = self.progress.add_task(self.name, total=total, last="")
        self._tasks.append(task)

        def step(note: str) -> None:
            self.progress.update(task, advance=1, last=note)

        return step
