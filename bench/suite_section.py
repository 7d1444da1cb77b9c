"""Section "suite": every fleet x strategy x seed on the in-process engine.

Runs :func:`flowerbed.bench.suite.run_cell` for each cell (in ``--jobs`` worker
processes), summarises the seeds, picks the headline, and plots accuracy against
virtual time per fleet. Its options: ``--seeds``, ``--nodes``, ``--rounds``,
``--fleets``, ``--strategies``, ``--jobs``.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from typing import Any

from .sections import SectionRun

TITLE = "Strategies on unequal fleets"
FULL_NODES = 50
FULL_ROUNDS = 8
FULL_LOCAL_STEPS = 10
QUICK_NODES = 4
QUICK_ROUNDS = 2
QUICK_LOCAL_STEPS = 2
LEARNING_RATE = 0.05
TARGET_ACCURACY = 0.85


@dataclass
class SuitePlan:
    """The cells one run of the section measures."""

    fleets: list[str]
    strategies: list[str]
    seeds: list[int]
    num_nodes: int
    num_rounds: int
    local_steps: int
    learning_rate: float
    target: float
    jobs: int
    quick: bool

    @property
    def cells(self) -> list[tuple[str, str, int]]:
        return [
            (f, s, seed)
            for seed in self.seeds
            for f in self.fleets
            for s in self.strategies
        ]


def add_arguments(p: argparse.ArgumentParser) -> None:
    from flowerbed.bench.suite import FLEETS, STRATEGIES

    g = p.add_argument_group("suite section")
    g.add_argument("--seeds", type=int, help="seeds per cell (default 3; quick 1)")
    g.add_argument("--nodes", type=int, help=f"nodes per fleet (default {FULL_NODES})")
    g.add_argument("--rounds", type=int, help=f"rounds per run (default {FULL_ROUNDS})")
    g.add_argument(
        "--fleets",
        help=f"comma-separated subset of: {', '.join(FLEETS)} (default all)",
    )
    g.add_argument(
        "--strategies",
        help=f"comma-separated subset of: {', '.join(STRATEGIES)} (default all)",
    )
    g.add_argument(
        "--jobs",
        type=int,
        help="worker processes for the suite (default: CPU count; quick: 1)",
    )


def split(text: str | None) -> list[str] | None:
    """A comma-separated option as a list (None when not given)."""
    if text is None:
        return None
    return [t.strip() for t in text.split(",") if t.strip()]


def plan_from_args(args: argparse.Namespace) -> SuitePlan:
    """Check the options; raise ``ValueError`` naming the bad one."""
    from flowerbed.bench.suite import FLEETS, STRATEGIES, resolve

    quick = bool(args.quick)
    seeds = args.seeds if args.seeds is not None else (1 if quick else 3)
    nodes = (
        args.nodes if args.nodes is not None else (QUICK_NODES if quick else FULL_NODES)
    )
    rounds = (
        args.rounds
        if args.rounds is not None
        else (QUICK_ROUNDS if quick else FULL_ROUNDS)
    )
    jobs = args.jobs if args.jobs is not None else (1 if quick else os.cpu_count() or 1)
    for name, value, low in (
        ("--seeds", seeds, 1),
        ("--nodes", nodes, 2),
        ("--rounds", rounds, 1),
        ("--jobs", jobs, 1),
    ):
        if value < low:
            raise ValueError(f"{name} must be >= {low}, got {value}")
    return SuitePlan(
        fleets=resolve(split(args.fleets) or FLEETS, FLEETS, "fleet"),
        strategies=resolve(
            split(args.strategies) or STRATEGIES, STRATEGIES, "strategy"
        ),
        seeds=list(range(1, seeds + 1)),
        num_nodes=nodes,
        num_rounds=rounds,
        local_steps=QUICK_LOCAL_STEPS if quick else FULL_LOCAL_STEPS,
        learning_rate=LEARNING_RATE,
        target=TARGET_ACCURACY,
        jobs=jobs,
        quick=quick,
    )


def check(args: argparse.Namespace) -> None:
    plan_from_args(args)


def quiet() -> None:
    """Keep Flower's per-reply logging out of the progress display."""
    for name in ("flwr", "flowerbed"):
        logging.getLogger(name).setLevel(logging.ERROR)


def _cell(
    fleet: str,
    strategy: str,
    seed: int,
    nodes: int,
    rounds: int,
    steps: int,
    lr: float,
    target: float,
) -> dict[str, Any]:
    from flowerbed.bench.suite import run_cell

    quiet()
    started = time.monotonic()
    try:
        out = run_cell(
            fleet,
            strategy,
            seed,
            num_nodes=nodes,
            num_rounds=rounds,
            local_steps=steps,
            learning_rate=lr,
            target=target,
        )
    except Exception as err:  # a crashing strategy is a result, not the end
        out = {
            "fleet": fleet,
            "strategy": strategy,
            "seed": seed,
            "error": f"{type(err).__name__}: {err}",
        }
    out["run_wall_s"] = time.monotonic() - started
    return out


def run_suite(
    plan: SuitePlan, on_done: Callable[[dict[str, Any]], None]
) -> list[dict[str, Any]]:
    """Run every cell (``plan.jobs`` processes); ``on_done`` is called per cell."""
    args = [
        (
            f,
            s,
            seed,
            plan.num_nodes,
            plan.num_rounds,
            plan.local_steps,
            plan.learning_rate,
            plan.target,
        )
        for f, s, seed in plan.cells
    ]
    cells: list[dict[str, Any]] = []
    if plan.jobs == 1:
        for a in args:
            cells.append(_cell(*a))
            on_done(cells[-1])
        return cells
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(plan.jobs, mp_context=context) as pool:
        futures = [pool.submit(_cell, *a) for a in args]
        for future in as_completed(futures):
            cells.append(future.result())
            on_done(cells[-1])
    order = {c: i for i, c in enumerate(plan.cells)}
    cells.sort(key=lambda c: order[(c["fleet"], c["strategy"], c["seed"])])
    return cells


def run(ctx: SectionRun) -> dict[str, Any]:
    from flowerbed.bench import suite
    from flowerbed.bench.report import plot_fleet

    plan = plan_from_args(ctx.args)
    step = ctx.tracker(len(plan.cells))

    def done(cell: dict[str, Any]) -> None:
        status = "error" if "error" in cell else f"{cell['run_wall_s']:.0f}s"
        step(f"{cell['fleet']} / {cell['strategy']} / seed {cell['seed']}: {status}")

    cells = run_suite(plan, done)
    ok = [c for c in cells if "error" not in c]
    summary = suite.summarise_cells(ok)
    for fleet in plan.fleets:
        plot_fleet(ok, fleet, ctx.data_dir / f"accuracy-{fleet}.png")
    return {
        "settings": {
            **asdict(plan),
            "reference": suite.REFERENCE,
            "fleet_descriptions": {f: asdict(suite.FLEETS[f]) for f in plan.fleets},
            "strategy_descriptions": {
                s: suite.STRATEGIES[s].description for s in plan.strategies
            },
        },
        "cells": cells,
        "errors": [c for c in cells if "error" in c],
        "summary": summary,
        "headline": suite.headline(ok, summary),
    }


def render(data: Mapping[str, Any]) -> list[str]:
    from flowerbed.bench import report

    return report.suite_lines(data)
