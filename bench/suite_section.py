"""Section "suite": every workload x configuration x seed on the in-process engine.

Runs :func:`flowerbed.bench.suite.run_cell` for each cell (in ``--jobs`` worker
processes), summarises the seeds per workload, compares the best flowerbed
default with the best-tuned Flower configuration, checks the targets, and plots
median accuracy against virtual time per workload. Its options: ``--seeds``,
``--workloads``, ``--strategies``, ``--jobs``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .sections import SectionRun

TITLE = "Strategies on unequal fleets"
CELLS_FILE = "suite-cells.jsonl"
"""Every finished cell, one JSON line each, written as it finishes: an interrupted
run loses nothing (``--resume``)."""
FULL_SEEDS = 5
QUICK_SEEDS = 1


@dataclass
class SuitePlan:
    """The cells one run of the section measures."""

    workloads: list[str]
    strategies: list[str]
    seeds: list[int]
    jobs: int
    quick: bool

    @property
    def cells(self) -> list[tuple[str, str, int]]:
        """(workload, strategy, seed); a workload with ``max_seeds`` takes only
        that many of :attr:`seeds`."""
        from flowerbed.bench.suite import WORKLOADS

        def seeds_of(w: str) -> list[int]:
            limit = WORKLOADS[w].max_seeds
            return self.seeds[:limit] if limit else self.seeds

        return [
            (w, s, seed)
            for seed in self.seeds
            for w in self.workloads
            if seed in seeds_of(w)
            for s in self.strategies
        ]


def choices() -> list[str]:
    """What ``--workloads`` and ``--strategies`` take (``flowerbed bench --list``)."""
    from flowerbed.bench.suite import CONFIGS, DEFAULT_CONFIGS, WORKLOADS

    return [
        f"--workloads: {', '.join(WORKLOADS)}",
        f"--strategies: {', '.join(CONFIGS)} (default: {', '.join(DEFAULT_CONFIGS)})",
    ]


def add_arguments(p: argparse.ArgumentParser) -> None:
    # No names here: listing them imports the suite (torch, Flower); --list does.
    g = p.add_argument_group("suite section")
    g.add_argument(
        "--seeds",
        type=int,
        help=f"seeds per cell (default {FULL_SEEDS}; quick {QUICK_SEEDS})",
    )
    g.add_argument(
        "--workloads",
        help="comma-separated subset of the workloads (default all; --list names them)",
    )
    g.add_argument(
        "--strategies",
        help="comma-separated subset of the strategy configurations (default: "
        "every one but the variants; --list names them)",
    )
    g.add_argument(
        "--jobs",
        type=int,
        help="worker processes for the suite and selection sections (default: "
        "CPU count)",
    )
    g.add_argument(
        "--resume",
        action="store_true",
        help=f"reuse the cells an interrupted run finished (benchmarks/{CELLS_FILE}, "
        "same workload settings) instead of running them again",
    )


def split(text: str | None) -> list[str] | None:
    """A comma-separated option as a list (None when not given)."""
    if text is None:
        return None
    return [t.strip() for t in text.split(",") if t.strip()]


def plan_from_args(args: argparse.Namespace) -> SuitePlan:
    """Check the options; raise ``ValueError`` naming the bad one."""
    from flowerbed.bench.suite import CONFIGS, DEFAULT_CONFIGS, WORKLOADS, resolve

    quick = bool(args.quick)
    seeds = (
        args.seeds if args.seeds is not None else (QUICK_SEEDS if quick else FULL_SEEDS)
    )
    jobs = args.jobs if args.jobs is not None else os.cpu_count() or 1
    for name, value in (("--seeds", seeds), ("--jobs", jobs)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    return SuitePlan(
        workloads=resolve(split(args.workloads) or WORKLOADS, WORKLOADS, "workload"),
        strategies=resolve(
            split(args.strategies) or DEFAULT_CONFIGS, CONFIGS, "strategy"
        ),
        seeds=list(range(1, seeds + 1)),
        jobs=jobs,
        quick=quick,
    )


def check(args: argparse.Namespace) -> None:
    plan_from_args(args)


def quiet() -> None:
    """Keep Flower's per-reply logging out of the progress display."""
    for name in ("flwr", "flowerbed"):
        logging.getLogger(name).setLevel(logging.ERROR)


def _cell(workload: str, config: str, seed: int, quick: bool) -> dict[str, Any]:
    from flowerbed.bench import suite

    quiet()
    started = time.monotonic()
    try:
        w = suite.WORKLOADS[workload]
        if quick:
            w = suite.quick_workload(w)
        c = suite.CONFIGS[config]
        timeout = None
        if c.quantile is not None:
            times = suite.task_seconds(suite.scenario_of(w, seed))
            timeouts = suite.quantile_timeouts(times)
            if c.quantile not in timeouts:
                return {
                    "workload": workload,
                    "config": config,
                    "seed": seed,
                    "skipped": "same timeout as a lower quantile on this fleet",
                    "run_wall_s": time.monotonic() - started,
                }
            timeout = timeouts[c.quantile]
        out = suite.run_cell(w, c, seed, timeout)
    except Exception as err:  # a crashing strategy is a result, not the end
        out = {
            "workload": workload,
            "config": config,
            "seed": seed,
            "error": f"{type(err).__name__}: {err}",
        }
    out["run_wall_s"] = time.monotonic() - started
    return out


def cell_key(workload: Mapping[str, Any], config: str, seed: int) -> str:
    """What makes a finished cell reusable: the workload's settings, the
    configuration and the seed."""
    return json.dumps([dict(workload), config, seed], sort_keys=True)


def load_cells(path: Path) -> dict[str, dict[str, Any]]:
    """Finished cells of an earlier run by :func:`cell_key` (a torn last line is
    ignored)."""
    out: dict[str, dict[str, Any]] = {}
    if not path.is_file():
        return out
    for line in path.read_text().splitlines():
        try:
            entry = json.loads(line)
            out[entry["key"]] = entry["cell"]
        except (ValueError, KeyError, TypeError):
            continue
    return out


def run_suite(
    plan: SuitePlan,
    on_done: Callable[[dict[str, Any]], None],
    done_before: Mapping[tuple[str, str, int], dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """Run every cell (``plan.jobs`` processes) but those in ``done_before``;
    ``on_done`` is called per cell run."""
    done_before = done_before or {}
    args = [
        (w, s, seed, plan.quick)
        for w, s, seed in plan.cells
        if (w, s, seed) not in done_before
    ]
    cells: list[dict[str, Any]] = list(done_before.values())
    if plan.jobs == 1 or len(args) <= 1:
        for a in args:
            cells.append(_cell(*a))
            on_done(cells[-1])
    else:
        import multiprocessing

        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(plan.jobs, mp_context=context) as pool:
            futures = [pool.submit(_cell, *a) for a in args]
            for future in as_completed(futures):
                cells.append(future.result())
                on_done(cells[-1])
    order = {c: i for i, c in enumerate(plan.cells)}
    cells.sort(key=lambda c: order[(c["workload"], c["config"], c["seed"])])
    return cells


def full_run_seconds(data: Mapping[str, Any], wall_s: float) -> float:
    """What a full ``flowerbed bench`` would spend on the suite: its default
    configurations' cells (variants are opt-in), each at its own recorded run
    time (resumed cells too), spread over the run's worker processes (at most
    the machine's cores)."""
    cells = [c for c in data.get("cells", []) if c.get("family") != "variant"]
    return _cells_seconds(data, cells) if cells else wall_s


def opt_in_seconds(data: Mapping[str, Any]) -> float:
    """What the variant rows this page holds (``--strategies``) add, as
    :func:`full_run_seconds` counts them."""
    cells = [c for c in data.get("cells", []) if c.get("family") == "variant"]
    return _cells_seconds(data, cells)


def _cells_seconds(data: Mapping[str, Any], cells: list[Mapping[str, Any]]) -> float:
    jobs = data.get("settings", {}).get("jobs") or os.cpu_count() or 1
    return sum(float(c.get("run_wall_s", 0.0)) for c in cells) / min(
        int(jobs), os.cpu_count() or 1
    )


def run(ctx: SectionRun) -> dict[str, Any]:
    from flowerbed.bench import suite
    from flowerbed.bench.report import plot_workload

    plan = plan_from_args(ctx.args)
    workloads = {
        w: suite.quick_workload(suite.WORKLOADS[w])
        if plan.quick
        else suite.WORKLOADS[w]
        for w in plan.workloads
    }
    described = {w: suite.workload_description(wl) for w, wl in workloads.items()}
    path = ctx.data_dir / CELLS_FILE
    earlier = load_cells(path) if getattr(ctx.args, "resume", False) else {}
    done_before = {}
    for w, c, seed in plan.cells:
        found = earlier.get(cell_key(described[w], c, seed))
        if found is not None and "error" not in found:
            done_before[(w, c, seed)] = found
    if not done_before:
        path.unlink(missing_ok=True)
    step = ctx.tracker(len(plan.cells) - len(done_before))

    def done(cell: dict[str, Any]) -> None:
        key = cell_key(described[cell["workload"]], cell["config"], cell["seed"])
        with path.open("a") as fh:
            fh.write(json.dumps({"key": key, "cell": cell}) + "\n")
        status = "error" if "error" in cell else f"{cell['run_wall_s']:.0f}s"
        step(f"{cell['workload']} / {cell['config']} / seed {cell['seed']}: {status}")

    cells = run_suite(plan, done, done_before)
    ok = [c for c in cells if "error" not in c and "skipped" not in c]
    for workload in plan.workloads:
        if any(c["workload"] == workload for c in ok):
            plot_workload(ok, workload, ctx.data_dir / f"accuracy-{workload}.png")
    return {
        "settings": {
            **asdict(plan),
            "workload_descriptions": described,
            "ceilings": {
                w: suite.synthetic_ceilings(wl.population)
                for w, wl in workloads.items()
                if wl.dataset == "synthetic" and wl.model == "logreg" and not plan.quick
            },
            "resumed_cells": len(done_before),
            "strategy_descriptions": {
                s: suite.CONFIGS[s].description for s in plan.strategies
            },
            "strategy_families": {s: suite.CONFIGS[s].family for s in plan.strategies},
        },
        "cells": cells,
        "errors": [c for c in cells if "error" in c],
        **suite.analyse(plan.workloads, ok, plan.quick),
    }


def render(data: Mapping[str, Any]) -> list[str]:
    from flowerbed.bench import report

    return report.suite_lines(data)
