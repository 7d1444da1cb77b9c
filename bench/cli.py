"""``flowerbed bench``: every fleet x strategy x seed, the machinery's cost, one report.

Runs the suite of :mod:`flowerbed.bench.suite` on the in-process engine (in
``--jobs`` worker processes), then the machinery measurements of
:mod:`flowerbed.bench.machinery`, and writes ``BENCHMARKS.md`` into ``--out``
and ``results.json`` plus one accuracy-vs-virtual-time PNG per fleet into
``--out/benchmarks/``. Every figure in the page is read from ``results.json`` of the
same run (:mod:`flowerbed.bench.report`).
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

FULL_NODES = 50
FULL_ROUNDS = 8
FULL_LOCAL_STEPS = 10
QUICK_NODES = 4
QUICK_ROUNDS = 2
QUICK_LOCAL_STEPS = 2
LEARNING_RATE = 0.05
TARGET_ACCURACY = 0.85
AGGREGATION_NODES = (10, 50, 138, 200)
QUICK_AGGREGATION_NODES = (2,)
QUICK_FLOATS = 100_000
GATEWAY_PHONES = 100
ENGINE_SCENARIO = {
    "fleet": "phones-10x",
    "num-nodes": 10,
    "num-rounds": 3,
    "strategy": "fedavg",
    "dropout": 0.0,
    "seed": 1,
}
"""The scenario both engines run for the wall-clock comparison (kept small: Ray
starts one worker per CPU and the SuperLink polls)."""
SELECTION_FLEETS = 30
QUICK_SELECTION_FLEETS = 3


@dataclass
class BenchPlan:
    """What one ``flowerbed bench`` invocation runs."""

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
    machinery: list[str] = field(default_factory=list)

    @property
    def cells(self) -> list[tuple[str, str, int]]:
        return [
            (f, s, seed)
            for seed in self.seeds
            for f in self.fleets
            for s in self.strategies
        ]


MACHINERY = ("aggregation", "engines", "client", "gateway", "selection")
"""Machinery parts, in the order they run."""


def register(subparsers: Any) -> None:
    from flowerbed.bench.suite import FLEETS, STRATEGIES

    p = subparsers.add_parser(
        "bench",
        help="benchmark strategies on unequal fleets and the machinery's cost",
        description="Run every fleet x strategy x seed on the in-process engine "
        "(virtual time), measure the machinery (aggregation, engines, client "
        "metering, gateway memory, cluster selection), and write BENCHMARKS.md, "
        "benchmarks/results.json and benchmarks/accuracy-<fleet>.png into --out.",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"tiny run ({QUICK_NODES} nodes, {QUICK_ROUNDS} rounds, 1 seed, toy "
        "machinery sizes, no Ray and no gateway): proves the suite works",
    )
    p.add_argument("--seeds", type=int, help="seeds per cell (default 3; quick 1)")
    p.add_argument("--out", default="docs", help="output folder (default docs)")
    p.add_argument("--nodes", type=int, help=f"nodes per fleet (default {FULL_NODES})")
    p.add_argument("--rounds", type=int, help=f"rounds per run (default {FULL_ROUNDS})")
    p.add_argument(
        "--fleets",
        help=f"comma-separated subset of: {', '.join(FLEETS)} (default all)",
    )
    p.add_argument(
        "--strategies",
        help=f"comma-separated subset of: {', '.join(STRATEGIES)} (default all)",
    )
    p.add_argument(
        "--machinery",
        help=f"comma-separated subset of: {', '.join(MACHINERY)}, or 'none' "
        "(default all)",
    )
    p.add_argument(
        "--jobs",
        type=int,
        help="worker processes for the suite (default: CPU count; quick: 1)",
    )
    p.set_defaults(func=run)


def _split(text: str | None) -> list[str] | None:
    if text is None:
        return None
    return [t.strip() for t in text.split(",") if t.strip()]


def plan_from_args(args: argparse.Namespace) -> BenchPlan:
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
    machinery_arg = _split(args.machinery)
    if machinery_arg == ["none"]:
        machinery: list[str] = []
    else:
        machinery = resolve(
            machinery_arg or MACHINERY, dict.fromkeys(MACHINERY), "machinery part"
        )
    return BenchPlan(
        fleets=resolve(_split(args.fleets) or FLEETS, FLEETS, "fleet"),
        strategies=resolve(
            _split(args.strategies) or STRATEGIES, STRATEGIES, "strategy"
        ),
        seeds=list(range(1, seeds + 1)),
        num_nodes=nodes,
        num_rounds=rounds,
        local_steps=QUICK_LOCAL_STEPS if quick else FULL_LOCAL_STEPS,
        learning_rate=LEARNING_RATE,
        target=TARGET_ACCURACY,
        jobs=jobs,
        quick=quick,
        machinery=machinery,
    )


def machine_info() -> dict[str, Any]:
    """CPU model, cores, memory and load average, read now."""
    model = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = 0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem = int(line.split()[1]) * 1024
    except OSError:
        pass
    return {
        "cpu_model": model,
        "cpu_count": os.cpu_count(),
        "memory_bytes": mem,
        "load_average": list(os.getloadavg()),
        "platform": platform.platform(),
    }


def versions() -> dict[str, str]:
    import flowerbed
    import flwr
    import numpy
    import torch

    return {
        "flowerbed": flowerbed.__version__,
        "flwr": flwr.__version__,
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "python": platform.python_version(),
    }


def _quiet() -> None:
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

    _quiet()
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
    plan: BenchPlan, on_done: Callable[[dict[str, Any]], None]
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


def run_machinery(plan: BenchPlan, part: str, app_dir: Path) -> dict[str, Any]:
    """One machinery part at the plan's size; failures are recorded, not raised."""
    from flowerbed.bench import machinery as m
    from flowerbed.bench.aggregation import RESNET50_FLOATS

    started = time.monotonic()
    try:
        if part == "aggregation":
            out = m.aggregation_cost(
                QUICK_AGGREGATION_NODES if plan.quick else AGGREGATION_NODES,
                QUICK_FLOATS if plan.quick else RESNET50_FLOATS,
            )
        elif part == "engines":
            out = (
                {"skipped": "--quick does not start Ray"}
                if plan.quick
                else m.engine_wallclock(dict(ENGINE_SCENARIO), app_dir)
            )
        elif part == "client":
            out = m.client_overhead(repeats=3 if plan.quick else 30)
        elif part == "gateway":
            out = (
                {"skipped": "--quick does not start a gateway"}
                if plan.quick
                else m.gateway_memory(GATEWAY_PHONES)
            )
        elif part == "selection":
            out = m.selection(
                QUICK_SELECTION_FLEETS if plan.quick else SELECTION_FLEETS,
                seed=0,
                truth_rounds=2 if plan.quick else 2000,
                num_rounds=10 if plan.quick else 100,
            )
        else:
            raise ValueError(f"unknown machinery part {part!r}")
    except Exception as err:  # recorded in the report
        out = {"error": f"{type(err).__name__}: {err}"}
    out["part_wall_s"] = time.monotonic() - started
    return out


def app_root() -> Path:
    """The Flower app folder (the repository root holding pyproject.toml)."""
    return Path(__file__).resolve().parents[1]


def bench(plan: BenchPlan, out_dir: Path, command: str, console: Any) -> dict[str, Any]:
    """Run the plan with a progress bar; write the report; return results.json."""
    from flowerbed.bench import report as bench_report
    from flowerbed.bench import suite as bench_suite
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    started_at = datetime.now(timezone.utc)
    started = time.monotonic()
    machine = machine_info()
    _quiet()
    progress = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[last]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
    )
    results: dict[str, Any] = {
        "created": started_at.isoformat(timespec="seconds"),
        "command": command,
        "machine": machine,
        "versions": versions(),
        "settings": {
            **{k: v for k, v in asdict(plan).items() if k != "jobs"},
            "jobs": plan.jobs,
            "reference": bench_suite.REFERENCE,
            "fleet_descriptions": {
                f: asdict(bench_suite.FLEETS[f]) for f in plan.fleets
            },
            "strategy_descriptions": {
                s: bench_suite.STRATEGIES[s].description for s in plan.strategies
            },
        },
    }
    with progress:
        suite = progress.add_task("suite", total=len(plan.cells), last="")

        def done(cell: dict[str, Any]) -> None:
            status = "error" if "error" in cell else f"{cell['run_wall_s']:.0f}s"
            progress.update(
                suite,
                advance=1,
                last=f"{cell['fleet']} / {cell['strategy']} / seed {cell['seed']}: "
                f"{status}",
            )

        cells = run_suite(plan, done)
        machinery: dict[str, Any] = {}
        if plan.machinery:
            parts = progress.add_task("machinery", total=len(plan.machinery), last="")
            for part in plan.machinery:
                progress.update(parts, last=part)
                machinery[part] = run_machinery(plan, part, app_root())
                progress.update(parts, advance=1)
    ok = [c for c in cells if "error" not in c]
    summary = bench_suite.summarise_cells(ok)
    results.update(
        cells=cells,
        errors=[c for c in cells if "error" in c],
        summary=summary,
        headline=bench_suite.headline(ok, summary),
        machinery={k: v for k, v in machinery.items() if k != "selection"},
        selection=machinery.get("selection", {"skipped": "not run (--machinery)"}),
        wall_s=time.monotonic() - started,
    )
    bench_report.write(results, out_dir)
    return results


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    console = Console()
    try:
        plan = plan_from_args(args)
    except ValueError as err:
        console.print(f"[red]flowerbed bench: error:[/red] {err}")
        return 2
    command = "flowerbed " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    results = bench(plan, Path(args.out), command, console)
    from flowerbed.bench.report import headline_sentence

    console.print(headline_sentence(results["headline"]))
    errors = results["errors"]
    if errors:
        console.print(f"[yellow]{len(errors)} runs failed; see BENCHMARKS.md[/yellow]")
    console.print(
        f"wrote {Path(args.out) / 'BENCHMARKS.md'} and "
        f"{Path(args.out) / 'benchmarks'} in {results['wall_s'] / 60:.1f} min"
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    from flowerbed.cli import main as cli_main

    return cli_main(["bench", *(argv or [])])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
