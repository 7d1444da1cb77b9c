"""DeadlineFedAvg's default with partial work: two deadline speeds, chosen by cost.

Each round the deadline is the 80th percentile of recent full-work durations
while that is at most ``wait_ratio`` (5) times the 30th, else the 30th
(:func:`flowerbed.strategies.deadline.two_speed_percentile`).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from flowerbed import keys
from flowerbed.strategies import DeadlineFedAvg
from flowerbed.strategies.deadline import Observation, two_speed_percentile
from flowerbed.strategies.round_metrics import (
    ROUND_DEADLINE_PERCENTILE,
    ROUND_DEADLINE_S,
)
from flwr.app import Message
from test_strategies_fakes import FakeGrid, config_of, node, weights

STEPS = 10


def durations(*seconds: float, censored: tuple[float, ...] = ()) -> list[Observation]:
    return [Observation(1, s) for s in seconds] + [
        Observation(1, s, True) for s in censored
    ]


def test_no_history_waits_for_the_patient_percentile() -> None:
    assert two_speed_percentile([]) == 80.0


def test_cheap_waiting_keeps_the_patient_percentile() -> None:
    # Ten nodes: p30 is rank 3 (1 s), p80 rank 8 (3 s); 3 <= 5 x 1.
    assert two_speed_percentile(durations(1, 1, 1, 2, 2, 2, 2, 3, 3, 4)) == 80.0


def test_expensive_waiting_takes_the_fast_percentile() -> None:
    # p80 is rank 8 (9 s): 9 > 5 x 1.
    assert two_speed_percentile(durations(1, 1, 1, 2, 2, 2, 2, 9, 9, 9)) == 30.0


def test_the_ratio_is_inclusive_and_follows_wait_ratio() -> None:
    obs = durations(1, 1, 1, 2, 2, 2, 2, 5, 5, 5)  # p80 / p30 = 5 exactly
    assert two_speed_percentile(obs) == 80.0
    assert two_speed_percentile(obs, wait_ratio=4.9) == 30.0


def test_an_unfinished_patient_percentile_counts_grown() -> None:
    # Seven finished in 1-2 s, three unfinished after 3 s: p80 (rank 8) is one
    # of them, a deadline of 3 x 1.5 = 4.5 s (<= 5 x 1); after 4 s it is 6 s.
    finished = (1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 2.0)
    assert two_speed_percentile(durations(*finished, censored=(3, 3, 3))) == 80.0
    assert two_speed_percentile(durations(*finished, censored=(4, 4, 4))) == 30.0


def test_the_fast_percentile_is_configurable() -> None:
    # p10 is rank 1 (0.5 s): p80 / p10 = 3 / 0.5 = 6 > 5.
    obs = durations(0.5, 1, 1, 2, 2, 2, 2, 3, 3, 4)
    assert two_speed_percentile(obs) == 80.0
    assert two_speed_percentile(obs, fast=10.0) == 10.0


def partial(step_s: float) -> Callable[[Message], tuple[Message | None, float]]:
    """A node doing STEPS steps of ``step_s`` s, or as many as its deadline fits."""

    def run(message: Message) -> tuple[Message | None, float]:
        budget = config_of(message).get(keys.DEADLINE_S)
        done = STEPS if budget is None else min(STEPS, int(budget / step_s + 1e-9))
        return node(1.0, seconds=step_s * done, steps=done)(message)

    return run


def percentiles_and_deadlines(slow_step_s: float) -> list[tuple[float, float]]:
    """Rounds 2-4 of seven nodes with 4 s of work and three slower ones; round 1
    has a 20 s deadline (0.8 x 20 = 16 s of training), which all of them use."""
    grid = FakeGrid(
        {n: partial(0.4) for n in range(1, 8)}
        | {n: partial(slow_step_s) for n in range(8, 11)}
    )
    result = DeadlineFedAvg(
        fraction_evaluate=0.0,
        weighting="examples",
        adaptive_deadline=True,
        deadline_s=20.0,
        partial_work=True,
        local_steps=STEPS,
        pacer_step=0.0,
        learn_margin=False,  # the fixed 0.8 share these rounds are worked out with
    ).start(grid, weights(), num_rounds=4)
    metrics = result.train_metrics_clientapp
    return [
        (metrics[r][ROUND_DEADLINE_PERCENTILE], metrics[r][ROUND_DEADLINE_S])
        for r in (2, 3, 4)
    ]


def test_a_round_waits_for_slow_nodes_when_they_need_under_five_times_longer() -> None:
    # Round 1: the fast nodes need 4 s, the slow ones 12 s. Of the ten, p30
    # (rank 3) is 4 s, p80 (rank 8) 12 s = 3x: wait. At 12 s the slow nodes do
    # 0.8 x 12 / 1.2 = 8 of 10 steps, read as 12 s of full work.
    assert percentiles_and_deadlines(1.2) == [(80.0, pytest.approx(12.0))] * 3


def test_a_round_does_not_wait_when_slow_nodes_need_over_five_times_longer() -> None:
    # Slow nodes do 5 steps in round 1's 16 s: 30 s of full work (7.5x). The
    # deadline is p30, 4 s. With 0.8 x 4 s they do one 3 s step, which reads as
    # 3 x 10 = 30 s of full work, so the next rounds stay fast.
    assert percentiles_and_deadlines(3.0) == [(30.0, pytest.approx(4.0))] * 3


def test_a_fixed_percentile_is_kept_every_round() -> None:
    strategy = DeadlineFedAvg(
        adaptive_deadline=True,
        partial_work=True,
        deadline_percentile=30.0,
        learn_margin=False,  # the percentile's duration itself, no margin on top
    )
    strategy.durations = durations(1, 1, 1, 2, 2, 2, 2, 3, 3, 4)
    assert strategy.current_deadline(2) == pytest.approx(1.0)
    assert strategy.percentile == 30.0


def test_the_default_is_two_speed_with_partial_work_and_p80_without() -> None:
    assert DeadlineFedAvg(partial_work=True).deadline_percentile is None
    assert DeadlineFedAvg().deadline_percentile == 80.0


def test_the_pacer_is_off_with_two_speeds_and_on_with_a_fixed_percentile() -> None:
    assert DeadlineFedAvg(partial_work=True).pacer_step == 0.0
    assert DeadlineFedAvg(partial_work=True, deadline_percentile=30).pacer_step == 0.1
    assert DeadlineFedAvg().pacer_step == 0.1
    assert DeadlineFedAvg(partial_work=True, pacer_step=0.2).pacer_step == 0.2


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"fast_percentile": 0.0}, r"fast_percentile must be in \(0, 80\]"),
        ({"fast_percentile": 90.0}, r"fast_percentile must be in \(0, 80\]"),
        ({"wait_ratio": 0.5}, "wait_ratio must be >= 1"),
    ],
)
def test_two_speed_settings_are_checked(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DeadlineFedAvg(**kwargs)
