"""``flowerbed sim``: run a scenario on the in-process fleet engine."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Iterable
from typing import Any

from flowerbed.sims.config import ConfigError, Scenario

OPTION_KEYS = {
    "fleet": "fleet",
    "nodes": "num-nodes",
    "rounds": "num-rounds",
    "strategy": "strategy",
    "model": "model",
    "dataset": "dataset",
    "data_dir": "data-dir",
    "partition": "partition",
    "alpha": "alpha",
    "seed": "seed",
    "target": "target-accuracy",
    "out": "output-dir",
    "local_steps": "local-steps",
    "dropout": "dropout",
    "deadline": "deadline-s",
}


def register(subparsers: Any) -> None:
    from flowerbed.data import DATASETS, PARTITIONS
    from flowerbed.sims.config import LIMITS, STRATEGY_NAMES
    from flowerbed.sims.fleet import FLEETS
    from flowerbed.zoo import MODEL_NAMES

    p = subparsers.add_parser(
        "sim",
        help="simulate a heterogeneous fleet on the in-process engine",
        description="Train on a simulated fleet of unequal devices. Time is virtual: "
        "each node reports how long its device would have taken. Writes a run "
        "folder (results.json, rounds.csv, accuracy.png). Every option is a "
        "run-config key of `flwr run .` (docs/simulation.md); -c takes them in "
        "Flower's syntax.",
        epilog=f"fleets: {', '.join(FLEETS)}. strategies: {', '.join(STRATEGY_NAMES)}. "
        f"models: {', '.join(MODEL_NAMES)}. datasets: {', '.join(DATASETS)} "
        f"(mnist and cifar10 from --data-dir). partitions: {', '.join(PARTITIONS)}.",
    )
    d = Scenario()

    def ranged(option: str, what: str, default: object) -> str:
        limits = LIMITS[OPTION_KEYS[option]].describe()
        return f"{what}, {limits} (default {default})"

    def named(what: str, names: Iterable[str], default: object) -> str:
        return f"{what}: {', '.join(names)} (default {default})"

    helps: dict[str, tuple[type, str]] = {
        "fleet": (str, named("fleet mix", FLEETS, d.fleet)),
        "nodes": (int, ranged("nodes", "number of nodes", d.num_nodes)),
        "rounds": (int, ranged("rounds", "rounds", d.num_rounds)),
        "strategy": (str, named("strategy", STRATEGY_NAMES, d.strategy)),
        "model": (str, named("model", MODEL_NAMES, d.model)),
        "dataset": (str, named("dataset", DATASETS, d.dataset)),
        "data_dir": (str, "folder holding the mnist or cifar10 files"),
        "partition": (str, named("data partition", PARTITIONS, d.partition)),
        "alpha": (float, ranged("alpha", "Dirichlet alpha", d.alpha)),
        "seed": (int, ranged("seed", "random seed", d.seed)),
        "target": (float, ranged("target", "target accuracy", d.target_accuracy)),
        "local_steps": (
            int,
            ranged("local_steps", "local steps per task", d.local_steps),
        ),
        "dropout": (
            float,
            "per-task dropout probability for every node, <= 1; negative: the "
            "device profiles' own rates (default)",
        ),
        "deadline": (float, ranged("deadline", "deadline-s sent to nodes", 0)),
        "out": (str, f"output folder, created if missing (default {d.output_dir})"),
    }
    for option, (kind, text) in helps.items():
        p.add_argument(f"--{option.replace('_', '-')}", type=kind, help=text)
    p.add_argument(
        "-c",
        "--run-config",
        "--config",
        dest="config",
        action="append",
        default=[],
        metavar="CONFIG",
        help="run config exactly as `flwr run -c` takes it: space-separated "
        "key=value pairs with TOML values (strings quoted: "
        "\"fleet='phones-10x' num-rounds=20\"), or a .toml file; repeatable; "
        "options above win",
    )
    p.add_argument(
        "--check",
        action="store_true",
        help="check the run config, the data and its partition (every node gets "
        "samples), the memory of the population and a round, and the output "
        "folder, then exit without training or writing anything (0: the same run "
        "would start; under a second of CPU, where flwr run needs Ray's start-up to "
        "refuse a value and refuses an unknown key without naming it)",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="show Flower's log")
    p.set_defaults(func=run)

    dl = subparsers.add_parser(
        "download",
        help="fetch MNIST or CIFAR-10 once into a folder (needs torchvision)",
        description="Download MNIST or CIFAR-10 with torchvision into DIR, for "
        "`--data-dir DIR` / run config data-dir. Needs torchvision built for the "
        "installed torch: from a checkout, pip install -e '.[vision]'.",
    )
    dl.add_argument("dataset", help="mnist or cifar10")
    dl.add_argument("data_dir", metavar="DIR", help="folder to fill")
    dl.set_defaults(func=run_download)


def run_download(args: argparse.Namespace) -> int:
    from flowerbed.data import DataError, download

    try:
        root = download(args.dataset, args.data_dir)
    except (ValueError, DataError) as err:
        print(f"flowerbed download: error: {err}", file=sys.stderr)
        return 2
    print(f"{args.dataset} is in {root}; use --data-dir {root}")
    return 0


def parse_run_config(items: list[str]) -> dict[str, Any]:
    """``-c`` values parsed by Flower's own parser (``flwr run -c``'s syntax)."""
    if not items:
        return {}
    import click
    from flwr.common.config import parse_config_args

    try:
        return dict(parse_config_args(items or None))
    except click.ClickException as err:
        raise ConfigError(f"-c {' '.join(items)!r}: {err.message}") from None
    except (OSError, ValueError) as err:
        raise ConfigError(f"-c {' '.join(items)!r}: {err}") from None


def run_config_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The run config: ``-c`` first, then the options given (they win)."""
    config = parse_run_config(args.config)
    for option, key in OPTION_KEYS.items():
        value = getattr(args, option)
        if value is not None:
            config[key] = value
    return config


def error_line(err: ConfigError, args: argparse.Namespace) -> str:
    """The one error line, naming the option the user typed for the key."""
    for option, key in OPTION_KEYS.items():
        if key == err.key and getattr(args, option, None) is not None:
            return f"--{option.replace('_', '-')}: {err}"
    return str(err)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    console = Console()
    try:
        scenario = Scenario.from_run_config(run_config_from_args(args))
    except ConfigError as err:
        print(f"flowerbed sim: error: {error_line(err, args)}", file=sys.stderr)
        return 2
    if args.check:
        return check(scenario)
    return simulate(scenario, console, verbose=args.verbose)


def check(scenario: Scenario) -> int:
    """``--check``: the preflight of a run, without the run; writes nothing."""
    from flowerbed.sims.preflight import FAILURES, failure_line, preflight

    try:
        preflight(scenario, create_output=False)
    except FAILURES as err:
        print(f"flowerbed sim: error: {failure_line(err, scenario)}", file=sys.stderr)
        return 2
    print(
        f"flowerbed sim: run config OK ({scenario.strategy} on {scenario.num_nodes} "
        f"{scenario.fleet} nodes, {scenario.num_rounds} rounds, {scenario.model} on "
        f"{scenario.dataset}); nothing was trained"
    )
    return 0


def simulate(scenario: Scenario, console: Any, *, verbose: bool = False) -> int:
    """Train ``scenario`` on the in-process engine with a progress bar, then print
    the per-round table, the closing line and why tasks failed
    (:mod:`flowerbed.sims.summary`). Flower's log only with ``verbose``."""
    from flowerbed.sims.preflight import FAILURES, failure_line, preflight
    from flowerbed.sims.recorder import RoundRecord
    from flowerbed.sims.scenario import default_workers, run_scenario
    from flowerbed.sims.summary import (
        closing_line,
        failure_lines,
        round_row,
        round_table,
    )
    from flwr.common.logger import LOGGER_NAME  # sets Flower's level on import
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    if not verbose:
        logging.getLogger(LOGGER_NAME).setLevel(logging.WARNING)
    table = round_table(f"{scenario.strategy} on {scenario.fleet}")
    progress = Progress(
        TextColumn("[bold]simulating"),
        BarColumn(bar_width=None),
        MofNCompleteColumn(),
        TextColumn("rounds  acc {task.fields[acc]}  virtual {task.fields[vtime]}"),
        TimeElapsedColumn(),
        console=console,
    )

    def on_round(r: RoundRecord) -> None:
        table.add_row(*round_row(r))
        progress.update(
            task,
            advance=1,
            acc=f"{100 * r.accuracy:.1f}%",
            vtime=f"{r.virtual_time_s:.1f} s",
        )

    try:  # fail before any training
        preflight(scenario)
    except FAILURES as err:
        print(f"flowerbed sim: error: {failure_line(err, scenario)}", file=sys.stderr)
        return 2
    try:
        with progress:
            task = progress.add_task(
                "sim", total=scenario.num_rounds, acc="-", vtime="0 s"
            )
            outcome = run_scenario(
                scenario.to_run_config(), on_round=on_round, workers=default_workers()
            )
    except (OSError, MemoryError) as err:
        print(f"flowerbed sim: error: {failure_line(err, scenario)}", file=sys.stderr)
        return 1
    console.print(table)
    console.print(closing_line(outcome.results))
    lines = failure_lines(outcome.results)
    if lines:
        console.print(f"[yellow]{lines[0]}[/yellow]")
    for line in lines[1:]:
        console.print(line, markup=False, highlight=False)
    console.print(f"run folder: {outcome.run_dir}")
    if outcome.problem is not None:
        print(f"flowerbed sim: error: {outcome.problem}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    from flowerbed.cli import main

    sys.exit(main(["sim", *sys.argv[1:]]))
