"""Checkpoints of jobs that span devices: a restarted server goes on from the last
completed segment.

A span job's state at a segment's end is whole on the server: the model (the
central copy), the optimiser state the members handed back, the global step and
the round. :class:`SpanCheckpoint` writes them after every completed round with
:func:`~flowerbed.strategies.checkpoints.save_checkpoint` (atomic, checksummed)
and reads them back with
:func:`~flowerbed.strategies.checkpoints.load_checkpoint`, which refuses arrays
that do not fit the model or are not finite, as the data-parallel strategies'
checkpoints do (:mod:`flowerbed.strategies.rounds`). The optimiser state, whose
names and shapes depend on the optimiser, travels in the JSON part as ``.npy``
bytes (base64) and is checked the same way (finite numbers). The batch of step
``t`` depends only on the seed and ``t``
(:func:`flowerbed.parallel.job_data.batch_indices`), so a resumed job trains on
exactly the batches the uninterrupted one would have. Members are profiled
afresh after a restart: the boards connected then may not be the ones that were.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Mapping
from dataclasses import dataclass
from logging import INFO
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import ArrayRecord
from flwr.serverapp.strategy import Result
from flwr.supercore import log

from .checkpoints import (
    CheckpointError,
    StateFieldError,
    StateReader,
    check_writable,
    load_checkpoint,
    metric_history_to_json,
    remove_stale_temporaries,
    save_checkpoint,
)

_ADVICE = "delete it to start afresh or point checkpoint_path elsewhere"


@dataclass
class Resumed:
    """What a checkpoint restores: the last completed round, the global step
    reached, the model (in the initial arrays' order), the optimiser state (by
    the members' names) and the strategy's own fields."""

    round: int
    step: int
    arrays: dict[str, np.ndarray]
    optimizer: dict[str, np.ndarray]
    state: StateReader


def encode_arrays(arrays: Mapping[str, np.ndarray]) -> dict[str, str]:
    """Arrays as base64 ``.npy`` bytes (JSON-able, no pickles)."""
    out = {}
    for name, value in arrays.items():
        buf = io.BytesIO()
        np.save(buf, np.ascontiguousarray(value), allow_pickle=False)
        out[name] = base64.b64encode(buf.getvalue()).decode("ascii")
    return out


def decode_arrays(section: StateReader) -> dict[str, np.ndarray]:
    """:func:`encode_arrays`' output back; raise :class:`StateFieldError` naming an
    entry that is not ``.npy`` bytes or holds NaN or infinite values."""
    out = {}
    for name in section:
        where = f"{section.where}.{name}"
        raw = section[name]
        try:
            value = np.load(
                io.BytesIO(base64.b64decode(raw, validate=True)), allow_pickle=False
            )
        except (TypeError, ValueError, OSError):
            raise StateFieldError(where, raw, "base64 .npy bytes") from None
        if value.dtype.kind not in "biufc":
            raise StateFieldError(where, str(value.dtype), "a numeric array")
        if value.dtype.kind in "fc" and not np.isfinite(value).all():
            raise StateFieldError(where, "NaN or Inf", "finite numbers")
        out[name] = value
    return out


class SpanCheckpoint:
    """One span job's checkpoint file (see the module doc).

    Parameters
    ----------
    path : str or Path
        The file; written after every completed round, read by :meth:`resume`.
    strategy : str
        The strategy's class name; a checkpoint of another strategy is refused.
    """

    def __init__(self, path: str | Path, strategy: str) -> None:
        self.path = Path(path)
        self.strategy = strategy

    def check_writable(self) -> None:
        """Raise :class:`CheckpointError` now if the file cannot be written."""
        check_writable(self.path)

    def save(
        self,
        server_round: int,
        step: int,
        arrays: Mapping[str, np.ndarray],
        optimizer: Mapping[str, np.ndarray],
        result: Result,
        state: Mapping[str, Any] | None = None,
    ) -> None:
        """Write the state after ``server_round`` (atomically), ``step`` global
        steps done."""
        save_checkpoint(
            self.path,
            arrays,
            {
                "strategy": self.strategy,
                "round": server_round,
                "step": step,
                "strategy_state": dict(state or {}),
                "optimizer": encode_arrays(optimizer),
                "train_metrics": metric_history_to_json(result.train_metrics_clientapp),
                "evaluate_metrics": metric_history_to_json(
                    result.evaluate_metrics_clientapp
                ),
                "server_metrics": metric_history_to_json(
                    result.evaluate_metrics_serverapp
                ),
            },
        )

    def resume(self, initial_arrays: ArrayRecord, result: Result) -> Resumed | None:
        """The saved state, or None when there is no checkpoint yet; the Result's
        metric histories are restored. Raises :class:`CheckpointError` naming
        what is wrong (another strategy's file, arrays of another model, a field
        out of range); nothing is changed then."""
        remove_stale_temporaries(self.path)
        if not self.path.exists():
            return None
        arrays, saved = load_checkpoint(self.path, initial_arrays)
        if saved.get("strategy") != self.strategy:
            raise CheckpointError(
                f"checkpoint {self.path} was written by {saved.get('strategy')!r}, "
                f"not {self.strategy!r}; {_ADVICE}"
            )
        try:
            fields = StateReader(saved)
            last = fields.whole("round")
            step = fields.whole("step")
            histories = (
                fields.history("train_metrics"),
                fields.history("evaluate_metrics"),
                fields.history("server_metrics"),
            )
            optimizer = decode_arrays(fields.section("optimizer"))
            state = fields.section("strategy_state")
        except StateFieldError as err:
            raise CheckpointError(
                f"checkpoint {self.path} has malformed state: {err}; {_ADVICE}"
            ) from None
        (
            result.train_metrics_clientapp,
            result.evaluate_metrics_clientapp,
            result.evaluate_metrics_serverapp,
        ) = histories
        log(
            INFO,
            "%s: resumed from %s after round %d (step %d)",
            self.strategy,
            self.path,
            last,
            step,
        )
        ordered = {name: arrays[name] for name in initial_arrays}
        return Resumed(last, step, ordered, optimizer, state)
