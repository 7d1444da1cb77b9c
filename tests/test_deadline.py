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
from flowerbed.strategies.deadline import (
    Observation,
    censored_percentile,
    full_work_seconds,
)
from flowerbed.strategies.inflight import Ticket
from flowerbed.strategies.round_metrics import (
    ROUND_DEADLINE_S,
    ROUND_LATE_UPDATES,
    ROUND_PARTICIPANTS,
    ROUND_STRAGGLERS,
)
from flwr.app import MessageType, MetricRecord
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
    # (Norm clipping off: node 3's +10 is over 3x the fleet's median update.)
    grid = fleet(slow_s=11.0)
    result = strategy(deadline_s=8.0, max_staleness=2, clip_factor=None).start(
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


def test_first_round_work_sent_without_a_deadline_is_not_folded_late(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Adaptive deadline at p20 with partial work: round 1 (no durations, no
    # deadline-s) closes at node 1's reply, t=1. Nodes 2 and 3 trained their
    # whole round-1 work and reply at t=2 and t=6, in later rounds: dropped,
    # not folded. Node 2's round-2 task carried a deadline-s; the fake node
    # ignores it and replies 2 s later, in round 4: that late update folds.
    grid = fleet(slow_s=6.0)
    run = strategy(
        adaptive_deadline=True,
        partial_work=True,
        deadline_percentile=20.0,
        pacer_step=0.0,
        max_staleness=3,
        clip_factor=None,
    )
    with caplog.at_level(logging.INFO, logger="flwr"):
        result = run.start(grid, weights(), num_rounds=6)
    late = {r: m[ROUND_LATE_UPDATES] for r, m in result.train_metrics_clientapp.items()}
    assert late[2] == late[3] == 0
    assert late[4] == 1
    assert "sent before any deadline was known" in caplog.text
    assert not run.folds_late(grid_ticket(deadline_s=None), 1)
    assert run.folds_late(grid_ticket(deadline_s=0.8), 1)
    assert not run.folds_late(grid_ticket(deadline_s=0.8), 4)  # > max_staleness


def test_the_first_round_closes_at_its_share_of_usable_replies() -> None:
    # p50 of 4 sampled: round 1 closes at floor(0.5 * 4) = 2 usable replies.
    # Node 4 answers an error at t=0.5: it does not count, so the round waits
    # for node 2 (t=2) instead of closing at node 1's reply (t=1).
    from flwr.app import Error, Message

    def failing(message: Message) -> tuple[Message | None, float]:
        return Message(Error(code=1, reason="dropped out"), reply_to=message), 0.5

    grid = FakeGrid(
        {1: node(1.0, seconds=1.0), 2: node(3.0, seconds=2.0), 3: silent, 4: failing}
    )
    run = strategy(adaptive_deadline=True, deadline_percentile=50.0, pacer_step=0.0)
    result = run.start(grid, weights(), num_rounds=1)
    assert result.train_metrics_clientapp[1][ROUND_PARTICIPANTS] == 2
    assert grid.clock.now() == pytest.approx(2.0)


def grid_ticket(deadline_s: float | None) -> Ticket:
    return Ticket(
        2, 1, 0.0, MessageType.TRAIN, assigned_steps=10, deadline_s=deadline_s
    )


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
    # (t=2). Durations: 1 and 2 s; nodes 3 and 4 had not finished after 2 s.
    # Nearest-rank median of [1, 2, >2, >2] (rank ceil(0.5 * 4) = 2) is 2 s.
    # Round 2 samples nodes 1 and 2 (3 and 4 are still busy), both in time: t=4.
    grid = fleet()
    result = strategy(
        adaptive_deadline=True, deadline_percentile=50.0, min_completion=1
    ).start(grid, weights(), num_rounds=2)
    assert result.train_metrics_clientapp[1][ROUND_DEADLINE_S] == -1.0
    assert result.train_metrics_clientapp[2][ROUND_DEADLINE_S] == pytest.approx(2.0)
    assert grid.clock.now() == pytest.approx(4.0)


def test_adaptive_deadline_grows_when_too_few_nodes_finish_in_time() -> None:
    # Round 1 (deadline 5 s): finished 1 s, 2 s; nodes 3 (20 s) and 4 (silent)
    # did not. p80 is rank ceil(0.8 * 4) = 4, an unfinished node given 5 s, so
    # round 2's deadline grows by deadline_growth: 1.5 * 5 = 7.5 s.
    grid = fleet()
    result = strategy(adaptive_deadline=True, deadline_s=5.0, min_completion=1).start(
        grid, weights(), num_rounds=2
    )
    assert result.train_metrics_clientapp[2][ROUND_DEADLINE_S] == pytest.approx(7.5)


def test_partial_work_does_not_shrink_the_adaptive_deadline() -> None:
    # Both nodes do 1 step/s and are assigned 10 steps. With deadline D they
    # train 0.8 D and reply then; their full work is 10 s, not 0.8 D. So the
    # deadline goes 5 s (given) -> 10 s and stays there, instead of shrinking
    # by 0.8 every round (10 s / 0.98: the margin a node is given comes on top
    # of the percentile's full task).
    def partial(message):  # type: ignore[no-untyped-def]
        budget = config_of(message)[keys.DEADLINE_S]
        done = min(10, int(budget))
        return node(0.1 * done, seconds=float(done), steps=done)(message)

    grid = FakeGrid({1: partial, 2: partial})
    result = strategy(
        adaptive_deadline=True,
        deadline_s=5.0,
        partial_work=True,
        local_steps=10,
        pacer_step=0.0,
    ).start(grid, weights(), num_rounds=4)
    deadlines = [
        result.train_metrics_clientapp[r][ROUND_DEADLINE_S] for r in (1, 2, 3, 4)
    ]
    assert deadlines == pytest.approx([5.0, *[10.0 / 0.98] * 3])


def test_a_node_that_cannot_do_one_step_lengthens_the_deadline_and_is_not_benched() -> (
    None
):
    # Node 2 needs 3 s for its first step; with 0.8 * 2 s it answers at once with
    # num-steps 0. That is no fault: it stays in the sample, and as the p100
    # node it had not finished, the deadline grows 2 -> 3 -> 4.5 s, after which
    # it fits a step. (A fixed 0.8 share: the deadline as measured, without
    # the learnt margin's 2% on top.)
    def slow(message):  # type: ignore[no-untyped-def]
        budget = config_of(message)[keys.DEADLINE_S]
        done = int(budget // 3.0)
        return node(1.0, seconds=3.0 * done, steps=done, examples=10 * done)(message)

    grid = FakeGrid({1: node(1.0, seconds=1.0, steps=1), 2: slow})
    result = strategy(
        adaptive_deadline=True,
        deadline_s=2.0,
        deadline_percentile=100.0,
        partial_work=True,
        local_steps=1,
        pacer_step=0.0,
        quarantine_after=1,
        min_completion=1,
        learn_margin=False,
    ).start(grid, weights(), num_rounds=4)
    deadlines = [
        result.train_metrics_clientapp[r][ROUND_DEADLINE_S] for r in (1, 2, 3, 4)
    ]
    assert deadlines == pytest.approx([2.0, 3.0, 4.5, 4.5])
    assert len(grid.pushed_to(2)) == 4
    assert result.train_metrics_clientapp[4][ROUND_PARTICIPANTS] == 2


def test_full_work_seconds_scales_the_compute_to_the_assigned_steps() -> None:
    # 4 of 10 steps: 2 s of transfers + 4 s of compute -> 2 + 4 * 10 / 4 = 12 s.
    assert full_work_seconds(6.0, 4.0, 4, 10) == pytest.approx(12.0)
    assert full_work_seconds(6.0, None, 4, 10) == pytest.approx(15.0)
    assert full_work_seconds(6.0, 4.0, 10, 10) == 6.0
    assert full_work_seconds(6.0, 4.0, None, 10) == 6.0
    assert full_work_seconds(6.0, 0.0, 0, 10) is None


def test_censored_percentile_is_nearest_rank_with_unfinished_nodes_last() -> None:
    obs = [
        Observation(1, 3.0),
        Observation(1, 1.0),
        Observation(1, 2.0, censored=True),
        Observation(1, 9.0),
    ]
    # sorted: 1, 3, 9, (>2); ranks ceil(p/100 * 4)
    assert censored_percentile(obs, 50.0) == (3.0, False)
    assert censored_percentile(obs, 75.0) == (9.0, False)
    assert censored_percentile(obs, 80.0) == (2.0, True)
    assert censored_percentile([], 80.0) is None


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


def test_an_expired_message_is_not_a_fault() -> None:
    # Node 4 never answers: each round its message expires (TTL 2 x 5 s), yet with
    # quarantine after a single fault it keeps being sampled: slow or gone is not
    # broken.
    grid = fleet()
    s = strategy(deadline_s=5.0, late_updates=False, quarantine_after=1)
    s.start(grid, weights(), num_rounds=4)
    assert len(grid.pushed_to(4)) == 4
    assert s.quarantine.until == {}


def test_evaluation_waits_a_quarter_of_the_deadline_by_default() -> None:
    # Training closes at the 4 s deadline; node 4 never answers its evaluation
    # either, which then closes after 4 / 4 = 1 s: the round lasts 5 s.
    grid = fleet()
    strategy(deadline_s=4.0, late_updates=False, fraction_evaluate=1.0).start(
        grid, weights(), num_rounds=1
    )
    assert grid.clock.now() == pytest.approx(5.0)
    grid = fleet()
    strategy(
        deadline_s=4.0,
        late_updates=False,
        fraction_evaluate=1.0,
        evaluate_timeout_s=0.5,
    ).start(grid, weights(), num_rounds=1)
    assert grid.clock.now() == pytest.approx(4.5)


def test_a_run_that_never_updates_says_why_and_what_to_change(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Every node needs >= 1 s, the fixed deadline is 0.5 s: nothing is ever applied.
    caplog.set_level(logging.WARNING, logger="flwr")
    grid = fleet()
    result = strategy(deadline_s=0.5, late_updates=False).start(
        grid, weights(3.0), num_rounds=6
    )
    assert w(result) == 3.0
    stalled = [
        r.getMessage() for r in caplog.records if "NO PROGRESS" in r.getMessage()
    ]
    assert len(stalled) == 2  # after rounds 3 and 6
    assert "missed the 0.5 s deadline" in stalled[0]
    assert "raise deadline_s (now 0.5) or set adaptive_deadline=True" in stalled[0]
    final = [r for r in caplog.records if "NO TRAINING" in r.getMessage()]
    assert len(final) == 1 and final[0].levelno == logging.ERROR


def test_message_ttl_never_falls_below_one_second() -> None:
    grid = fleet()
    strategy(deadline_s=0.01, late_updates=False).start(grid, weights(), num_rounds=1)
    assert {m.metadata.ttl for _, m in grid.pushed} == {1.0}


def test_the_benchmark_and_the_run_config_mean_the_same_deadline_strategy() -> None:
    # One configuration under one name: `flowerbed bench`'s "deadline" is
    # `strategy = "deadline"` of the run config.
    from flowerbed.bench.suite import CONFIGS
    from flowerbed.sims.config import Scenario
    from flowerbed.sims.scenario import STRATEGIES

    scenario = Scenario.from_run_config({"strategy": "deadline"})
    bench, run = CONFIGS["deadline"].build(scenario), STRATEGIES["deadline"](scenario)
    assert type(bench) is type(run) is DeadlineFedAvg
    settings = ("adaptive_deadline", "deadline_percentile", "partial_work")
    assert {k: vars(bench)[k] for k in settings} == {k: vars(run)[k] for k in settings}
    assert run.adaptive_deadline and run.partial_work and run.late_updates


def test_the_run_configs_deadline_is_the_recommended_one_users_are_told_of() -> None:
    # README's drop-in `DeadlineFedAvg.recommended(...)` and `strategy =
    # "deadline"` are one configuration: RECOMMENDED_DEADLINES.
    from flowerbed.sims.config import Scenario
    from flowerbed.sims.scenario import STRATEGIES
    from flowerbed.strategies.options import RECOMMENDED_DEADLINES

    run = STRATEGIES["deadline"](Scenario.from_run_config({"strategy": "deadline"}))
    mine = DeadlineFedAvg.recommended(fraction_train=0.5)
    assert mine.deadlines == RECOMMENDED_DEADLINES
    assert mine.fraction_train == 0.5
    fields = [f for f in vars(RECOMMENDED_DEADLINES) if f != "deadline_s"]
    assert {f: getattr(run, f) for f in fields} == {f: getattr(mine, f) for f in fields}
    assert mine.deadline_percentile == 20.0 and mine.pacer_step == 0.0
    assert mine.learn_margin and mine.partial_work and mine.adaptive_deadline
    with pytest.raises(TypeError, match="sets deadlines itself"):
        DeadlineFedAvg.recommended(deadlines=RECOMMENDED_DEADLINES)
