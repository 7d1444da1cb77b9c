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
from flowerbed.zoo import MODEL_NAMES

DEFAULT_HIDDEN = 64
"""Hidden width of ``mlp`` (must match the phone trainer's MLP when they are mixed)."""

DEFAULT_MAX_BATCH_SIZE = 64
"""Largest batch the program accepts; memory is planned for this size."""

PHONE_MODELS = ("mlp", "softmax")
"""The small models of the pure-Java phone trainer, in PyTorch's ``nn.Linear`` layout
(weight ``[out, in]``, bias ``[out]``)."""

EXPORT_MODELS = tuple(sorted(MODEL_NAMES)) + PHONE_MODELS
"""Every model name ``export-android`` accepts."""


def register(subparsers: Any) -> None:
    """Add the ``export-android`` subcommand to the ``flowerbed`` command."""
    parser = subparsers.add_parser(
        "export-android",
        help="export a model as an ExecuTorch training program (.pte) for phones",
        description=(
            "Export a flowerbed model with its cross-entropy loss as an ExecuTorch "
            "training program. The program names its parameters by the model's "
            "state_dict keys, the names of the Flower arrays the gateway relays. "
            "See docs/export-android.md."
        ),
    )
    parser.add_argument(
        "--model",
        required=True,
        metavar="NAME",
        help=f"one of {', '.join(EXPORT_MODELS)}",
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
        "--seed", type=int, default=0, help="seed of the initial weights (default 0)"
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run ``flowerbed export-android``; returns the exit code."""
    import torch
    from flowerbed.clients.export_android import (
        METHOD_NAME,
        build_export_model,
        export_training_program,
        load_arrays,
    )
    from rich.console import Console
    from rich.table import Table

    console = Console()
    try:
        torch.manual_seed(args.seed)
        model, shape = build_export_model(args.model, args.dataset, hidden=args.hidden)
        if args.arrays is not None:
            load_arrays(model, args.arrays)
        program = export_training_program(
            model, shape, max_batch_size=args.max_batch_size
        )
    except (ValueError, ImportError) as err:
        print(f"flowerbed export-android: error: {err}", file=sys.stderr)
        return 2 if isinstance(err, ValueError) else 1
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(program)
    table = Table(title=f"{args.out} ({len(program):,} bytes)")
    table.add_column("parameter (Flower array name)")
    table.add_column("shape")
    for name, value in model.state_dict().items():
        table.add_row(name, str(list(value.shape)))
    console.print(table)
    console.print(
        f"method {METHOD_NAME!r}: images float32 "
        f"[batch, {shape.in_channels}, {shape.image_size}, {shape.image_size}], "
        f"labels int64 [batch], batch 1..{args.max_batch_size}; "
        "returns loss, logits, gradients, parameters",
        markup=False,
    )
    return 0
