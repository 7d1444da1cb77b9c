"""The pipeline's pure planners, against hand-worked cases.

Partition (FTPipeHD's DP), the schedule's makespan, replication counts and
recovery sources; no torch, no processes.
"""

from __future__ import annotations

import math

import pytest
from flowerbed.parallel.pipeline.makespan import (
    recovery_s,
    replicate_s,
    replications,
    schedule_order,
    segment_cost,
    step_s,
)
from flowerbed.parallel.pipeline.partition import (
    LayerCosts,
    evaluate,
    even_partition,
    moved_layers,
    partition,
)
from flowerbed.parallel.pipeline.planner import Layout, PipelinePlanner
from flowerbed.parallel.pipeline.recovery import Holdings, layer_sources, restart_step
from flowerbed.parallel.plan import PlanError


def uniform(layers: int, out_bytes: list[float] | None = None) -> LayerCosts:
    """Layers of 1 s each per micro-batch (1/3 s forward, 2/3 s backward)."""
    return LayerCosts(
        forward_s=(1 / 3,) * layers,
        backward_s=(2 / 3,) * layers,
        out_bytes=tuple(out_bytes or [1.0] * layers),
        state_bytes=(100.0,) * layers,
    )


# --- partition ------------------------------------------------------------------


def test_a_ten_times_slower_device_gets_one_layer_of_twelve() -> None:
    # Stage times: 5 and 6 layers at 1 s on the fast devices, 1 layer at 10 s on
    # the slow one: bottleneck 10 s. The even split [4, 4, 4] puts 4 x 10 = 40 s
    # on the slow device: the DP is 4x better. (Measured on three local processes:
    # [5, 6, 1] at 3.6x the even split's samples/s; docs/references.md.)
    best = partition(uniform(12), power=[1, 1, 10])
    assert best.sizes == [5, 6, 1]
    assert best.stage_s == pytest.approx((5.0, 6.0, 10.0))
    assert best.bottleneck_s == pytest.approx(10.0)
    even = evaluate(even_partition(12, 3), uniform(12), [1, 1, 10], [math.inf] * 2)
    assert even.bottleneck_s == pytest.approx(40.0)


def test_layers_follow_computing_power() -> None:
    # 8 layers, the second device 3x slower: k layers on the first, 8 - k on the
    # second: max(k, 3 (8 - k)) is least (6 s) at k = 6.
    best = partition(uniform(8), power=[1, 3])
    assert best.sizes == [6, 2]
    assert best.stage_s == pytest.approx((6.0, 6.0))


def test_a_slow_link_moves_the_cut_away_from_a_large_activation() -> None:
    # 4 layers of 1 s on two equal devices; layer 1's output is 100 bytes, the
    # others' 1 byte. Free links: cut in the middle, [2, 2], bottleneck 2 s.
    costs = uniform(4, out_bytes=[1.0, 100.0, 1.0, 1.0])
    assert partition(costs, [1, 1]).sizes == [2, 2]
    # At 20 bytes/s the middle cut costs 2 x 100 / 20 = 10 s (activation forward,
    # gradient back); cutting after layer 0 or 2 costs 0.1 s with stages of 1 and
    # 3 s: bottleneck 3 s, and the earliest such cut wins the tie.
    slow = partition(costs, [1, 1], [20.0])
    assert slow.sizes == [1, 3]
    assert slow.cut_s == pytest.approx((0.1,))
    assert slow.bottleneck_s == pytest.approx(3.0)


def test_more_stages_than_layers_is_a_clear_error() -> None:
    with pytest.raises(PlanError, match="5 stages but the model has only 4 layers"):
        partition(uniform(4), power=[1] * 5)
    with pytest.raises(PlanError, match="5 stages but only 4 layers"):
        even_partition(4, 5)


def test_even_partition_gives_the_remainder_to_the_first_stages() -> None:
    assert even_partition(11, 3) == (0, 4, 8, 11)


def test_moved_layers_are_those_whose_owner_changes() -> None:
    # Members 7, 8, 9 held [4, 4, 4]; now 7 and 9 hold [6, 6]: layers 4 and 5
    # move from member 8 to 7, layers 6 and 7 from member 8 to 9.
    assert moved_layers((0, 4, 8, 12), (7, 8, 9), (0, 6, 12), (7, 9)) == [4, 5, 6, 7]


# --- makespan -------------------------------------------------------------------


def test_torch_1f1b_order_per_stage() -> None:
    # 2 stages, 4 micro-batches: stage 0 warms up with min(4, 2 - 0) = 2 forwards.
    assert schedule_order("1f1b", 0, 2, 4) == [
        ("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("F", 3), ("B", 2), ("B", 3)
    ]  # fmt: skip
    assert schedule_order("1f1b", 1, 2, 4)[:3] == [("F", 0), ("B", 0), ("F", 1)]
    assert schedule_order("gpipe", 0, 2, 2) == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_equal_stages_take_m_plus_p_minus_1_slots(schedule: str) -> None:
    # p = 3 stages of f = 1, b = 2, m = 4: (4 + 3 - 1) x 3 = 18 s.
    assert step_s([1, 1, 1], [2, 2, 2], 4, schedule=schedule) == pytest.approx(18.0)
    # p = 2, m = 2: 3 slots of 3 s.
    assert step_s([1, 1], [2, 2], 2, schedule=schedule) == pytest.approx(9.0)


def test_a_slow_stage_paces_the_pipeline() -> None:
    # Stage 1 is 3x slower (f = 3, b = 6). Worked by hand through torch's 1F1B
    # order: stage 0 ends its last backward at 39 s = sum of stage times (3 + 9)
    # plus (m - 1) x the slowest stage (3 x 9).
    assert step_s([1, 3], [2, 6], 4) == pytest.approx(39.0)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_transfers_delay_each_crossing(schedule: str) -> None:
    # p = 2, m = 2, f = 1, b = 2, 0.5 s per crossing. By hand: stage 1 runs F0
    # [1.5, 2.5]; its backward gradients reach stage 0 at 5.0 (or 6.0 for GPipe)
    # and 8.0; stage 0's last backward ends at 10 s in both orders.
    assert step_s([1, 1], [2, 2], 2, [0.5], schedule) == pytest.approx(10.0)


def test_a_segment_adds_setup_optimizer_and_replication() -> None:
    # Steps 20..29 with R = 5 replicate once (after step 25; the end is carried by
    # the reply): 2 + 10 x (9 + 0.5) + 1 x 4 = 101 s.
    cost = segment_cost(
        [1, 1],
        [2, 2],
        2,
        steps=10,
        start_step=20,
        optimizer_s=0.5,
        setup_s=2.0,
        replicate_every=5,
        replication_s=4.0,
    )
    assert cost.replications == 1
    assert cost.total_s == pytest.approx(101.0)
    assert replications(0, 10, 5) == 1  # after step 5 only
    assert replications(0, 11, 5) == 2  # after 5 and 10
    assert replications(0, 10, 0) == 0


def test_replication_lasts_as_long_as_the_slowest_ring_link() -> None:
    assert replicate_s([100, 300, 50], [100, 100, 10]) == pytest.approx(5.0)
    assert replicate_s([100], [1.0]) == 0.0


def test_recovery_costs_detection_setup_moves_and_lost_steps() -> None:
    # 3 s to notice, 5 s to start the new segment, 2 MB at 1 MB/s, 4 steps of 2 s.
    got = recovery_s(
        detect_s=3,
        setup_s=5,
        moved_bytes=2e6,
        move_bandwidth=1e6,
        lost_steps=4,
        step_seconds=2,
    )
    assert got == pytest.approx(18.0)


# --- recovery -------------------------------------------------------------------


def three_members_replicated_at_10() -> Holdings:
    """Members 1, 2, 3 hold layers 0-3, 4-7, 8-11; at step 10 each saved its own
    layers and its ring predecessor's (1 <- 3, 2 <- 1, 3 <- 2); every member
    also saved its own layers at the segment start (step 0 = central copy)."""
    h = Holdings(num_layers=12, central_step=0)
    for member, own, replica in (
        (1, (0, 4), (8, 12)),
        (2, (4, 8), (0, 4)),
        (3, (8, 12), (4, 8)),
    ):
        h.add_report(member, [10, *own, 10, *replica, 0, *own])
    return h


def test_one_loss_restarts_at_the_last_replication_from_the_survivors() -> None:
    h = three_members_replicated_at_10()
    assert restart_step(h, [1, 3], not_after=13) == 10
    # New partition over members 1 and 3: (0, 6, 12).
    sources = layer_sources(h, (0, 6, 12), [1, 3], 10, previous_owner={4: 2, 5: 2})
    kinds = {s.layer: (s.kind, s.rank) for s in sources}
    assert kinds[0] == ("self", -1)
    assert kinds[4] == ("peer", 1)  # member 3's replica of member 2's layers
    assert kinds[5] == ("peer", 1)
    assert kinds[6] == ("self", -1) and kinds[8] == ("self", -1)
    assert {s.step for s in sources} == {10}


def test_two_adjacent_losses_fall_back_to_the_central_copy() -> None:
    h = three_members_replicated_at_10()
    # Members 2 and 3 both held layers 4-7 at step 10: no copy survives there.
    assert restart_step(h, [1], not_after=13) == 0
    sources = layer_sources(h, (0, 12), [1], 0)
    assert [s.kind for s in sources[:4]] == ["self"] * 4
    assert [s.kind for s in sources[4:]] == ["central"] * 8


def test_two_non_adjacent_losses_keep_the_last_replication() -> None:
    h = Holdings(num_layers=8, central_step=0)
    for member in range(4):
        own = (2 * member, 2 * member + 2)
        pred = (2 * ((member - 1) % 4), 2 * ((member - 1) % 4) + 2)
        h.add_report(member, [6, *own, 6, *pred])
    assert restart_step(h, [0, 2], not_after=7) == 6
    assert restart_step(h, [0, 1], not_after=7) == 0  # 2 and 3 adjacent: 4-5 lost


def test_a_malformed_holdings_report_is_refused() -> None:
    with pytest.raises(ValueError, match="triples"):
        Holdings(4).add_report(1, [1, 2])
    with pytest.raises(ValueError, match="outside the model's 4 layers"):
        Holdings(4).add_report(1, [1, 2, 9])


# --- planner decisions ------------------------------------------------------------


def planner(powers: dict[int, float], **changes: object) -> PipelinePlanner:
    """4 layers of 1 s on the reference (1/3 s forward, 2/3 s backward), m = 4."""
    settings: dict = {"link_bandwidth": math.inf, **changes}
    p = PipelinePlanner(
        out_bytes=[1.0] * 4, state_bytes=[1e6] * 4, micro_batches=4, **settings
    )
    p.profiled({m: ([w / 3] * 4, [2 * w / 3] * 4) for m, w in powers.items()})
    return p


def test_a_device_that_would_pace_everyone_down_stays_on_standby() -> None:
    # A alone: one stage of 4 s, 4 micro-batches: 16 s. With B (100x slower)
    # B's single layer (100 s) paces the pipeline: far worse, so B waits.
    p = planner({1: 1.0, 2: 100.0})
    decision = p.decide(None, [1, 2], steps_left=10)
    assert decision.layout.members == (1,)
    assert decision.step_s == pytest.approx(16.0)
    assert "standby [2]" in decision.reason
    # B only 2x slower: [3, 1] gives stages of 1 + 2 s and 2/3 + 4/3 s; worked
    # through torch's 1F1B order, stage 0's last backward ends at 13 s < 16 s,
    # so both train.
    both = planner({1: 1.0, 2: 2.0}).decide(None, [1, 2], steps_left=10)
    assert both.layout == Layout((1, 2), (0, 3, 4))
    assert both.step_s == pytest.approx(13.0)


def test_a_lost_member_forces_a_replan_and_says_so() -> None:
    p = planner({1: 1.0, 2: 1.0, 3: 1.0})
    current = Layout((1, 2, 3), (0, 1, 3, 4))
    decision = p.decide(current, [1, 3], steps_left=10)
    assert decision.kind == "re-plan"
    assert decision.layout.members == (1, 3)
    assert "members [1, 2, 3] -> [1, 3]" in decision.reason


def test_a_slowed_member_moves_layers_only_when_the_gain_pays() -> None:
    p = planner({1: 1.0, 2: 1.0})
    current = Layout((1, 2), (0, 2, 4))
    assert p.decide(current, [1, 2], steps_left=10).kind == "keep"
    # Member 2 measured 3x slower on its 2 layers: stages 2 s and 6 s,
    # 2 + 6 + 3 x 6 = 26 s/step. [3, 1]: 3 s and 3 s, (4 + 1) x 3 = 15 s/step.
    p.measured(current, {2: 6.0}, {})
    assert p.power[2] == pytest.approx(3.0)
    go = p.decide(current, [1, 2], steps_left=10)
    assert go.kind == "re-partition"
    assert go.layout.bounds == (0, 3, 4)
    assert "26.000 s/step" in go.reason and "15.000 s/step" in go.reason
    # Moving one layer of 1 MB over a 1 kB/s link costs 1000 s: more than the
    # 11 s/step gain over 10 steps (110 s): keep.
    slow_link = planner({1: 1.0, 2: 1.0}, link_bandwidth=1e3)
    slow_link.measured(current, {2: 6.0}, {})
    assert slow_link.decide(current, [1, 2], steps_left=10).kind == "keep"


def test_a_stage_with_little_compute_does_not_rewrite_its_power() -> None:
    # Member 2 holds 1 layer of 20 (5% < 10% of the compute): its measured time
    # is mostly per-call overhead, so its profiled power stays.
    p = PipelinePlanner(out_bytes=[1.0] * 20, state_bytes=[1.0] * 20, micro_batches=4)
    p.profiled({1: ([1 / 3] * 20, [2 / 3] * 20), 2: ([10 / 3] * 20, [20 / 3] * 20)})
    p.measured(Layout((1, 2), (0, 19, 20)), {1: 38.0, 2: 1.0}, {})
    assert p.power[2] == pytest.approx(10.0)
    assert p.power[1] == pytest.approx(2.0)  # 38 s over 19 reference seconds
