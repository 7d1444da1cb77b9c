"""Mechanics shared by the flowerbed strategies.

One home for what every strategy needs: rejecting bad replies, folding replies into a
running weighted sum, quarantining nodes that keep failing, staleness discounts,
the clock-driven push/pull loop, and atomic checkpoints.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import random
import tempfile
import zipfile
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from logging import INFO, WARNING
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
from flowerbed import keys
from flowerbed.arrays import array_view, encode_record
from flowerbed.clock import Clock
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Message,
    MetricRecord,
    RecordDict,
)
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid
from flwr.supercore import log

from . import fold_kernel

R = TypeVar("R", ArrayRecord, MetricRecord, ConfigRecord)

StalenessFn = Callable[[int], float]
"""Maps an update's staleness (model versions behind) to a weight multiplier."""

WAIT_FOR_NODES_S = 1.0
"""Clock seconds between checks while too few nodes are connected."""

# Round bookkeeping the straggler-aware strategies add to each train MetricRecord.
ROUND_PARTICIPANTS = "participants"
"""Nodes whose fresh update went into the round."""
ROUND_LATE_UPDATES = "late-updates"
"""Updates from earlier rounds folded into the round (staleness-discounted)."""
ROUND_STRAGGLERS = "stragglers"
"""Nodes sampled for the round that had not replied when it closed."""
ROUND_DEADLINE_S = "deadline-s"
"""The round's deadline in clock seconds (-1: none)."""
ROUND_DEADLINE_PERCENTILE = "deadline-percentile"
"""The percentile of recent durations the round's adaptive deadline was taken at
(-1: not adaptive)."""
ROUND_CLOCK_S = "clock-s"
"""Clock time (virtual seconds in simulation) when the round's model was made."""
ROUND_STALENESS = "staleness"
"""Mean staleness (model versions) of the updates in an asynchronous version."""


# ---------------------------------------------------------------------------------
# Staleness discounts
# ---------------------------------------------------------------------------------


def polynomial_staleness(staleness: int, exponent: float = 0.5) -> float:
    """Return ``(1 + s) ** -exponent``; with 0.5 this is FedBuff's ``1/sqrt(1+s)``.

    Nguyen et al., "Federated Learning with Buffered Asynchronous Aggregation",
    AISTATS 2022, Sec. 3 (staleness scaling of client updates); the polynomial
    family is from Xie et al., "Asynchronous Federated Optimization", 2019, Sec. 5.
    """
    if staleness < 0:
        raise ValueError(f"staleness must be >= 0, got {staleness}")
    return float((1.0 + staleness) ** -exponent)


def constant_staleness(staleness: int) -> float:
    """Return 1: stale updates count as much as fresh ones."""
    if staleness < 0:
        raise ValueError(f"staleness must be >= 0, got {staleness}")
    return 1.0


def hinge_staleness(staleness: int, a: float = 10.0, b: int = 4) -> float:
    """Return 1 up to ``b`` versions behind, then ``1 / (a (s - b) + 1)``.

    Xie et al., "Asynchronous Federated Optimization", 2019, Sec. 5 (hinge function).
    """
    if staleness < 0:
        raise ValueError(f"staleness must be >= 0, got {staleness}")
    return 1.0 if staleness <= b else 1.0 / (a * (staleness - b) + 1.0)


STALENESS_FUNCTIONS: dict[str, StalenessFn] = {
    "polynomial": polynomial_staleness,
    "constant": constant_staleness,
    "hinge": hinge_staleness,
}


def resolve_staleness_fn(fn: str | StalenessFn) -> StalenessFn:
    """Return ``fn`` itself, or the named function from :data:`STALENESS_FUNCTIONS`."""
    if callable(fn):
        return fn
    if fn not in STALENESS_FUNCTIONS:
        raise ValueError(
            f"unknown staleness function {fn!r}; valid: {sorted(STALENESS_FUNCTIONS)}"
        )
    return STALENESS_FUNCTIONS[fn]


# ---------------------------------------------------------------------------------
# Reply validation
# ---------------------------------------------------------------------------------


class ReplyRejected(Exception):
    """A reply that cannot be used; ``reason`` says why.

    ``fault`` is False when the node did nothing wrong (e.g. it had no time to
    train), so the rejection does not count towards quarantine.
    """

    def __init__(self, reason: str, *, fault: bool = True) -> None:
        super().__init__(reason)
        self.reason = reason
        self.fault = fault


MAX_NUM_EXAMPLES = 1e9
"""Default ceiling on a reply's weight (``num-examples``): samples in one task."""
MIN_TIME_S = 1e-6
"""Shortest non-zero time a reply may report (seconds); below it, 1/t overflows."""
MAX_TIME_S = 1e7
"""Longest time a reply may report (seconds): about 116 days."""
MAX_STEPS = 1e9
"""Most optimiser steps a reply may report for one task."""
MAX_METRIC_MAGNITUDE = 1e15
"""Largest magnitude of any other metric: weighted sums of them stay finite."""

METRIC_RANGES: dict[str, tuple[float, float, str]] = {
    keys.TRAIN_TIME_S: (0.0, MAX_TIME_S, "s"),
    keys.COMM_TIME_S: (0.0, MAX_TIME_S, "s"),
    keys.EVAL_TIME_S: (0.0, MAX_TIME_S, "s"),
    keys.NUM_STEPS: (0.0, MAX_STEPS, "steps"),
    keys.SAMPLES_PER_S: (0.0, MAX_NUM_EXAMPLES / MIN_TIME_S, "samples/s"),
    keys.ENERGY_J: (0.0, 1e12, "J"),
    keys.POWER_W: (0.0, 1e6, "W"),
    keys.BATTERY_PCT: (0.0, 100.0, "%"),
    keys.TEMP_C: (-100.0, 200.0, "degrees C"),
}
"""Valid range of each metric a strategy (or the phone gateway) reads."""
TIME_METRICS = (keys.TRAIN_TIME_S, keys.COMM_TIME_S, keys.EVAL_TIME_S)
"""Times: 0 (no work) or at least :data:`MIN_TIME_S`."""


def _number(
    metrics: MetricRecord,
    key: str,
    *,
    required: bool,
    low: float = 0.0,
    high: float = MAX_METRIC_MAGNITUDE,
    unit: str = "",
) -> float | None:
    """A reply's metric if it is a finite number in ``[low, high]``.

    The rejection names the key, the value, the valid range and what was wrong.
    """
    if key not in metrics:
        if required:
            raise ReplyRejected(f"metric {key!r} is missing")
        return None
    value = metrics[key]
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ReplyRejected(f"metric {key!r} must be a number, got {value!r}")
    valid = f"valid: [{low:g}, {high:g}]{' ' + unit if unit else ''}"
    if not math.isfinite(value):
        raise ReplyRejected(f"metric {key!r} is not finite ({value}); {valid}")
    if value < low:
        problem = "negative" if low == 0 else "below its floor"
        raise ReplyRejected(f"metric {key!r} is {problem} ({value:g}); {valid}")
    if value > high:
        raise ReplyRejected(f"metric {key!r} is above its ceiling ({value:g}); {valid}")
    return float(value)


def records_of(content: RecordDict, kind: type[R]) -> list[R]:
    """The records of one kind in ``content``.

    Used instead of ``RecordDict.array_records`` and friends, whose views form
    reference cycles: a reply read through them outlives its use until Python's
    cyclic garbage collector runs, which breaks streaming aggregation's O(model)
    memory.
    """
    return [record for _, record in content.items() if isinstance(record, kind)]


def _single_metricrecord(content: RecordDict) -> MetricRecord:
    found = records_of(content, MetricRecord)
    if len(found) != 1:
        raise ReplyRejected(f"expected exactly one MetricRecord, got {len(found)}")
    return found[0]


UNAVAILABLE_CODES = frozenset(
    {
        ErrorCode.MESSAGE_UNAVAILABLE,
        ErrorCode.REPLY_MESSAGE_UNAVAILABLE,
        ErrorCode.NODE_UNAVAILABLE,
    }
)
"""Error codes of a reply that never came (expired TTL, node gone): the node was
slow or vanished, which is not a fault that quarantine should punish."""


def _content(reply: Message) -> RecordDict:
    if reply.has_error():
        reason = reply.error.reason or "no reason given"
        raise ReplyRejected(
            f"error reply (code {reply.error.code}): {reason}",
            fault=reply.error.code not in UNAVAILABLE_CODES,
        )
    if not reply.has_content():
        raise ReplyRejected("reply has neither content nor error")
    return reply.content


def check_metrics(
    metrics: MetricRecord,
    weighted_by_key: str,
    *,
    max_weight: float = MAX_NUM_EXAMPLES,
) -> float:
    """Check a reply's metrics and return its weight (``weighted_by_key``).

    Every number must be finite. The weight must lie in ``[0, max_weight]`` (0
    is no work: rejected, not the node's fault). The metrics of
    :data:`METRIC_RANGES` must lie in their range; times are 0 or at least
    :data:`MIN_TIME_S` (a runtime weighting divides by them); ``num-steps`` is a
    whole number; any other metric is at most :data:`MAX_METRIC_MAGNITUDE` in
    size, so weighted sums of metrics stay finite.

    Raises
    ------
    ReplyRejected
        Naming the metric, its value, the valid range and what was wrong.
    """
    weight = _number(metrics, weighted_by_key, required=True, high=max_weight)
    assert weight is not None
    for key, value in metrics.items():
        if key == weighted_by_key:
            continue
        if key in METRIC_RANGES:
            low, high, unit = METRIC_RANGES[key]
            number = _number(metrics, key, required=True, low=low, high=high, unit=unit)
            assert number is not None
            if key in TIME_METRICS and 0 < number < MIN_TIME_S:
                raise ReplyRejected(
                    f"metric {key!r} is below its floor ({number:g}); valid: 0, or "
                    f"[{MIN_TIME_S:g}, {high:g}] s"
                )
            if key == keys.NUM_STEPS and not number.is_integer():
                raise ReplyRejected(
                    f"metric {key!r} is not a whole number ({number:g}); valid: "
                    f"0, 1, 2, ... up to {high:g}"
                )
            continue
        values = value if isinstance(value, list) else [value]
        for v in values:
            if isinstance(v, int | float) and not isinstance(v, bool):
                if not math.isfinite(v):
                    raise ReplyRejected(f"metric {key!r} is not finite ({value})")
                if abs(v) > MAX_METRIC_MAGNITUDE:
                    raise ReplyRejected(
                        f"metric {key!r} is too large ({v:g}); valid: magnitude "
                        f"up to {MAX_METRIC_MAGNITUDE:g}"
                    )
    if weight == 0:
        raise ReplyRejected(f"weight {weighted_by_key!r} is 0: no work", fault=False)
    return weight


ArraySpec = tuple[tuple[int, ...], np.dtype]
"""Shape and dtype of one array: what a reply's array must match."""


def spec_of(arrays: Mapping[str, np.ndarray] | ArrayRecord) -> dict[str, ArraySpec]:
    """Names, shapes and dtypes of NumPy arrays or of an ArrayRecord's arrays."""
    return {
        name: (tuple(int(d) for d in value.shape), np.dtype(value.dtype))
        for name, value in arrays.items()
    }


def cast_array(name: str, value: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """``value`` as the model's ``dtype`` when that keeps its meaning.

    Accepted when NumPy's ``same_kind`` rule allows the cast (float64 to float32,
    int64 to int32, int to float: the same kind or a safe one) and no value
    falls outside ``dtype``'s range. Float to int (the fraction is lost) and
    complex to real (the imaginary part is lost) are rejected. A float reply
    to a float model stays as it is (no copy): :meth:`UpdateAccumulator.add`
    folds it into the model's dtype.

    Raises
    ------
    ReplyRejected
        Naming the array, its dtype and the model's, and the rule or range.
    """
    if value.dtype == dtype:
        return value
    if not np.can_cast(value.dtype, dtype, casting="same_kind"):
        raise ReplyRejected(
            f"array {name!r} has dtype {value.dtype}, which cannot become the "
            f"model's {dtype} without losing information (NumPy 'same_kind' "
            "casting refuses it)"
        )
    if value.size and dtype.kind in "iuf":
        with np.errstate(invalid="ignore"):
            low, high = value.min(), value.max()
        info = np.iinfo(dtype) if dtype.kind in "iu" else np.finfo(dtype)
        if low < info.min or high > info.max:
            raise ReplyRejected(
                f"array {name!r} holds values in [{low:g}, {high:g}], outside "
                f"{dtype}'s range [{info.min:g}, {info.max:g}]"
            )
    if value.dtype.kind == "f" and dtype.kind == "f":
        return value
    return value.astype(dtype)


def check_train_reply(
    reply: Message,
    reference: Mapping[str, ArraySpec] | None,
    weighted_by_key: str,
    *,
    max_weight: float = MAX_NUM_EXAMPLES,
) -> tuple[dict[str, np.ndarray], MetricRecord, float]:
    """Validate a training reply; return its arrays, MetricRecord and weight.

    ``reference`` gives the names, shapes and dtypes the arrays must have (the
    model the node trained from, or the first accepted reply when no model is
    known); None checks the reply on its own. An array of another dtype is
    accepted when :func:`cast_array` allows it. The arrays are read-only NumPy
    views of the reply's bytes where possible (:func:`array_view`); their values
    are checked (NaN/Inf) by :meth:`UpdateAccumulator.add`, in the same pass that
    folds them.

    Raises
    ------
    ReplyRejected
        Error content; not exactly one ArrayRecord/MetricRecord; missing or extra
        array keys; wrong shape; a dtype that cannot be cast safely; undecodable
        bytes; invalid weight or metrics.
    """
    content = _content(reply)
    found = records_of(content, ArrayRecord)
    if len(found) != 1:
        raise ReplyRejected(f"expected exactly one ArrayRecord, got {len(found)}")
    metrics = _single_metricrecord(content)
    weight = check_metrics(metrics, weighted_by_key, max_weight=max_weight)
    record = found[0]
    if reference is not None:
        missing = sorted(set(reference) - set(record))
        extra = sorted(set(record) - set(reference))
        if missing:
            raise ReplyRejected(f"missing arrays {missing}")
        if extra:
            raise ReplyRejected(f"unexpected arrays {extra}")
    arrays: dict[str, np.ndarray] = {}
    for name in reference if reference is not None else record:
        got = record[name]
        if reference is not None and tuple(got.shape) != reference[name][0]:
            raise ReplyRejected(
                f"array {name!r} has shape {tuple(got.shape)}, "
                f"expected {reference[name][0]}"
            )
        try:
            value = array_view(got)
        except Exception as err:  # undecodable bytes: the node's fault, not ours
            raise ReplyRejected(f"array {name!r} cannot be decoded: {err}") from err
        if value.shape != tuple(got.shape) or value.dtype != np.dtype(got.dtype):
            raise ReplyRejected(
                f"array {name!r} holds {value.dtype} {value.shape} but declares "
                f"{got.dtype} {tuple(got.shape)}"
            )
        if reference is not None:
            value = cast_array(name, value, reference[name][1])
        if value.dtype.kind not in "biuf":
            raise ReplyRejected(
                f"array {name!r} has dtype {value.dtype}; model arrays must be "
                "bool, integer or real floating point"
            )
        arrays[name] = value
    return arrays, metrics, weight


def check_evaluate_reply(
    reply: Message, weighted_by_key: str, *, max_weight: float = MAX_NUM_EXAMPLES
) -> MetricRecord:
    """Validate an evaluation reply; return its MetricRecord."""
    metrics = _single_metricrecord(_content(reply))
    check_metrics(metrics, weighted_by_key, max_weight=max_weight)
    return metrics


# ---------------------------------------------------------------------------------
# Streaming aggregation
# ---------------------------------------------------------------------------------


def to_numpy(record: ArrayRecord) -> dict[str, np.ndarray]:
    """Decode every array of ``record`` into writable arrays of its own."""
    return {name: array_view(array).copy() for name, array in record.items()}


def to_arrayrecord(arrays: Mapping[str, np.ndarray]) -> ArrayRecord:
    """Encode NumPy arrays as an ArrayRecord (order kept)."""
    return encode_record(arrays)


PAD_FROM = 2
"""Fewest values the compiled fold pads to :data:`fold_kernel.MOST` (see
``UpdateAccumulator._fold_compiled``)."""

FOLD_CHUNK = 1 << 16
"""Elements folded per step: 256 KiB of float32, so that the chunk's difference
stays in a core's L2 cache between the passes of one fold step (difference,
sum of squares, scale, add)."""


def _rejection(name: str, delta: np.ndarray) -> ReplyRejected:
    """Why an update whose ``delta`` has a non-finite sum of squares is refused."""
    if not np.isfinite(delta).all():
        return ReplyRejected(f"array {name!r} contains NaN or Inf")
    return ReplyRejected(f"array {name!r} changes by more than float32 can sum")


def _sum_dtype(dtype: np.dtype) -> np.dtype:
    """The running sum's dtype for arrays of ``dtype``: see UpdateAccumulator."""
    if dtype.kind == "f" and dtype.itemsize <= 4:
        return np.dtype(np.float32)
    return np.dtype(np.float64)


def check_positive(label: str, value: float | None) -> None:
    """ValueError naming ``label`` unless ``value`` is None or finite and > 0."""
    if value is not None and not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{label} must be finite and > 0, got {value}")


def _read_only(array: np.ndarray) -> np.ndarray:
    """A read-only view of ``array`` (the array itself stays writable)."""
    view = array.view()
    view.flags.writeable = False
    return view


@dataclass(frozen=True)
class Update:
    """One reply for :meth:`UpdateAccumulator.add_many` (``add``'s arguments)."""

    arrays: Mapping[str, np.ndarray]
    base: Mapping[str, np.ndarray]
    weight: float
    scale: float = 1.0
    steps: float = 1.0
    max_norm: float | None = None


class UpdateAccumulator:
    """Running weighted sum of model updates: O(model) memory, any number of replies.

    Each reply ``i`` contributes its update ``delta_i = x_i - base_i`` (``base_i``
    is the global model it trained from) with weight ``w_i`` and scale ``c_i``::

        S = sum_i w_i c_i delta_i,   W = sum_i w_i,   T = sum_i w_i tau_i

    :meth:`result` returns ``x + m S / W`` where ``m = 1`` for plain averaging
    (with ``c_i = 1`` and a common base this equals ``sum_i (w_i/W) x_i``, FedAvg)
    and ``m = T / W`` for FedNova (Wang et al., NeurIPS 2020, Eq. 6 with vanilla
    SGD: ``c_i = 1/tau_i``, ``tau_eff = sum_i p_i tau_i``).

    Speed: :meth:`add` folds each array in one pass with the compiled kernel
    of :mod:`flowerbed.strategies.fold_kernel` (numba; installed with
    flowerbed): per element it forms ``delta``, adds its square to the update's
    sum of squares (the update's norm, and the NaN/Inf check: the sum is finite
    exactly when every element is, and stays below float32's range) and adds
    ``w_i c_i delta`` into the sum, so the update, its base and the sum are each
    read once from memory and the sum written once, with no temporaries; a
    non-finite element never enters the sum. Arrays read from an
    ``ArrayRecord`` with :func:`array_view` are not copied at all. Without
    numba (or for mixed dtypes, float16 and integer arrays) the same sums are
    made with NumPy in chunks of :data:`FOLD_CHUNK` elements, several passes
    over each cache-resident chunk. :meth:`add_many` folds several replies
    that trained from the same base together: the kernel takes four at a time
    element by element, so the base and the sum are read (and the sum
    written) once for the four, ~1.7x the throughput of one at a time on
    this project's machine; NumPy goes chunk by chunk. The sum is the same,
    bit for bit, as adding the replies one by one in the same order (their
    norms to float32 summation order). Measured by ``flowerbed bench``'s
    machinery section. Memory: a new sum is written by its first update, not
    zeroed first; :meth:`result` is made in the sum's own memory; and
    ``memory`` (arrays no longer needed, such as the last result once it was
    encoded) is where the sums are made, so that a server that keeps it
    between rounds does not fault in fresh pages each round (about a third of
    a fold's time per model-sized array here).
    The base is read for every update because the norm and the NaN/Inf check
    are of ``delta``, and because summing ``delta`` keeps float32 exact enough
    (below); folding raw replies and taking the weighted base off once at the
    end would save that read but sum model-sized values, whose float32
    roundings are of the weights, not of the updates: for the 138 updates
    below, 12.3 float32 ulp of the result at most (mean 1.8) against 0.58
    (mean 0.25) for the sum of updates, measured against float64.

    Precision: ``S`` is kept in float32 for float16/32 arrays and in float64 for
    float64 and integer arrays (integer arrays such as BatchNorm's
    ``num_batches_tracked`` are then rounded in :meth:`result`). Summing the
    *updates* rather than the models keeps float32 accurate: each addition
    rounds relative to ``|S|``, which is of the size of an update, not of a
    weight, so the result's error is far below one float32 ulp of the model.
    Measured in ``tests/test_strategies_streaming.py``: 138 updates of 1e-3
    relative size with uneven weights agree with a float64 computation to
    within one float32 rounding of the result (0.53 ulp at most where
    ``|x| > 0.01``) plus, for weights near 0, one float32 rounding of an
    update's size. A float64 sum would only change the result for updates
    below float32's resolution of the weights, which a float32 model cannot
    hold anyway; it is used where it does matter: float64 models, and integer
    arrays (exact counts up to 2**53). The norm's sum of squares is float32
    within a block of ``fold_kernel.BLOCK`` (NumPy: a chunk) elements and
    float64 across them.

    Clipping: :meth:`add` returns the update's L2 norm ``||delta_i||`` (over its
    float arrays), computed in the same pass, and with ``max_norm`` scales the
    update by ``min(1, max_norm / ||delta_i||)`` before it counts (norm
    clipping, e.g. Sun et al., "Can You Really Backdoor Federated Learning?",
    2019, Sec. 4). The norm is known only at the end of the pass, so a clipped
    update is read a second time to take back its excess; unclipped updates
    cost nothing extra.
    """

    def __init__(
        self,
        memory: Mapping[str, np.ndarray] | None = None,
        spare: Mapping[str, np.ndarray] | None = None,
    ) -> None:
        self._sum: dict[str, np.ndarray] = {}
        self._pool: dict[str, list[np.ndarray]] = {}
        for given in (spare or {}, memory or {}):  # memory first (popped last)
            for name, array in given.items():
                self._pool.setdefault(name, []).append(array)
        self._staged: dict[str, np.ndarray] | None = None
        self._buffers: dict[np.dtype, np.ndarray] = {}
        self.total_weight = 0.0
        self.weighted_steps = 0.0
        self.count = 0
        self._spent = False

    def _check_open(self) -> None:
        if self._spent:
            raise RuntimeError(
                "UpdateAccumulator.result() was taken (in the sum's memory): "
                "fold further updates into a new accumulator"
            )

    def add(
        self,
        arrays: Mapping[str, np.ndarray],
        base: Mapping[str, np.ndarray],
        weight: float,
        *,
        scale: float = 1.0,
        steps: float = 1.0,
        max_norm: float | None = None,
    ) -> float:
        """Fold one update in; return its L2 norm ``||x - base||`` before scaling.

        ``arrays`` and ``base`` may be dropped (or reused) afterwards; ``arrays``
        may be read-only views and of another float dtype than ``base``.

        Raises
        ------
        ValueError
            When ``weight`` (or ``max_norm``) is not finite and > 0.
        ReplyRejected
            When an array of the update contains NaN or Inf, or differences too
            large to sum (over ~1.8e19); the sum is then left as it was (to
            within one rounding per element already folded).
        """
        (outcome,) = self.add_many(
            [Update(arrays, base, weight, scale, steps, max_norm)]
        )
        if isinstance(outcome, ReplyRejected):
            raise outcome
        return outcome

    def add_many(
        self,
        updates: Sequence[Update],
        *,
        keep: Callable[[list[float | ReplyRejected]], bool] | None = None,
    ) -> list[float | ReplyRejected]:
        """Fold several updates in one pass; each one's norm, or why it was rejected.

        Equal to calling :meth:`add` on each in order (the same sum, bit for
        bit, when none is rejected), but replies sharing their base arrays (the
        same objects) are folded together, chunk by chunk (see the class). A
        rejected update (NaN/Inf) is returned as its :class:`ReplyRejected` and
        leaves the sum as it was; the others still count.

        ``keep``: the updates count only if ``keep(outcomes)`` says so, once
        their norms are known; otherwise the sum is as it was, exactly. The
        pass then writes the sum plus the updates to other memory (the same
        memory traffic: the sum is read and a sum written either way) and
        keeps it or drops it, each array's other sum going back to memory
        for the next time (:meth:`leftover`). This lets a caller decide what
        an update may count for (a bound needing its norm) after one pass for
        the group, and fold it again with that decision when the decision
        differs from what was folded (:class:`flowerbed.strategies.robust.
        BoundedSum`): an unbounded update is never taken back out of the sum,
        which would cancel the other updates' digits in float32.

        Raises
        ------
        ValueError
            When a ``weight`` (or ``max_norm``) is not finite and > 0, before
            anything is folded.
        """
        for update in updates:
            check_positive("weight", update.weight)
            check_positive("max_norm", update.max_norm)
        self._check_open()
        groups: dict[tuple[object, ...], list[int]] = {}
        for i, update in enumerate(updates):
            names = tuple(update.arrays)
            key = (names, *(id(update.base.get(name)) for name in names))
            groups.setdefault(key, []).append(i)
        outcomes: list[float | ReplyRejected] = [0.0] * len(updates)
        if keep is not None:
            self._staged = {}
        try:
            for members in groups.values():
                for i, outcome in zip(
                    members,
                    self._fold_group([updates[i] for i in members]),
                    strict=True,
                ):
                    outcomes[i] = outcome
        finally:
            staged, self._staged = self._staged, None
        if staged is not None:
            kept = keep is not None and keep(outcomes)
            for name, array in staged.items():
                free: np.ndarray | None = array
                if kept:  # the sum so far becomes free memory
                    free, self._sum[name] = self._sum.get(name), array
                if free is not None:
                    self._pool.setdefault(name, []).append(free)
            if not kept:
                return outcomes
        for update, outcome in zip(updates, outcomes, strict=True):
            if not isinstance(outcome, ReplyRejected):
                self.total_weight += update.weight
                self.weighted_steps += update.weight * update.steps
                self.count += 1
        return outcomes

    def _fold_group(self, group: Sequence[Update]) -> list[float | ReplyRejected]:
        """Fold updates whose arrays have the same names and base objects."""
        factors = [u.weight * u.scale for u in group]
        squares = [0.0] * len(group)
        rejected: dict[int, tuple[ReplyRejected, str, int]] = {}
        names = list(group[0].arrays)
        for name in names:
            live = [j for j in range(len(group)) if j not in rejected]
            if not live:
                break
            base = group[0].base[name]
            values = [group[j].arrays[name] for j in live]
            found, failures = self._fold(name, values, base, [factors[j] for j in live])
            for k, j in enumerate(live):
                squares[j] += found[k]
            for k, (rejection, start) in failures.items():
                rejected[live[k]] = (rejection, name, start)
        outcomes: list[float | ReplyRejected] = []
        for j, update in enumerate(group):
            if j in rejected:  # take back what was folded of it
                rejection, failed, start = rejected[j]
                for name in names[: names.index(failed)]:
                    self._fold(
                        name, [update.arrays[name]], update.base[name], [-factors[j]]
                    )
                if start:
                    value = np.ravel(update.arrays[failed])[:start]
                    base = np.ravel(update.base[failed])[:start]
                    self._fold(failed, [value], base, [-factors[j]])
                outcomes.append(rejection)
                continue
            norm = math.sqrt(squares[j])
            if update.max_norm is not None and norm > update.max_norm:
                excess = factors[j] * (update.max_norm / norm - 1.0)
                for name in names:
                    if np.asarray(update.arrays[name]).dtype.kind == "f":
                        self._fold(
                            name, [update.arrays[name]], update.base[name], [excess]
                        )
            outcomes.append(norm)
        return outcomes

    def leftover(self) -> dict[str, np.ndarray]:
        """Memory given (``memory``, ``spare``) or freed (a sum a staged group
        replaced) and not used: worth keeping for the next accumulator's
        ``spare``."""
        return {name: arrays[-1] for name, arrays in self._pool.items() if arrays}

    def _new_sum(self, name: str, size: int, dtype: np.dtype) -> np.ndarray:
        """Memory for the sum of ``name`` (not written): the array of the same
        name, size and dtype given as ``memory``, else new memory."""
        arrays = self._pool.get(name)
        given = arrays.pop() if arrays else None
        if (
            isinstance(given, np.ndarray)
            and given.size == size
            and given.dtype == dtype
            and given.flags.writeable
            and given.flags.c_contiguous
        ):
            return given.reshape(-1)
        return np.empty(size, dtype)

    def _buffer(self, dtype: np.dtype) -> np.ndarray:
        if dtype not in self._buffers:
            self._buffers[dtype] = np.empty(FOLD_CHUNK, dtype)
        return self._buffers[dtype]

    def _fold(
        self,
        name: str,
        values: Sequence[np.ndarray],
        base: np.ndarray,
        factors: Sequence[float],
    ) -> tuple[list[float], dict[int, tuple[ReplyRejected, int]]]:
        """Add ``factor_k (value_k - base)`` into the sum, chunk by chunk.

        Returns each value's sum of squares and, for each value with a
        non-finite (or too large) chunk, its rejection and where that chunk
        starts: such a value is not folded from there on (the caller takes
        back what was).
        """
        flat = [
            np.ravel(v) for v in values
        ]  # C order, as the base: a copy only if Fortran
        base = np.ravel(base)
        dtype = _sum_dtype(base.dtype)
        compiled = fold_kernel.kernel() if base.dtype == dtype else None
        sums = self._sum if self._staged is None else self._staged
        # Staged (add_many's ``keep``): the sum so far stays as it is, and the
        # first fold of each array writes it plus the values to new memory.
        source = self._sum.get(name) if sums is not self._sum else None
        if compiled is not None and all(v.dtype == dtype for v in flat):
            fresh = name not in sums
            if fresh:  # the kernel writes it: no zeros to write first
                sums[name] = self._new_sum(name, base.size, dtype)
            total = sums[name]
            return self._fold_compiled(
                compiled,
                name,
                flat,
                base,
                total,
                factors,
                fresh and source is None,
                source if fresh else None,
            )
        if name not in sums:
            sums[name] = self._new_sum(name, base.size, dtype)
            if source is None:
                sums[name].fill(0)
            else:
                np.copyto(sums[name], source)
        total = sums[name]
        scalars = [dtype.type(f) for f in factors]  # as NumPy rounds a Python float
        squares = [0.0] * len(flat)
        failed: dict[int, tuple[ReplyRejected, int]] = {}
        live = list(range(len(flat)))
        with np.errstate(over="ignore", invalid="ignore"):
            for start in range(0, base.size, FOLD_CHUNK):
                stop = min(start + FOLD_CHUNK, base.size)
                part = base[start:stop]
                into = total[start:stop]
                for k in live:
                    delta = self._buffer(dtype)[: stop - start]
                    np.subtract(flat[k][start:stop], part, out=delta, casting="unsafe")
                    chunk = float(np.dot(delta, delta))
                    if not math.isfinite(chunk):
                        failed[k] = (_rejection(name, delta), start)
                        continue
                    delta *= scalars[k]
                    into += delta
                    squares[k] += chunk
                if failed and len(failed) > len(flat) - len(live):
                    live = [k for k in live if k not in failed]
        if base.dtype.kind != "f":
            squares = [0.0] * len(flat)
        return squares, failed

    @staticmethod
    def _fold_compiled(
        compiled: fold_kernel.Kernel,
        name: str,
        flat: Sequence[np.ndarray],
        base: np.ndarray,
        total: np.ndarray,
        factors: Sequence[float],
        fresh: bool,
        source: np.ndarray | None = None,
    ) -> tuple[list[float], dict[int, tuple[ReplyRejected, int]]]:
        """:meth:`_fold` by the compiled kernel: one call for all the values
        (``fresh``: ``total`` is not written yet; ``source``: the sum so far,
        which ``total``, not written yet, is to replace)."""
        dtype = total.dtype
        # The kernel compiles once per tuple type: the values as read-only
        # views, in tuples of fold_kernel.MOST and one of the rest.
        flat = [v if not v.flags.writeable else _read_only(v) for v in flat]
        scalars = np.array(factors, dtype)  # as NumPy rounds a Python float
        squares: list[float] = []
        stopped: list[int] = []
        for first in range(0, len(flat), fold_kernel.MOST):
            count = min(fold_kernel.MOST, len(flat) - first)
            values = flat[first : first + count]
            factors_now = scalars[first : first + count]
            starts = fresh and first == 0
            if PAD_FROM <= count < fold_kernel.MOST and not starts:
                # Padded to four with the base itself at factor 0: it adds
                # exactly 0 and is read from cache (the same addresses as the
                # base), so two or three values fold together too.
                pad = fold_kernel.MOST - count
                values = values + [_read_only(base)] * pad
                factors_now = np.concatenate([factors_now, np.zeros(pad, dtype)])
            found, where = compiled(
                tuple(values),
                base,
                total,
                factors_now,
                dtype.type(0),
                starts,
                source if first == 0 else None,
            )
            squares += found[:count].tolist()
            stopped += where[:count].tolist()
        failed: dict[int, tuple[ReplyRejected, int]] = {}
        for k, start in enumerate(stopped):
            if start >= 0:
                block = slice(start, start + fold_kernel.BLOCK)
                failed[k] = (_rejection(name, flat[k][block] - base[block]), start)
        if base.dtype.kind != "f":
            squares = [0.0] * len(flat)
        return squares, failed

    def result(
        self,
        current: Mapping[str, np.ndarray],
        *,
        normalise_steps: bool = False,
        step_size: float = 1.0,
    ) -> dict[str, np.ndarray]:
        """Return ``current + eta m S / W`` in each array's own dtype.

        ``eta = step_size`` is a server learning rate (FedBuff's ``eta_g``).
        Float arrays with a sum of their own dtype are made in the sum's own
        memory, chunk by chunk (one pass over the sum and the model, while the
        chunk is in cache): no new model-sized allocation, whose first touch
        costs the kernel about as much as folding an update. The sum is then
        spent: the accumulator takes no more updates, and a second call raises.
        """
        if self.count == 0:
            raise ValueError("no updates to aggregate")
        self._check_open()
        self._spent = True
        m = self.weighted_steps / self.total_weight if normalise_steps else 1.0
        m *= step_size
        factor = m / self.total_weight
        finish = fold_kernel.finisher()
        out: dict[str, np.ndarray] = {}
        for name, value in current.items():
            total = self._sum[name]
            value = np.asarray(value)
            if value.dtype == total.dtype:
                flat = np.ravel(value)
                new = total
                if finish is not None:
                    finish(new, flat, total.dtype.type(factor))
                else:
                    for start in range(0, total.size, FOLD_CHUNK):
                        part = new[start : start + FOLD_CHUNK]
                        np.multiply(part, factor, out=part)
                        part += flat[start : start + FOLD_CHUNK]
                new = new.reshape(value.shape)
            else:
                new = np.multiply(total, factor, dtype=total.dtype).reshape(value.shape)
                new += value
            if value.dtype.kind in "iub":
                new = np.rint(new)
            out[name] = new.astype(value.dtype, copy=False)
        return out


def _metric_shape(value: object) -> int | None:
    """None for a number, the length of a list: what averaging needs to agree."""
    return len(value) if isinstance(value, list) else None


class MetricsAccumulator:
    """Keeps only the MetricRecords of accepted replies (small), for aggregation."""

    def __init__(self, weighted_by_key: str) -> None:
        self.weighted_by_key = weighted_by_key
        self.records: list[RecordDict] = []

    def add(self, metrics: MetricRecord, weight: float) -> None:
        """Keep ``metrics`` with ``weight`` as its weighting value."""
        kept = MetricRecord(dict(metrics))
        kept[self.weighted_by_key] = weight
        self.records.append(RecordDict({keys.METRICS: kept}))

    def cap(self, most: float) -> int:
        """Count no record's weight above ``most`` (the influence bound's cap);
        return how many weights it lowered."""
        lowered = 0
        for weight, kept in zip(self.weights(), self._kept(), strict=True):
            if weight > most:
                kept[self.weighted_by_key] = most
                lowered += 1
        return lowered

    def weights(self) -> list[float]:
        """The kept records' weights, in the order they were added."""
        return [float(kept[self.weighted_by_key]) for kept in self._kept()]  # type: ignore[arg-type]

    def _kept(self) -> list[MetricRecord]:
        kept = [record[keys.METRICS] for record in self.records]
        assert all(isinstance(k, MetricRecord) for k in kept)
        return kept  # type: ignore[return-value]

    def result(
        self, aggr_fn: Callable[[list[RecordDict], str], MetricRecord]
    ) -> MetricRecord | None:
        """Aggregate with Flower's ``(list[RecordDict], str) -> MetricRecord``,
        after :meth:`agree`."""
        if not self.records:
            return None
        self.agree()
        return aggr_fn(self.records, self.weighted_by_key)

    def agree(self) -> None:
        """Leave a metric out of the replies where it has another shape than in
        most: a number where most have a list, or a list of another length.

        Flower's average of MetricRecords raises on both, which would end the
        run; rejecting the whole reply would let one fast node's odd metric
        reject every honest reply after it. So the replies' updates all count,
        and only the odd metric values are dropped (logged).
        """
        kept = self._kept()
        shapes: dict[str, Counter[int | None]] = {}
        for record in kept:
            for key, value in record.items():
                shapes.setdefault(key, Counter())[_metric_shape(value)] += 1
        for key, counts in shapes.items():
            if len(counts) == 1 or key == self.weighted_by_key:
                continue
            usual = max(counts, key=lambda shape: (counts[shape], shape is None))
            odd = [r for r in kept if key in r and _metric_shape(r[key]) != usual]
            for record in odd:
                del record[key]
            log(
                WARNING,
                "metric %r left out of %d replies: not %s as in the other %d",
                key,
                len(odd),
                "a number" if usual is None else f"a list of {usual}",
                counts[usual],
            )


# ---------------------------------------------------------------------------------
# Quarantine
# ---------------------------------------------------------------------------------


class Quarantine:
    """Bench nodes whose replies keep being rejected.

    After ``after`` consecutive faulty replies a node sits out ``rounds`` rounds;
    an accepted reply resets its count.
    """

    def __init__(self, after: int = 3, rounds: int = 5) -> None:
        if after < 1:
            raise ValueError(f"quarantine_after must be >= 1, got {after}")
        if rounds < 0:
            raise ValueError(f"quarantine_rounds must be >= 0, got {rounds}")
        self.after = after
        self.rounds = rounds
        self.failures: dict[int, int] = {}
        self.until: dict[int, int] = {}

    def record_failure(self, node_id: int, server_round: int) -> None:
        """Count a rejected reply; quarantine the node when the count reaches limit."""
        self.failures[node_id] = self.failures.get(node_id, 0) + 1
        if self.failures[node_id] >= self.after and self.rounds > 0:
            self.until[node_id] = server_round + self.rounds
            self.failures[node_id] = 0
            log(
                WARNING,
                "node %d quarantined after %d rejected replies: out until round %d",
                node_id,
                self.after,
                self.until[node_id],
            )

    def record_success(self, node_id: int) -> None:
        """An accepted reply clears the node's count."""
        self.failures.pop(node_id, None)

    def is_quarantined(self, node_id: int, server_round: int) -> bool:
        """True while ``server_round`` is at or before the node's release round."""
        return self.until.get(node_id, -1) >= server_round

    def state(self) -> dict[str, Any]:
        """JSON-able state for checkpoints."""
        return {
            "failures": {str(k): v for k, v in self.failures.items()},
            "until": {str(k): v for k, v in self.until.items()},
        }

    def load_state(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state` returned."""
        self.failures = {int(k): int(v) for k, v in state["failures"].items()}
        self.until = {int(k): int(v) for k, v in state["until"].items()}


# ---------------------------------------------------------------------------------
# Push and pull on a clock
# ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Ticket:
    """What the strategy remembers about one message in flight."""

    node_id: int
    server_round: int
    sent_at: float
    kind: str
    assigned_steps: int | None = None


def _assigned_steps(message: Message) -> int | None:
    for config in records_of(message.content, ConfigRecord):
        steps = config.get(keys.LOCAL_STEPS)
        if isinstance(steps, int) and not isinstance(steps, bool):
            return steps
    return None


class InFlight:
    """Messages pushed and not yet consumed, pulled on the grid's clock.

    A reply pulled from the grid but not yet handed out (the consumer said it was
    done mid-batch) waits in a backlog and comes out first next time.
    """

    def __init__(self, grid: Grid, clock: Clock) -> None:
        self.grid = grid
        self.clock = clock
        self.tickets: dict[str, Ticket] = {}
        self._backlog: list[tuple[Message, Ticket, float]] = []

    def push(self, messages: Iterable[Message], server_round: int) -> list[str]:
        """Push ``messages``; remember each one's node, round and send time."""
        batch = list(messages)
        if not batch:
            return []
        sent_at = self.clock.now()
        ids = list(self.grid.push_messages(batch))
        pushed = []
        for message, message_id in zip(batch, ids, strict=False):
            if not message_id:
                log(WARNING, "push to node %d failed", message.metadata.dst_node_id)
                continue
            self.tickets[message_id] = Ticket(
                node_id=message.metadata.dst_node_id,
                server_round=server_round,
                sent_at=sent_at,
                kind=message.metadata.message_type,
                assigned_steps=_assigned_steps(message),
            )
            pushed.append(message_id)
        return pushed

    def busy_nodes(self, kind: str | None = None) -> set[int]:
        """Nodes with a message of ``kind`` (any kind if None) not yet answered."""
        return {
            t.node_id for t in self.tickets.values() if kind is None or t.kind == kind
        }

    def forget(self, message_ids: Iterable[str]) -> None:
        """Stop waiting for these messages (their replies will be ignored)."""
        gone = set(message_ids)
        for message_id in gone:
            self.tickets.pop(message_id, None)
        self._backlog = [
            item
            for item in self._backlog
            if item[0].metadata.reply_to_message_id not in gone
        ]

    def ids(self, predicate: Callable[[Ticket], bool]) -> list[str]:
        """IDs of unanswered messages whose ticket satisfies ``predicate``."""
        return [i for i, t in self.tickets.items() if predicate(t)]

    def unconsumed(self) -> list[tuple[str, Ticket]]:
        """(message id, ticket) of every message not answered yet or whose reply
        waits in the backlog."""
        waiting = [(i, t) for i, t in self.tickets.items()]
        return waiting + [
            (m.metadata.reply_to_message_id, t) for m, t, _ in self._backlog
        ]

    def outstanding(self, predicate: Callable[[Ticket], bool]) -> bool:
        """True if a matching message is unanswered or its reply not yet consumed."""
        return any(predicate(t) for t in self.tickets.values()) or any(
            predicate(t) for _, t, _ in self._backlog
        )

    def _keep(self, replies: Iterable[Message]) -> None:
        """Put pulled replies nobody has taken yet into the backlog."""
        for reply in replies:
            ticket = self.tickets.pop(reply.metadata.reply_to_message_id, None)
            if ticket is not None:
                self._backlog.append((reply, ticket, self.clock.now()))

    def replies(
        self,
        until: float,
        *,
        kind: str | None = None,
        done: Callable[[], bool] | None = None,
    ) -> Iterator[tuple[Message, Ticket, float]]:
        """Yield ``(reply, ticket, arrival time)`` one at a time as replies arrive.

        Only messages of ``kind`` (all if None) are pulled. Stops when none of them
        is outstanding, when ``done()`` is true, or when the clock passes ``until``.
        Waiting goes through the clock, so on the virtual clock the loop jumps from
        one arrival to the next. Replies pulled but not handed out (``done()``
        turned true, or the consumer closed the iterator) wait in the backlog.
        """

        def matches(ticket: Ticket) -> bool:
            return kind is None or ticket.kind == kind

        def stop() -> bool:
            return done is not None and done()

        while not stop():
            backlog = [i for i, item in enumerate(self._backlog) if matches(item[1])]
            if backlog:
                yield self._backlog.pop(backlog[0])
                continue
            wanted = self.ids(matches)
            if not wanted:
                return
            arrived = False
            batch = list(self.grid.pull_messages(wanted))
            for index, reply in enumerate(batch):
                ticket = self.tickets.pop(reply.metadata.reply_to_message_id, None)
                if ticket is None:
                    continue
                arrived = True
                item = (reply, ticket, self.clock.now())
                if stop():
                    self._backlog.append(item)
                    continue
                try:
                    yield item
                except GeneratorExit:  # the consumer stopped early: keep the rest
                    self._keep(batch[index + 1 :])
                    raise
            if arrived:
                continue
            remaining = until - self.clock.now()
            if remaining <= 0:
                return
            self.clock.wait(remaining)


@dataclass
class Arrival:
    """What the round loop knows about a reply it hands to ``aggregate_train``.

    The loop files one under the reply's ``reply_to_message_id`` before handing
    the reply over; ``aggregate_train`` looks it up and, without one (a reply
    from a direct call, as in Flower's own tests), treats the reply as fresh work
    on the last global model. ``discount`` multiplies the reply's weight and
    ``update_scale`` its update (staleness); ``accepted`` is set once the reply
    has been validated (None: not looked at, e.g. by an overriding
    ``aggregate_train`` that does its own averaging). ``settle``, while set,
    folds the reply's group now (``aggregate_train`` folds replies a few at a
    time, so a reply validated but not yet folded is not yet known to be
    usable: its NaN/Inf check is in the fold); :attr:`usable` calls it.
    """

    ticket: Ticket
    arrived: float
    base: Mapping[str, np.ndarray]
    staleness: int = 0
    discount: float = 1.0
    update_scale: float = 1.0
    error_code: int | None = None
    accepted: bool | None = None
    fault: bool = False
    reason: str = ""
    settle: Callable[[], object] | None = None

    @property
    def usable(self) -> bool:
        """Accepted, or (when nobody validated it) at least not an error reply."""
        if self.settle is not None:
            self.settle()
        if self.accepted is None:
            return self.error_code is None
        return self.accepted


def enough_usable(arrivals: Iterable[Arrival], wanted: int) -> bool:
    """Whether at least ``wanted`` of ``arrivals`` are usable, folding replies
    that wait for their group (:attr:`Arrival.settle`) only when their outcome
    decides it."""
    settled = 0
    waiting: list[Arrival] = []
    for arrival in arrivals:
        if arrival.settle is not None:
            waiting.append(arrival)
        else:
            settled += arrival.usable
    if settled >= wanted or settled + len(waiting) < wanted:
        return settled >= wanted
    return settled + sum(a.usable for a in waiting) >= wanted


class ReplyStream:
    """Replies handed to ``aggregate_train``/``aggregate_evaluate`` as they arrive.

    Iterable once, so the strategy never holds more than one reply (streaming,
    O(model) memory); a second iteration yields nothing and says so, since
    an overriding method that needs two passes must keep them itself
    (``replies = list(replies)``).
    """

    def __init__(self, source: Iterator[Message]) -> None:
        self._source: Iterator[Message] | None = source

    def __iter__(self) -> Iterator[Message]:
        if self._source is None:
            log(
                WARNING,
                "the replies were iterated twice; they stream past once to keep "
                "memory at one model: take list(replies) first to read them twice",
            )
            return iter(())
        source, self._source = self._source, None
        return source


def sample_nodes(
    grid: Grid,
    clock: Clock,
    *,
    count: int,
    min_available: int,
    exclude: set[int],
    rng: random.Random,
    timeout: float,
) -> list[int]:
    """Pick ``count`` connected nodes not in ``exclude`` (fewer if not enough).

    Waits on the clock, at most ``timeout`` seconds, until ``min_available`` nodes
    are connected (as Flower's own sampling does).
    """
    give_up = clock.now() + timeout
    nodes = sorted(grid.get_node_ids())
    while len(nodes) < min_available and clock.now() < give_up:
        log(
            INFO,
            "waiting for nodes: %d connected, %d needed",
            len(nodes),
            min_available,
        )
        clock.wait(WAIT_FOR_NODES_S)
        nodes = sorted(grid.get_node_ids())
    eligible = [n for n in nodes if n not in exclude]
    return rng.sample(eligible, min(count, len(eligible)))


def round_rng(seed: int, server_round: int, purpose: str) -> random.Random:
    """A generator fixed by (seed, round, purpose): resumed runs sample the same."""
    return random.Random(f"{seed}:{server_round}:{purpose}")


# ---------------------------------------------------------------------------------
# Checkpoints
# ---------------------------------------------------------------------------------

CHECKPOINT_FORMAT = "flowerbed-checkpoint/1"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used (corrupt, or from a different run)."""


def _digest(arrays: Mapping[str, np.ndarray], state_json: bytes) -> str:
    h = hashlib.sha256(state_json)
    for name in sorted(arrays):
        value = np.ascontiguousarray(arrays[name])
        h.update(name.encode())
        h.update(str(value.dtype).encode())
        h.update(str(value.shape).encode())
        h.update(value.tobytes())
    return h.hexdigest()


def save_checkpoint(
    path: str | Path, arrays: Mapping[str, np.ndarray], state: Mapping[str, Any]
) -> None:
    """Write arrays and JSON-able state atomically (temp file, fsync, os.replace)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(path)
    state_json = json.dumps(
        {"format": CHECKPOINT_FORMAT, "state": state}, sort_keys=True
    ).encode()
    header = json.dumps(
        {"names": list(arrays), "sha256": _digest(arrays, state_json)}
    ).encode()
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            with zipfile.ZipFile(f, "w", compression=zipfile.ZIP_STORED) as z:
                z.writestr("state.json", state_json)
                z.writestr("header.json", header)
                for i, value in enumerate(arrays.values()):
                    buf = io.BytesIO()
                    np.save(buf, np.ascontiguousarray(value), allow_pickle=False)
                    z.writestr(f"arrays/{i}.npy", buf.getvalue())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def remove_stale_temporaries(path: str | Path) -> list[Path]:
    """Delete temporary files a killed :func:`save_checkpoint` left beside ``path``.

    They are named ``<name>.<random>.tmp``; the checkpoint itself is only ever
    replaced whole, so they hold nothing worth keeping. Returns what was removed.
    """
    path = Path(path)
    removed = []
    for stale in path.parent.glob("*.tmp"):
        if not stale.name.startswith(path.name + "."):
            continue
        stale.unlink(missing_ok=True)
        removed.append(stale)
    if removed:
        log(WARNING, "removed %d stale checkpoint temporary file(s)", len(removed))
    return removed


def _checkpoint_error(path: Path, what: str) -> CheckpointError:
    return CheckpointError(
        f"checkpoint {path} is unreadable or corrupt ({what}); delete it to start "
        "afresh or point checkpoint_path elsewhere"
    )


def load_checkpoint(
    path: str | Path, reference: ArrayRecord
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Read a checkpoint whole, verify it, and return ``(arrays, state)``.

    Raises
    ------
    CheckpointError
        When the file is unreadable or corrupt, or its arrays do not match
        ``reference`` (names, shapes, dtypes). Nothing is returned half-loaded.
    """
    path = Path(path)
    try:
        with zipfile.ZipFile(path) as z:
            state_json = z.read("state.json")
            header = json.loads(z.read("header.json"))
            if not (
                isinstance(header, dict)
                and isinstance(header.get("names"), list)
                and all(isinstance(n, str) for n in header["names"])
                and isinstance(header.get("sha256"), str)
            ):
                raise _checkpoint_error(path, "header.json is not {names, sha256}")
            arrays = {
                name: np.load(io.BytesIO(z.read(f"arrays/{i}.npy")), allow_pickle=False)
                for i, name in enumerate(header["names"])
            }
        payload = json.loads(state_json)
    except CheckpointError:
        raise
    except (OSError, KeyError, ValueError, TypeError, zipfile.BadZipFile) as err:
        raise _checkpoint_error(path, str(err)) from err
    if not isinstance(payload, dict) or not isinstance(payload.get("state"), dict):
        raise _checkpoint_error(path, "state.json is not {format, state}")
    if payload.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(
            f"checkpoint {path} has format {payload.get('format')!r}, "
            f"expected {CHECKPOINT_FORMAT!r}"
        )
    if _digest(arrays, state_json) != header.get("sha256"):
        raise CheckpointError(f"checkpoint {path} fails its checksum: corrupt")
    expected = {n: (tuple(a.shape), a.dtype) for n, a in reference.items()}
    found = {n: (tuple(a.shape), str(a.dtype)) for n, a in arrays.items()}
    if expected != found:
        raise CheckpointError(
            f"checkpoint {path} holds arrays {found}, but the model has {expected}: "
            "it belongs to a different model"
        )
    return arrays, payload["state"]


def metricrecord_to_json(record: MetricRecord) -> dict[str, Any]:
    """A MetricRecord as a plain dict (values are numbers or lists of numbers)."""
    return dict(record)


def metric_history_to_json(history: Mapping[int, MetricRecord]) -> dict[str, Any]:
    """``{round: MetricRecord}`` as JSON-able data."""
    return {str(r): metricrecord_to_json(m) for r, m in history.items()}


def metric_history_from_json(data: Mapping[str, Any]) -> dict[int, MetricRecord]:
    """Inverse of :func:`metric_history_to_json`."""
    return {int(r): MetricRecord(m) for r, m in data.items()}
