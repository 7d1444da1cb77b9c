"""The ``flowerbed`` command: one entry point, one subcommand per job.

Each subcommand lives beside the code it drives and exposes
``register(subparsers) -> None``, which adds its parser and sets ``func`` (called
with the parsed namespace, returning an exit code).
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMAND_MODULES = (
    "flowerbed.sims.cli",  # sim
    "flowerbed.bench.cli",  # bench
    "flowerbed.clients.bridge.cli",  # bridge
    "flowerbed.clients.export_android",  # export-android
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flowerbed",
        description="Fast, reliable federated training on fleets of unequal devices.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as err:
            if err.name is not None and name.startswith(err.name):
                continue  # that part of flowerbed is not built yet
            raise
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
