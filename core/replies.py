"""Checks on what a node sends back: one implementation for the strategies and the
phone gateway.

Every number a reply reports is hostile until checked: finite, in range, and
named in the rejection message with the range it violated.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TypeVar

import numpy as np
from flowerbed import keys
from flowerbed.arrays import array_view
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Message,
    MetricRecord,
    RecordDict,
)
from flwr.common.constant import ErrorCode

R = TypeVar("R", ArrayRecord, MetricRecord, ConfigRecord)


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
AVERAGED_RANGES: dict[str, tuple[float, float, str]] = {
    keys.EVAL_ACC: (0.0, 1.0, "(a fraction)"),
    keys.EVAL_LOSS: (0.0, MAX_METRIC_MAGNITUDE, ""),
    keys.TRAIN_LOSS: (0.0, MAX_METRIC_MAGNITUDE, ""),
}
"""Valid range of flowerbed's metrics that are only averaged into the round's
metrics: a weighted mean of values in range stays in range, so one node cannot
make the round's accuracy 10^14. Other metrics are bounded in magnitude only
(:data:`MAX_METRIC_MAGNITUDE`)."""
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
    return _in_range(key, value, low, high, unit)


def _in_range(key: str, value: float, low: float, high: float, unit: str) -> float:
    """``value`` if finite and in ``[low, high]``; else why not, with the range."""
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
                if key in AVERAGED_RANGES:
                    low, high, unit = AVERAGED_RANGES[key]
                    _in_range(key, v, low, high, unit)
                elif abs(v) > MAX_METRIC_MAGNITUDE:
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
