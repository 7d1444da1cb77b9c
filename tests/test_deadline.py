"""DeadlineFedAvg mechanisms on a scripted grid with hand-computed expectations.

Default fleet: node 1 answers x+1 after 1 s, node 2 x+3 after 2 s, node 3 (ten
times slower than node 2) x+10 after 20 s, node 4 never answers. All report 10
examples and weighting is "examples", so fresh replies average plainly.
"""

from __future__ import annotations

import logging
import math

import pytest
from flowerbed import keys
from flowerbed.strategies import DeadlineFedAvg
from flowerbed.strategies.utils import (
    ROUND_DEADLINE_S,
    ROUND_LATE_UPDATES,
    ROUND_PARTICIPANTS,
    ROUND_STRAGGLERS,
)
from flwr.app import MetricRecord
from flwr.serverapp.strategy import Result
from test_strategies_fakes import FakeGrid, config_of, node, silent, weights


def fleet(slow_s: float = 20.0) -> FakeGrid:
    return FakeGrid(
        {
            1: node(1.0, seconds=1.0),
            2: node(3.0, seconds=2.0),
            3: node(10.0, seconds=slow_s),
            4: silent,
        }
    )


def strategy(**kwargs) -> DeadlineFedAvg:  # type: ignore[no-untyped-def]
    kwargs.setdefault("weighting", "examples")
    kwargs.setdefault("fraction_evaluate", 0.0)
    return DeadlineFedAvg(**kwargs)


def w(result: Result) -> float:
    return float(result.arrays["w"].numpy()[0])


def test_fixed_deadline_closes_the_round_and_drops_stragglers() -> None:
    grid = fleet()
    result = strategy(deadline_s=5.0, late_updates=False).start(
        grid, weights(), num_rounds=1
    )
    assert grid.clock.now() == 5.0
    assert w(result) == pytest.approx(2.0)  # (1 + 3) / 2
    metrics = result.train_metrics_clientapp[1]
    assert metrics[ROUND_PARTICIPANTS] == 2
    assert metrics[ROUND_STRAGGLERS] == 2
    assert metrics[ROUND_DEADLINE_S] == 5.0


def test_late_update_is_folded_into_a_later_round_with_staleness_discount() -> None:
    # Deadline 8 s, node 3 takes 11 s. Round 1 spans [0, 8] (nodes 3 and 4 miss
    # it); rounds 2 and 3 sample only the idle nodes 1 and 2 and end when both
    # replied: [8, 10], [10, 12]. Node 3's round-1 reply lands at t=11, in round 3,
    # two rounds late: its update (+10 on the round-1 model) joins the fresh +1
    # and +3 (weights 10) with weight 10/sqrt(1+2).
    grid = fleet(slow_s=11.0)
    result = strategy(deadline_s=8.0, max_staleness=2).start(
        grid, weights(), num_rounds=3
    )
    x2 = 4.0  # two rounds of (1 + 3) / 2
    late_w = 10 / math.sqrt(3)
    expected = x2 + (10 * 1 + 10 * 3 + late_w * 10) / (20 + late_w)
    assert w(result) == pytest.approx(expected, rel=1e-6)
    assert result.train_metrics_clientapp[3][ROUND_LATE_UPDATES] == 1
    assert result.train_metrics_clientapp[3][ROUND_PARTICIPANTS] == 2
    # Busy with its round-1 work, node 3 was not sampled again meanwhile.
    assert len(grid.pushed_to(3)) == 1


def test_updates_older_than_max_staleness_are_dropped() -> None:
    grid = fleet(slow_s=11.0)
    result = strategy(deadline_s=8.0, max_staleness=1).start(
        grid, weights(), num_rounds=3
    )
    assert w(result) == pytest.approx(6.0)  # three rounds of +2, node 3 ignored
    assert result.train_metrics_clientapp[3][ROUND_LATE_UPDATES] == 0


def test_over_selection_keeps_the_first_k_replies() -> None:
    # K = 2 (min_train_nodes), 1.5x over-selection samples all three nodes; the
    # round closes when the second reply lands at t=2 instead of waiting 20 s.
    grid = FakeGrid(
        {
            1: node(1.0, seconds=1.0),
            2: node(3.0, seconds=2.0),
            3: node(10.0, seconds=20.0),
        }
    )
    result = strategy(fraction_train=0.5, over_selection=1.5, late_updates=False).start(
        grid, weights(), num_rounds=1
    )
    assert len(grid.pushed) == 3
    assert grid.clock.now() == 2.0
    assert w(result) == pytest.approx(2.0)


def test_adaptive_deadline_starts_at_the_percentile_then_follows_durations() -> None:
    # Round 1 has no history: it closes once 50% of the 4 sampled nodes replied
    # (t=2). Round 2's deadline is the median of the durations seen, [1, 2] -> 1.5.
    grid = fleet()
    result = strategy(
        adaptive_deadline=True, deadline_percentile=50.0, min_completion=1
    ).start(grid, weights(), num_rounds=2)
    assert result.train_metrics_clientapp[1][ROUND_DEADLINE_S] == -1.0
    assert result.train_metrics_clientapp[2][ROUND_DEADLINE_S] == pytest.approx(1.5)
    assert grid.clock.now() == pytest.approx(2.0 + 1.5)


def test_pacer_relaxes_when_progress_slows_and_tightens_when_it_holds() -> None:
    s = strategy(adaptive_deadline=True, pacer_window=1, pacer_step=0.1)
    result = Result()
    factors = []
    for r, acc in enumerate([0.1, 0.3, 0.5, 0.55], start=1):
        result.evaluate_metrics_serverapp[r] = MetricRecord({"accuracy": acc})
        s._after_round(r, result)
        factors.append(s.pacing)
    # rounds 1-2: not enough history; round 3: +0.2 after +0.2 -> x0.9;
    # round 4: +0.05 after +0.2 -> x1.1
    assert factors == pytest.approx([1.0, 1.0, 0.9, 0.99])


def test_partial_work_sends_the_training_budget() -> None:
    grid = fleet()
    strategy(deadline_s=10.0, partial_work=True, work_fraction=0.8).start(
        grid, weights(), num_rounds=1
    )
    assert {config_of(m)[keys.DEADLINE_S] for _, m in grid.pushed} == {8.0}


def test_partial_work_updates_are_normalised_by_fednova() -> None:
    # Node 1 manages 8 of 20 assigned steps before its 8 s budget (1 step/s) and
    # moves x by 0.1 per step; node 2 finishes 4 steps. FedNova: p = 1/2 each,
    # d/tau = 0.1 for both, tau_eff = (8 + 4)/2 = 6 -> x = 0.6.
    def partial(speed: float, steps: int):  # type: ignore[no-untyped-def]
        def run(message):  # type: ignore[no-untyped-def]
            budget = config_of(message)[keys.DEADLINE_S]
            done = min(steps, int(budget * speed))
            return node(0.1 * done, seconds=done / speed, steps=done)(message)

        return run

    grid = FakeGrid({1: partial(1.0, 20), 2: partial(1.0, 4)})
    result = strategy(
        deadline_s=10.0, partial_work=True, weighting="fednova", local_steps=20
    ).start(grid, weights(), num_rounds=1)
    assert w(result) == pytest.approx(0.6, rel=1e-6)


def test_too_few_replies_keep_the_previous_model(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="flwr")
    grid = fleet()
    result = strategy(deadline_s=1.5, min_completion=2, late_updates=False).start(
        grid, weights(7.0), num_rounds=1
    )
    assert w(result) == 7.0
    assert any("min_completion" in r.getMessage() for r in caplog.records)


def test_message_ttl_covers_the_staleness_window() -> None:
    grid = fleet()
    strategy(deadline_s=8.0, max_staleness=2).start(grid, weights(), num_rounds=1)
    assert {m.metadata.ttl for _, m in grid.pushed} == {32.0}  # 8 s x (2 + 2)
    grid = fleet()
    strategy(deadline_s=8.0, late_updates=False).start(grid, weights(), num_rounds=1)
    assert {m.metadata.ttl for _, m in grid.pushed} == {16.0}  # 8 s x 2


def test_invalid_settings_are_refused_with_the_valid_range() -> None:
    with pytest.raises(ValueError, match="over_selection must be >= 1"):
        DeadlineFedAvg(over_selection=0.5)
    with pytest.raises(ValueError, match=r"deadline_percentile must be in \(0, 100\]"):
        DeadlineFedAvg(deadline_percentile=0)
