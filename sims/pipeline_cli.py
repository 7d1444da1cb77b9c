"""``flowerbed pipeline``: one model trained across emulated devices on this machine.

Every device is a local process running the boards' span ClientApp with an
emulated speed from the device catalogue; :class:`PipelineTraining` partitions
the model over them with FTPipeHD's DP, runs segments of synchronous 1F1B steps
over gloo on 127.0.0.1, and recovers from devices crashed on purpose
(``--crash``). Prints a table per round and writes ``results.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

DEFAULT_DEVICES = "jetson-nano,rpi4b,rpi3b@2"
"""A Jetson Nano, a Pi 4B and a Pi 3B at half clock (throttled): a 13x spread."""
DATASETS_BY_MODEL = {"vgg": "digits32", "har-cnn": "har", "deep-mlp": "digits"}
INPUT_SHAPES = {"digits32": (1, 32, 32), "har": (9, 128), "digits": (1, 8, 8)}
MODEL_ARGS: dict[str, dict[str, Any]] = {
    "vgg": {"in_channels": 1, "image_size": 32, "num_classes": 10, "width": 8},
    "har-cnn": {"in_channels": 9, "length": 128, "num_classes": 6, "width": 16},
    "deep-mlp": {"in_features": 64, "num_classes": 10, "hidden": 64, "depth": 8},
}


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "pipeline",
        help="train one model across emulated devices as a pipeline (local processes)",
        description="Pipeline-parallel training (FTPipeHD) across emulated devices: "
        "one local process per device, speeds from the device catalogue, "
        "torch.distributed over 127.0.0.1, Flower's strategy planning and "
        "recovering. Writes <out>/results.json.",
    )
    p.add_argument(
        "--devices",
        default=DEFAULT_DEVICES,
        help="comma-separated catalogue devices, 'name@factor' for a slowed one "
        f"(default {DEFAULT_DEVICES})",
    )
    p.add_argument(
        "--model",
        default="vgg",
        choices=sorted(MODEL_ARGS),
        help="layered model: vgg (32x32 images), har-cnn (time series), deep-mlp "
        "(default vgg)",
    )
    p.add_argument("--rounds", type=int, default=3, help="rounds (default 3)")
    p.add_argument("--steps", type=int, default=10, help="steps per round (default 10)")
    p.add_argument(
        "--batch", type=int, default=32, help="samples per step (default 32)"
    )
    p.add_argument(
        "--micro-batches",
        type=int,
        default=8,
        help="micro-batches per step (default 8)",
    )
    p.add_argument(
        "--schedule", default="1f1b", choices=["1f1b", "gpipe"], help="(default 1f1b)"
    )
    p.add_argument(
        "--replicate-every", type=int, default=5, help="R, steps (default 5)"
    )
    p.add_argument("--lr", type=float, default=0.05, help="SGD rate (default 0.05)")
    p.add_argument(
        "--time-scale",
        type=float,
        default=4.0,
        help="emulate every device this many times slower than the catalogue, so "
        "that real compute stays below the emulated time (default 4)",
    )
    p.add_argument(
        "--even",
        action="store_true",
        help="even partition (equal layers per stage) instead of the DP",
    )
    p.add_argument(
        "--no-repartition", action="store_true", help="keep the first partition"
    )
    p.add_argument(
        "--crash",
        action="append",
        default=[],
        metavar="DEVICE@STEP",
        help="device index (0-based) whose process dies at a global step; repeatable",
    )
    p.add_argument(
        "--slow",
        action="append",
        default=[],
        metavar="DEVICE@STEP:FACTOR",
        help="device index that becomes FACTOR times slower from a step on",
    )
    p.add_argument("--out", default="outputs/pipeline", help="output folder")
    p.add_argument("-v", "--verbose", action="store_true", help="show Flower's log")
    p.set_defaults(func=run)


def _index_at(text: str, what: str, count: int) -> tuple[int, str]:
    index, sep, rest = text.partition("@")
    if not sep or not index.isdigit() or not 0 <= int(index) < count:
        raise ValueError(
            f"--{what} {text!r}: expected DEVICE@..., DEVICE an index 0..{count - 1}"
        )
    return int(index), rest


def build(args: argparse.Namespace) -> tuple[list[Any], dict[str, Any]]:
    """Nodes and strategy settings from the options; ``ValueError`` if bad."""
    from flowerbed.parallel.pipeline.partition import even_partition
    from flowerbed.parallel.plan import stage_sizes

    from .pipeline_local import nodes_for

    specs = [d.strip() for d in args.devices.split(",") if d.strip()]
    if not specs:
        raise ValueError("--devices is empty")
    nodes = nodes_for(specs, args.time_scale)
    for text in args.crash:
        index, step = _index_at(text, "crash", len(nodes))
        if not step.isdigit():
            raise ValueError(f"--crash {text!r}: STEP must be a whole number")
        nodes[index].crash_at_step = int(step)
    for text in args.slow:
        index, rest = _index_at(text, "slow", len(nodes))
        step, _, factor = rest.partition(":")
        if not step.isdigit() or not factor:
            raise ValueError(f"--slow {text!r}: expected DEVICE@STEP:FACTOR")
        nodes[index].slow_from_step, nodes[index].slow_factor = int(step), float(factor)
    dataset = DATASETS_BY_MODEL[args.model]
    settings: dict[str, Any] = {
        "model": args.model,
        "model_args": MODEL_ARGS[args.model],
        "input_shape": INPUT_SHAPES[dataset],
        "dataset": dataset,
        "steps_per_round": args.steps,
        "batch_size": args.batch,
        "micro_batches": args.micro_batches,
        "schedule": args.schedule,
        "replicate_every": args.replicate_every,
        "lr": args.lr,
        "repartition": not args.no_repartition,
    }
    if args.even:
        from flowerbed.models import build_sequential

        layers = len(build_sequential(args.model, MODEL_ARGS[args.model]))
        settings["stage_sizes"] = stage_sizes(even_partition(layers, len(nodes)))
    return nodes, settings


def test_accuracy(settings: dict[str, Any], arrays: Any) -> float:
    """Accuracy of the trained model on its dataset's held-out split."""
    import torch
    from flowerbed.clients.board_app import chunked_evaluate
    from flowerbed.models import build_sequential
    from flowerbed.parallel.job_data import load_job_dataset

    model = build_sequential(settings["model"], settings["model_args"])
    model.load_state_dict({k: torch.from_numpy(v.numpy()) for k, v in arrays.items()})
    data = load_job_dataset(settings["dataset"])
    return chunked_evaluate(model, data.x_test, data.y_test)[1]


def run(args: argparse.Namespace) -> int:
    import logging

    from rich.console import Console
    from rich.table import Table

    from .pipeline_local import run_local

    console = Console()
    try:
        nodes, settings = build(args)
    except ValueError as err:
        print(f"flowerbed pipeline: error: {err}", file=sys.stderr)
        return 2
    if not args.verbose:
        import flwr.common.logger  # noqa: F401  (sets its level on import)

        logging.getLogger("flwr").setLevel(logging.WARNING)
    for i, n in enumerate(nodes):
        console.print(f"device {i}: {n.device} ({n.gflops:.3f} GFLOP/s emulated)")
    with console.status("training (one process per device)..."):
        done = run_local(nodes, settings, rounds=args.rounds, quiet=not args.verbose)
    table = Table(title=f"{args.model} over {len(nodes)} devices")
    for column in ("round", "partition", "step s", "predicted", "samples/s", "lost"):
        table.add_column(column)
    rounds = {}
    for r, metrics in sorted(done.result.train_metrics_clientapp.items()):
        m = dict(metrics)
        rounds[r] = m
        table.add_row(
            str(r),
            str(m.get("partition")),
            f"{m.get('step-s', 0):.3f}",
            f"{m.get('predicted-step-s', 0):.3f}",
            f"{m.get('samples-per-s', 0):.1f}",
            str(m.get("lost-steps", 0)),
        )
    console.print(table)
    for event in done.events:
        console.print(f"- {event}")
    accuracy = test_accuracy(settings, done.result.arrays)
    console.print(f"test accuracy of the final model: {accuracy:.3f}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = {
        "devices": [n.device for n in nodes],
        "settings": settings,
        "time_scale": args.time_scale,
        "rounds": rounds,
        "events": done.events,
        "wall_s": done.wall_s,
        "test_accuracy": accuracy,
    }
    (out / "results.json").write_text(json.dumps(record, indent=2, default=str))
    console.print(f"flowerbed pipeline: results in {out / 'results.json'}")
    return 0
