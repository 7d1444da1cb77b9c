"""What a pipeline member reports of its segment's timing.

The server multiplies the reported step and replication times by a segment's
steps to tell the segment's set-up from its steps (``SpanJobStrategy``'s set-up
share), so they must be means: a median, below the mean when a few steps run
long, leaves part of every step counted as set-up.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from flowerbed import keys
from flowerbed.parallel.pipeline import stage


def _reported(step_s: list[float], replicate_s: list[float], exchange_s: list[float]):  # type: ignore[no-untyped-def]
    plan = SimpleNamespace(start_step=0, micro_batches=2, batch_size=8)
    seg = stage._Segment(plan)  # type: ignore[arg-type]
    seg.step_s, seg.done = step_s, len(step_s)
    seg.replicate_s, seg.exchange_s, seg.replicate_bytes = replicate_s, exchange_s, 100
    timed = SimpleNamespace(forward_s=[0.1] * 6, backward_s=[0.2] * 6, overrun_s=0.0)
    store = SimpleNamespace(entries=lambda: [])
    return stage._metrics(plan, seg, timed, store, "", arrived=0.0)  # type: ignore[arg-type]


def test_step_and_replication_times_are_means_over_the_steady_steps() -> None:
    # The first step's one-off costs are left out; one long step of four moves
    # the mean (what four steps cost), not the median.
    metrics = _reported([5.0, 1.0, 1.0, 1.0, 3.0], [0.5, 1.5], [0.2, 0.6])
    assert metrics[keys.SPAN_STEP_S] == pytest.approx(1.5)
    assert metrics[keys.SPAN_REPLICATE_S] == pytest.approx(1.0)
    # The link speed is the exchange's alone: bytes over its median seconds.
    assert metrics[keys.SPAN_LINK_BYTES_PER_S] == pytest.approx(100 / 0.4)
