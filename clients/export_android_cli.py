"""``flowerbed export-android``: its options, their defaults and the subcommand.

Importable without torch, so ``flowerbed export-android --help`` is quick; the export
itself is :mod:`flowerbed.clients.export_android`, imported when the command runs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from flowerbed.data import DATASETS
from flowerbed.zoo import MODEL_NAMES, ONE_D_MODELS

BATCHNORM_MODES = ("train", "groupnorm", "refuse")
"""``--batchnorm`` choices, the default first (see export_android_norm)."""

DEFAULT_HIDDEN = 64
"""Hidden width of ``mlp`` (must match the phone trainer's MLP when they are mixed)."""

DEFAULT_MAX_BATCH_SIZE = 64
"""Largest batch the program accepts; memory is planned for this size."""

PHONE_MODELS = ("mlp", "softmax")
"""The small models of the pure-Java phone trainer, in PyTorch's ``nn.Linear`` layout
(weight ``[out, in]``, bias ``[out]``)."""

EXPORT_MODELS = (
    tuple(
        sorted(
            n for n in MODEL_NAMES if n not in ONE_D_MODELS and n not in PHONE_MODELS
        )
    )
    + PHONE_MODELS
)
"""Every model name ``export-android`` accepts: the zoo's image models and the phone
trainer's (the zoo's 1-D models take sequences, not images)."""


def register(subparsers: Any) -> None:
    """Add the ``export-android`` subcommand to the ``flowerbed`` command."""
    parser = subparsers.add_parser(
        "export-android",
        help="export a model as an ExecuTorch training program (.pte) for phones",
        description=(
            "Export a model with its cross-entropy loss as an ExecuTorch training "
            "program, load it and step it once in ExecuTorch's runtime, and write it "
            "with its metadata (<out>.json) for `flowerbed bridge --program`. The "
            "program names its parameters by the model's state_dict keys, the names "
            "of the Flower arrays the gateway relays. See docs/export-android.md."
        ),
    )
    parser.add_argument(
        "--model",
        required=True,
        metavar="NAME",
        help=f"one of {', '.join(EXPORT_MODELS)}, or your own as module:attr (an "
        "nn.Module, or a factory called with in_channels, image_size, num_classes)",
    )
    parser.add_argument(
        "--dataset", required=True, metavar="NAME", help=f"one of {', '.join(DATASETS)}"
    )
    parser.add_argument(
        "--out", required=True, type=Path, help="the .pte file to write"
    )
    parser.add_argument(
        "--arrays",
        type=Path,
        default=None,
        help="initial weights: .npz with one float32 array per state_dict key "
        "(default: He initialisation under --seed)",
    )
    parser.add_argument(
        "--hidden",
        type=int,
        default=DEFAULT_HIDDEN,
        help=f"hidden width of the mlp model (default {DEFAULT_HIDDEN})",
    )
    parser.add_argument(
        "--max-batch-size",
        type=int,
        default=DEFAULT_MAX_BATCH_SIZE,
        help="largest training batch the program accepts "
        f"(default {DEFAULT_MAX_BATCH_SIZE})",
    )
    parser.add_argument(
        "--batchnorm",
        choices=BATCHNORM_MODES,
        default=BATCHNORM_MODES[0],
        help="BatchNorm layers: train them as they are, running statistics carried "
        "as state (default); replace them by GroupNorm; or refuse the model. Apply "
        "flowerbed.clients.export_android.prepare_batchnorm(model, MODE) to the "
        "ServerApp's model too",
    )
    parser.add_argument(
        "--profile",
        type=int,
        nargs="?",
        const=8,
        default=None,
        metavar="BATCH",
        help="also time training steps of BATCH samples (default 8) in ExecuTorch's "
        "runtime and in torch on this machine, and print the ratio",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the initial weights (default 0)"
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run ``flowerbed export-android``; returns the exit code."""
    import json

    import torch
    from flowerbed.clients.export_android import (
        EVALUATE_METHOD,
        METHOD_NAME,
        ExportError,
        export_training_program,
        profile_program,
        resolve_model,
    )
    from flowerbed.clients.export_android_norm import batchnorm_layers
    from rich.console import Console
    from rich.table import Table

    console = Console()
    try:
        if args.profile is not None and not 1 <= args.profile <= args.max_batch_size:
            raise ValueError(
                f"--profile {args.profile}: the batch must be 1..--max-batch-size "
                f"({args.max_batch_size})"
            )
        torch.manual_seed(args.seed)
        model, shape = resolve_model(args.model, args.dataset, hidden=args.hidden)
        if args.profile == 1 and args.batchnorm == "train" and batchnorm_layers(model):
            raise ValueError(
                "--profile 1: a program that trains batch norm takes batches of 2 "
                "or more"
            )
        with console.status(
            f"exporting {args.model} and stepping it once in ExecuTorch's runtime"
        ):
            program = export_training_program(
                model,
                shape,
                max_batch_size=args.max_batch_size,
                batchnorm=args.batchnorm,
                arrays=args.arrays,
            )
    except (ValueError, ImportError, ExportError) as err:
        print(f"flowerbed export-android: error: {err}", file=sys.stderr)
        return 1 if isinstance(err, ImportError) else 2
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(program.data)
    meta_path = args.out.with_name(args.out.name + ".json")
    meta = program.metadata(args.model, args.dataset, shape, args.max_batch_size)
    meta_path.write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")
    table = Table(title=f"{args.out} ({len(program.data):,} bytes), {meta_path.name}")
    table.add_column("parameter (Flower array name, program order)")
    table.add_column("shape")
    for name, dims in program.parameters:
        table.add_row(name, str(list(dims)))
    for name, dims in program.state:
        table.add_row(f"{name} (state)", str(list(dims)))
    console.print(table)
    layers = program.batchnorm_layers
    if layers and program.batchnorm == "groupnorm":
        console.print(
            f"BatchNorm replaced by GroupNorm in {len(layers)} layers: build the "
            "ServerApp's model with prepare_batchnorm(model, 'groupnorm') too",
            markup=False,
        )
    elif layers:
        console.print(
            f"BatchNorm trained as it is in {len(layers)} layers (batch statistics, "
            f"running statistics carried as {len(program.state)} state arrays, "
            f"batches of {program.min_batch_size} or more): build the ServerApp's "
            "model with prepare_batchnorm(model, 'train') too",
            markup=False,
        )
    state = ", state" if program.state else ""
    console.print(
        f"method {METHOD_NAME!r}: images float32 "
        f"[batch, {shape.in_channels}, {shape.image_size}, {shape.image_size}], "
        f"labels int64 [batch]{state}, batch {program.min_batch_size}.."
        f"{args.max_batch_size}; returns loss, logits{state}, gradients, parameters; "
        f"method {EVALUATE_METHOD!r}: images, labels, parameters{state}; returns "
        f"loss, logits; sha256 {program.sha256[:16]}; checked in ExecuTorch "
        f"{program.executorch_version} (loss {program.check_loss:.4f}"
        + (
            f", torch {program.torch_loss:.4f}"
            if program.torch_loss is not None
            else ""
        )
        + f"; evaluation loss {program.check_eval_loss:.4f}, torch "
        f"{program.torch_eval_loss:.4f})",
        markup=False,
    )
    if args.profile is not None:
        with console.status("timing training steps"):
            prof = profile_program(program, model, shape, args.profile)
        console.print(
            f"step of {prof.batch_size}: ExecuTorch {prof.executorch_s * 1e3:.1f} ms "
            f"({prof.executorch_cpu_s * 1e3:.1f} ms CPU), torch "
            f"{prof.torch_s * 1e3:.1f} ms ({prof.torch_cpu_s * 1e3:.1f} ms CPU), ratio "
            f"{prof.ratio:.1f}x; evaluation {prof.evaluate_s * 1e3:.1f} ms "
            f"({prof.evaluate_cpu_s * 1e3:.1f} ms CPU) per batch; memory "
            f"+{prof.rss_growth_bytes / 2**20:.0f} MiB; a "
            f"round of K local steps costs about K x {prof.executorch_s:.2f} s on this "
            "machine now (a phone core: 2-4x more)",
            markup=False,
        )
    return 0
