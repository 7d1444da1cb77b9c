"""How fast the server learns that a span member is gone (strategies/span.py).

On a scripted grid with a virtual clock (test_strategies_fakes): node 1 answers
2 s after the push that it lost a peer, node 2 never answers (its board died;
Flower would answer for it only when its heartbeat expires). The grace period
for silent members is timeout_s + reply_margin_s = 13 s.
"""

from __future__ import annotations

from collections.abc import Iterable

import pytest
from flowerbed import keys
from flowerbed.strategies.span import (
    LIVENESS_CHECK_S,
    LOST_CONFIRM_S,
    SegmentOutcome,
    SpanJobStrategy,
)
from flowerbed.strategies.span_options import SpanGroup
from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict
from plans import member_plan
from test_strategies_fakes import FakeGrid

GRACE_S = 13.0


def failed(message: Message, lost_ranks: list[int]) -> Message:
    metrics: dict = {keys.SPAN_OK: 0}
    if lost_ranks:
        metrics[keys.SPAN_LOST_RANKS] = lost_ranks
    return Message(
        RecordDict(
            {
                keys.METRICS: MetricRecord(metrics),
                keys.SPAN_RECORD: ConfigRecord({"failure": "train: lost a peer"}),
            }
        ),
        reply_to=message,
    )


def run(grid: FakeGrid) -> SegmentOutcome:
    s = SpanJobStrategy(group=SpanGroup(timeout_s=10, reply_margin_s=3))
    s.attach(grid)
    plans = {
        node: member_plan("probe", "t", rank=rank, world_size=2)
        for rank, node in enumerate((1, 2))
    }
    messages = s.segment_messages(plans, {}, {}, ConfigRecord(), 600)
    return s.run_segment(messages, 1, 600)


def test_a_member_its_peers_name_gone_is_lost_a_second_after_the_others_answered() -> (
    None
):
    grid = FakeGrid({1: lambda m: (failed(m, [1]), 2.0), 2: lambda m: (None, 600)})
    out = run(grid)
    assert out.lost == {2}
    assert out.seconds == pytest.approx(2.0 + LOST_CONFIRM_S)
    assert out.seconds < GRACE_S


def test_a_named_member_whose_reply_comes_in_time_is_not_lost() -> None:
    grid = FakeGrid(
        {1: lambda m: (failed(m, [1]), 2.0), 2: lambda m: (failed(m, []), 2.5)}
    )
    out = run(grid)
    assert out.lost == set()
    assert sorted(out.replies) == [1, 2]


class Deregistering(FakeGrid):
    """The SuperLink stops listing node 2 at t = 4 s (it left)."""

    def get_node_ids(self) -> Iterable[int]:
        return [1] if self.clock.t >= 4.0 else [1, 2]


def test_a_silent_member_the_superlink_no_longer_lists_is_lost_without_the_grace() -> (
    None
):
    grid = Deregistering({1: lambda m: (failed(m, []), 2.0), 2: lambda m: (None, 600)})
    out = run(grid)
    assert out.lost == {2}
    # found by the server's own check, at most a check period after it left
    assert out.seconds <= 4.0 + LIVENESS_CHECK_S + LOST_CONFIRM_S
    assert out.seconds < GRACE_S


def test_a_silent_member_nobody_names_is_waited_for_the_grace_period() -> None:
    grid = FakeGrid({1: lambda m: (failed(m, []), 2.0), 2: lambda m: (None, 600)})
    out = run(grid)
    assert out.lost == {2}
    assert out.seconds == pytest.approx(2.0 + GRACE_S)


def test_the_group_s_old_keywords_still_work_and_warn() -> None:
    with pytest.warns(DeprecationWarning, match=r"group=SpanGroup\(timeout_s=10"):
        s = SpanJobStrategy(timeout_s=10, reply_margin_s=3)
    assert s.group == SpanGroup(timeout_s=10, reply_margin_s=3)
    assert (s.timeout_s, s.reply_margin_s, s.rendezvous_port) == (10.0, 3.0, 29500)
    with pytest.raises(TypeError, match="put them in the SpanGroup"):
        SpanJobStrategy(group=SpanGroup(), timeout_s=10)
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        SpanGroup(timeout_s=0)
