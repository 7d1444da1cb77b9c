"""The run folder: results.json, rounds.csv and a plot, written all-or-nothing.

Files are written into a hidden sibling folder first and renamed into place, so a
crash or a bad configuration never leaves a half-written run folder behind.
"""

from __future__ import annotations

import csv
import json
import math
import os
import platform
import shutil
from collections.abc import Sequence
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path
from statistics import median
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from flowerbed.sims.recorder import RoundRecord
    from matplotlib.figure import Figure

CSV_COLUMNS = (
    "round",
    "virtual_time_s",
    "accuracy",
    "loss",
    "num_participants",
    "num_failed",
    "stragglers",
    "energy_j",
    "wall_time_s",
)


FOLDER_BYTES = 64 * 1024
"""Bytes of a run folder besides its rounds (the plot, about 30 kB, and headers)."""
ROUND_BYTES = 256
"""Bytes each round adds to results.json and rounds.csv besides its node ids."""
NODE_ID_BYTES = 16
"""Bytes each participant or failed node id of a round adds to results.json
(measured: 100 nodes, 20 rounds wrote 31 kB of results.json)."""


class OutputDirError(ValueError):
    """The output folder cannot be created or written; the message names it."""


def run_folder_bytes(num_rounds: int, nodes_per_round: int) -> int:
    """About how many bytes a run folder takes (:func:`write_run_folder`)."""
    return FOLDER_BYTES + num_rounds * (ROUND_BYTES + NODE_ID_BYTES * nodes_per_round)


def check_output_dir(
    output_dir: str | Path, need_bytes: int = 0, *, create: bool = True
) -> Path:
    """Prove ``output_dir`` writable with ``need_bytes`` free on its disk, so a run
    never trains only to lose its results; raises :class:`OutputDirError`.

    ``create`` (a run): make the folder, write a file in it and remove it. Else
    (``flowerbed sim --check``) nothing is written: the nearest folder that exists
    must be one this process may write (permissions, a read-only file system).
    """
    root = Path(output_dir).expanduser()

    def refuse(reason: str) -> OutputDirError:
        return OutputDirError(
            f"run-config 'output-dir' {str(root)!r} cannot be written: {reason}"
        )

    try:
        existing = _nearest_existing(root)
        if not existing.is_dir():
            raise refuse(f"{str(existing)!r} is not a folder")
        free = shutil.disk_usage(existing).free
        if free < need_bytes:
            raise refuse(
                f"{free // 1024} KiB free on its disk, a run folder needs about "
                f"{need_bytes // 1024} KiB"
            )
        if create:
            root.mkdir(parents=True, exist_ok=True)
            probe = root / f".flowerbed-write-test-{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        elif not os.access(existing, os.W_OK | os.X_OK):
            read_only = os.statvfs(existing).f_flag & os.ST_RDONLY
            raise refuse("Read-only file system" if read_only else "Permission denied")
    except OSError as err:
        raise refuse(err.strerror or str(err)) from None
    return root


def _nearest_existing(path: Path) -> Path:
    """``path`` or its nearest ancestor that exists (a file, or a broken link)."""
    while not path.exists() and not path.is_symlink() and path != path.parent:
        path = path.parent
    return path


def time_to_target(records: Sequence[RoundRecord], target: float) -> float | None:
    """Virtual time of the first round whose accuracy reaches ``target``, else None."""
    for record in records:
        if record.accuracy >= target:
            return record.virtual_time_s
    return None


def summarise(
    config: dict[str, Any],
    records: Sequence[RoundRecord],
    initial_accuracy: float,
    engine: str,
    errors: Sequence[dict[str, Any]] = (),
) -> dict[str, Any]:
    """The content of results.json.

    ``errors``: failed train tasks grouped by kind (``RunRecorder.error_summary``).
    """
    import flowerbed
    import flwr
    import torch

    target = float(config["target-accuracy"])
    return {
        "config": config,
        "engine": engine,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "versions": {
            "flowerbed": flowerbed.__version__,
            "flwr": flwr.__version__,
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
        "initial_accuracy": None if math.isnan(initial_accuracy) else initial_accuracy,
        "rounds": [asdict(r) for r in records],
        "final_accuracy": records[-1].accuracy if records else None,
        "target_accuracy": target,
        "time_to_target_s": time_to_target(records, target),
        "total_energy_j": sum(r.energy_j for r in records),
        "total_virtual_time_s": records[-1].virtual_time_s if records else 0.0,
        "failed_tasks": sum(len(r.failed) for r in records),
        "trained_tasks": sum(len(r.participants) for r in records),
        "errors": list(errors),
    }


UNEVEN_ROUNDS = 10.0
"""A run with a round lasting over this many times its median round gets a second
panel, accuracy per round: on a linear time axis, a few round timeouts (3,600 s)
among rounds of seconds leave the other rounds' points in a few piles."""


def round_durations(records: Sequence[RoundRecord]) -> list[float]:
    """Virtual seconds each round lasted (the first from time 0)."""
    ends = [r.virtual_time_s for r in records]
    return [b - a for a, b in zip([0.0, *ends], ends, strict=False)]


def long_rounds(records: Sequence[RoundRecord]) -> list[RoundRecord]:
    """The rounds lasting over :data:`UNEVEN_ROUNDS` times the median round."""
    durations = round_durations(records)
    if len(durations) < 2:
        return []
    limit = UNEVEN_ROUNDS * median(durations)
    return [r for r, d in zip(records, durations, strict=True) if d > limit]


def accuracy_figure(records: Sequence[RoundRecord], title: str) -> Figure:
    """Test accuracy against virtual time; beside it, when some rounds are long
    (:func:`long_rounds`), accuracy against the round, the long ones marked in
    both panels."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    long = long_rounds(records)
    fig = Figure(figsize=(10 if long else 6, 4), dpi=100)
    axes = fig.subplots(1, 2 if long else 1, sharey=True, squeeze=False)[0]
    panels = [(axes[0], "virtual time (s)", lambda r: r.virtual_time_s)]
    if long:
        panels.append((axes[1], "round", lambda r: r.round))
        axes[1].xaxis.set_major_locator(MaxNLocator(integer=True))
    for ax, label, x in panels:
        ax.plot(
            [x(r) for r in records],
            [100 * r.accuracy for r in records],
            marker="o",
            markersize=3,
        )
        if long:
            ax.plot(
                [x(r) for r in long],
                [100 * r.accuracy for r in long],
                "o",
                color="tab:red",
                label=f"rounds over {UNEVEN_ROUNDS:g}x the median round's length",
            )
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("test accuracy (%)")
    if long:
        axes[1].legend(loc="best")
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def write_run_folder(
    output_dir: str | Path, results: dict[str, Any], records: Sequence[RoundRecord]
) -> Path:
    """Write ``results.json``, ``rounds.csv`` and ``accuracy.png`` atomically.

    Returns the new folder ``<output_dir>/<UTC timestamp>[-n]``.
    """
    root = Path(output_dir)
    root.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    final = root / stamp
    n = 1
    while final.exists():
        final = root / f"{stamp}-{n}"
        n += 1
    partial = root / f".{final.name}.partial-{os.getpid()}"
    partial.mkdir()
    try:
        (partial / "results.json").write_text(json.dumps(results, indent=2) + "\n")
        with open(partial / "rounds.csv", "w", newline="") as fh:
            writer = csv.writer(fh)
            writer.writerow(CSV_COLUMNS)
            for r in records:
                writer.writerow(
                    [
                        r.round,
                        f"{r.virtual_time_s:.6f}",
                        f"{r.accuracy:.6f}",
                        f"{r.loss:.6f}",
                        len(r.participants),
                        len(r.failed),
                        r.stragglers,
                        f"{r.energy_j:.6f}",
                        f"{r.wall_time_s:.3f}",
                    ]
                )
        cfg = results["config"]
        accuracy_figure(
            records, f"{cfg['strategy']} on {cfg['fleet']} ({cfg['num-nodes']} nodes)"
        ).savefig(partial / "accuracy.png")
        os.replace(partial, final)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return final
