"""What ClusterSelection reads from replies: observations, timed exchanges."""

from __future__ import annotations

import math
from collections.abc import Sequence

from flowerbed import keys
from flowerbed.clock import Clock
from flowerbed.replies import MAX_METRIC_MAGNITUDE, METRIC_RANGES
from flwr.app import (
    Message,
    MetricRecord,
)
from flwr.serverapp import Grid

from .model import Observation


def _metrics(reply: Message) -> MetricRecord | None:
    if reply.has_error():
        return None
    records = list(reply.content.metric_records.values())
    return records[0] if records else None


def _number(metrics: MetricRecord, key: str) -> float | None:
    """A finite number in the metric's valid range (``METRIC_RANGES``), or None:
    an unusable value counts as unknown."""
    value = metrics.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    number = float(value)
    low, high, _ = METRIC_RANGES.get(key, (0.0, MAX_METRIC_MAGNITUDE, ""))
    return number if math.isfinite(number) and low <= number <= high else None


def observation_of(
    reply: Message, round_trip_s: float, steps: int, transfers: int
) -> Observation | None:
    """An :class:`Observation` from a successful reply, None for an unusable one.

    ``steps`` is what the task asked for; the reply's ``num-steps`` wins when sent.
    A metric that is not a finite number in its valid range counts as not sent,
    so a node with unusable timings is timed by its round trip instead.
    """
    metrics = _metrics(reply)
    if metrics is None:
        return None
    done = _number(metrics, keys.NUM_STEPS)
    steps = int(done) if done is not None else steps
    if steps < 1:
        return None
    return Observation(
        steps=steps,
        round_trip_s=round_trip_s,
        train_time_s=_number(metrics, keys.TRAIN_TIME_S),
        comm_time_s=_number(metrics, keys.COMM_TIME_S),
        energy_j=_number(metrics, keys.ENERGY_J),
        power_w=_number(metrics, keys.POWER_W),
        transfers=transfers,
    )


def timed_exchange(
    grid: Grid, clock: Clock, messages: Sequence[Message], timeout: float
) -> dict[int, tuple[Message, float]]:
    """Push ``messages``; return node id -> (reply, seconds from push to pull).

    Replies are pulled as they arrive on the grid's clock (virtual time on the
    in-process engine); nodes silent for ``timeout`` seconds are left out.
    """
    start = clock.now()
    ids = list(grid.push_messages(messages))
    node_of = {
        mid: m.metadata.dst_node_id for mid, m in zip(ids, messages, strict=True)
    }
    got: dict[int, tuple[Message, float]] = {}
    while len(got) < len(ids):
        waiting = [mid for mid in ids if node_of[mid] not in got]
        for reply in grid.pull_messages(waiting):
            node = node_of[reply.metadata.reply_to_message_id]
            got[node] = (reply, clock.now() - start)
        remaining = start + timeout - clock.now()
        if len(got) == len(ids) or remaining <= 0:
            break
        clock.wait(remaining)
    return got
