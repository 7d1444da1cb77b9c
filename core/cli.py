"""The ``flowerbed`` command: one entry point, one subcommand per job.

Each subcommand lives beside the code it drives, in a module that exposes
``register(subparsers) -> None``, which adds its parser (or parsers) and sets
``func`` (called with the parsed namespace, returning an exit code). Such a module
imports nothing heavy at its top (no torch, Flower, gRPC, scikit-learn or
matplotlib): the work's imports happen when the subcommand runs.

Subcommands are loaded lazily: :data:`SUBCOMMANDS` names each one's module and
one-line help, and only the module of the subcommand being run is imported, so
``flowerbed --help`` imports none of them. A new subcommand is one line here.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "sim": (
        "flowerbed.sims.cli",
        "simulate a heterogeneous fleet on the in-process engine",
    ),
    "download": (
        "flowerbed.sims.cli",
        "fetch MNIST or CIFAR-10 once into a folder (needs torchvision)",
    ),
    "pipeline": (
        "flowerbed.sims.pipeline_cli",
        "train one model across emulated devices as a pipeline (local processes)",
    ),
    "bench": (
        "flowerbed.bench.cli",
        "benchmark strategies on unequal fleets and the machinery's cost",
    ),
    "bridge": (
        "flowerbed.clients.bridge.cli",
        "run the phone gateway: each phone becomes a Flower node",
    ),
    "export-android": (
        "flowerbed.clients.export_android_cli",
        "export a model as an ExecuTorch training program (.pte) for phones",
    ),
}
"""Subcommand -> (module that registers it, one-line help), in ``--help`` order."""


def invoked(argv: Sequence[str]) -> str | None:
    """The subcommand ``argv`` runs (its first non-option word), if it names one."""
    for word in argv:
        if not word.startswith("-"):
            return word if word in SUBCOMMANDS else None
    return None


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The ``flowerbed`` parser.

    With ``argv``, only the module of the subcommand it runs is imported; the others
    are listed by name and help. Without, every subcommand's module is loaded.
    """
    parser = argparse.ArgumentParser(
        prog="flowerbed",
        description="Fast, reliable federated training on fleets of unequal devices.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    if argv is None:
        load = {module for module, _ in SUBCOMMANDS.values()}
    else:
        name = invoked(argv)
        load = {SUBCOMMANDS[name][0]} if name is not None else set()
    for module in dict.fromkeys(m for m, _ in SUBCOMMANDS.values()):
        if module in load:
            importlib.import_module(module).register(sub)
    registered = set(sub.choices)
    for name, (_, text) in SUBCOMMANDS.items():
        if name not in registered:
            sub.add_parser(name, help=text, add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
