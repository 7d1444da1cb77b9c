"""FedBuff: staleness arithmetic, ordering, concurrency and evaluation cadence.

Fleet: node 1 answers after 1 s, node 2 after 2.5 s; a node's answer is the model
it received plus its shift (node 1: +1, node 2: +4), so its update is the shift.
"""

from __future__ import annotations

import math

import pytest
from flowerbed.strategies import FedBuff
from flowerbed.strategies.options import Buffering
from flowerbed.strategies.round_metrics import (
    ROUND_CLOCK_S,
    ROUND_PARTICIPANTS,
    ROUND_STALENESS,
)
from flowerbed.strategies.staleness import hinge_staleness, polynomial_staleness
from flwr.app import ArrayRecord, MetricRecord
from test_strategies_fakes import FakeGrid, node, silent, weights


def fleet() -> FakeGrid:
    return FakeGrid({1: node(1.0, seconds=1.0), 2: node(4.0, seconds=2.5)})


def fedbuff(**kwargs) -> FedBuff:  # type: ignore[no-untyped-def]
    kwargs.setdefault("fraction_evaluate", 0.0)
    kwargs.setdefault("buffer_size", 1)
    return FedBuff(**kwargs)


def test_default_staleness_weight_is_one_over_sqrt_one_plus_s() -> None:
    assert [polynomial_staleness(s) for s in (0, 1, 3)] == pytest.approx(
        [1.0, 1 / math.sqrt(2), 0.5]
    )
    assert [hinge_staleness(s, a=10, b=4) for s in (4, 5)] == pytest.approx(
        [1.0, 1 / 11]
    )


def test_stale_updates_are_applied_in_arrival_order_with_staleness_scaling() -> None:
    # Plain FedBuff (no server momentum), K = 1, both nodes busy from t=0 on v0:
    # t=1   node 1 (from v0, staleness 0): v1 = 0 + 1
    # t=2   node 1 (from v1, staleness 0): v2 = 1 + 1 = 2
    # t=2.5 node 2 (from v0, staleness 2): v3 = 2 + 4/sqrt(3)
    # t=3   node 1 (from v2, staleness 1): v4 = v3 + 1/sqrt(2)
    grid = fleet()
    result = fedbuff(server_momentum=0.0).start(grid, weights(), num_rounds=4)
    expected = 2 + 4 / math.sqrt(3) + 1 / math.sqrt(2)
    assert float(result.arrays["w"].numpy()[0]) == pytest.approx(expected, rel=1e-6)
    train = result.train_metrics_clientapp
    assert [train[v][ROUND_STALENESS] for v in (1, 2, 3, 4)] == [0, 0, 2, 1]
    assert [train[v][ROUND_CLOCK_S] for v in (1, 2, 3, 4)] == [1.0, 2.0, 2.5, 3.0]


def test_new_work_is_dispatched_on_the_newest_version_as_replies_arrive() -> None:
    grid = fleet()
    fedbuff().start(grid, weights(), num_rounds=4)
    pushes = {
        n: [
            (t, m.metadata.group_id)
            for t, m in grid.pushed
            if m.metadata.dst_node_id == n
        ]
        for n in (1, 2)
    }
    # group_id is the version the work counts towards: the newest one plus 1.
    assert pushes[1] == [(0.0, "1"), (1.0, "2"), (2.0, "3")]
    assert pushes[2] == [(0.0, "1"), (2.5, "4")]


def test_updates_older_than_max_staleness_are_dropped() -> None:
    # Node 2's update is 2 versions old at t=2.5 and is dropped; node 1's next
    # reply (t=3, from v2, staleness 0) makes v3 = 3.
    result = fedbuff(max_staleness=1, server_momentum=0.0).start(
        fleet(), weights(), num_rounds=3
    )
    assert float(result.arrays["w"].numpy()[0]) == pytest.approx(3.0)


def test_buffer_averages_k_updates_with_server_learning_rate() -> None:
    # K = 2: node 1's replies at t=1 (from v0) and t=2 (from v0, still newest)
    # fill the buffer: v1 = 0 + 0.5 * (1 + 1) / 2 = 0.5.
    result = fedbuff(buffer_size=2, server_learning_rate=0.5).start(
        fleet(), weights(), num_rounds=1
    )
    assert float(result.arrays["w"].numpy()[0]) == pytest.approx(0.5)


def test_concurrency_limits_the_nodes_at_work() -> None:
    grid = FakeGrid({n: node(1.0, seconds=1.0) for n in (1, 2, 3, 4)})
    fedbuff(concurrency=2).start(grid, weights(), num_rounds=4)
    starts = [t for t, _ in grid.pushed]
    assert starts.count(0.0) == 2
    busy_at = {t: sum(1 for s in starts if s <= t < s + 1.0) for t in starts}
    assert max(busy_at.values()) == 2


def test_evaluation_runs_every_n_versions_and_after_the_last() -> None:
    seen: list[int] = []

    def central(version: int, arrays: ArrayRecord) -> MetricRecord:
        seen.append(version)
        return MetricRecord({"accuracy": 0.5})

    result = fedbuff(evaluate_every=2, fraction_evaluate=1.0).start(
        fleet(), weights(), num_rounds=5, evaluate_fn=central
    )
    assert seen == [0, 2, 4, 5]
    assert sorted(result.evaluate_metrics_clientapp) == [2, 4, 5]


def test_a_fleet_that_never_answers_ends_the_run_with_the_initial_model() -> None:
    grid = FakeGrid({1: silent, 2: silent})
    result = fedbuff(quarantine_after=2).start(
        grid, weights(3.0), num_rounds=2, timeout=10.0
    )
    assert float(result.arrays["w"].numpy()[0]) == 3.0
    assert result.train_metrics_clientapp == {}


def test_server_momentum_and_learning_rate_follow_the_written_out_case() -> None:
    # K = 1, eta_g = 0.5, beta = 0.5; arrivals as in the plain case above:
    # u_v = eta_g s(tau) delta, m_v = beta m_(v-1) + u_v, x_v = x_(v-1) + m_v.
    # t=1   node 1, tau 0: u = 0.5          m1 = 0.5          x1 = 0.5
    # t=2   node 1, tau 0: u = 0.5          m2 = 0.25 + 0.5   x2 = 1.25
    # t=2.5 node 2, tau 2: u = 0.5*4/sqrt3  m3 = 0.375 + u    x3 = 1.25 + m3
    # t=3   node 1, tau 1: u = 0.5/sqrt2    m4 = m3/2 + u     x4 = x3 + m4
    result = fedbuff(server_learning_rate=0.5, server_momentum=0.5).start(
        fleet(), weights(), num_rounds=4
    )
    m3 = 0.375 + 2 / math.sqrt(3)
    m4 = m3 / 2 + 0.5 / math.sqrt(2)
    expected = 1.25 + m3 + m4
    assert float(result.arrays["w"].numpy()[0]) == pytest.approx(expected, rel=1e-6)


def test_the_default_server_step_is_fedbuffs_own_without_momentum() -> None:
    # K = 1, eta_g = 1, beta = 0: node 1's first two replies, x2 = 1 + 1 = 2
    assert Buffering().server_momentum == 0.0
    result = fedbuff().start(fleet(), weights(), num_rounds=2)
    assert float(result.arrays["w"].numpy()[0]) == pytest.approx(2.0)


@pytest.mark.parametrize("beta", [-0.1, 1.0, math.nan])
def test_server_momentum_outside_zero_to_one_is_refused(beta: float) -> None:
    with pytest.raises(ValueError, match=r"server_momentum must be in \[0, 1\)"):
        Buffering(server_momentum=beta)


def test_top_ups_within_a_version_draw_their_nodes_afresh() -> None:
    # One node at work, K = 10: version 1 is ten top-ups of one node each, all
    # 20 nodes idle at each. Drawing with the same seed each time would pick the
    # same node ten times.
    grid = FakeGrid({n: node(1.0, seconds=1.0) for n in range(1, 21)})
    fedbuff(concurrency=1, buffer_size=10).start(grid, weights(), num_rounds=1)
    first_version = [m.metadata.dst_node_id for _, m in grid.pushed][:10]
    assert len(set(first_version)) > 1


def test_default_concurrency_is_twice_the_sample_and_k_a_quarter_of_it() -> None:
    # fraction_train 0.5 of 8 nodes: FedAvg would sample 4; FedBuff keeps 8 at
    # work and makes a version from every 8 // 4 = 2 replies.
    grid = FakeGrid({n: node(1.0, seconds=float(n)) for n in range(1, 9)})
    result = FedBuff(fraction_train=0.5, fraction_evaluate=0.0).start(
        grid, weights(), num_rounds=2
    )
    assert [t for t, _ in grid.pushed].count(0.0) == 8
    train = result.train_metrics_clientapp
    assert [train[v][ROUND_PARTICIPANTS] for v in (1, 2)] == [2, 2]


def test_a_task_outstanding_past_twice_the_slowest_round_trip_is_given_up() -> None:
    # Nodes 1 and 2 answer after 1 s and 1.5 s; node 3 vanished and never
    # answers. With all three in flight, node 3's slot is dead until its
    # message expires. Once 10 round trips are known (the slowest 1.5 s), a
    # task out for over 2 x 1.5 = 3 s is given up and node 3, idle again, gets
    # new work: first at the dispatch after t = 3 s, then every 3 s or so.
    def grid() -> FakeGrid:
        return FakeGrid(
            {1: node(1.0, seconds=1.0), 2: node(4.0, seconds=1.5), 3: silent}
        )

    g = grid()
    strategy = fedbuff(concurrency=3)
    strategy.start(g, weights(), num_rounds=20)
    assert strategy.abandoned >= 2
    assert len(g.pushed_to(3)) == strategy.abandoned + 1
    assert max(strategy.round_trips) == pytest.approx(1.5)
    # Never giving up: node 3 keeps its one task for the whole run.
    g = grid()
    patient = fedbuff(concurrency=3, abandon_after=None)
    patient.start(g, weights(), num_rounds=20)
    assert patient.abandoned == 0 and len(g.pushed_to(3)) == 1


def test_abandon_after_must_exceed_one() -> None:
    with pytest.raises(ValueError, match="abandon_after must be > 1"):
        Buffering(abandon_after=1.0)
