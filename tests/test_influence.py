"""Bounded influence (flowerbed.strategies.robust) against hand-computed averages.

Models are one float, the global model 0; an update is the reply's value.
"""

from __future__ import annotations

import numpy as np
import pytest
from flowerbed.replies import ReplyRejected
from flowerbed.strategies import DeadlineFedAvg, FedBuff, RuntimeWeightedFedAvg
from flowerbed.strategies.robust import (
    MIN_REFERENCE,
    BoundedSum,
    CoordinateRobust,
    Reference,
)
from test_strategies_fakes import FakeGrid, node, weights

BASE = {"w": np.zeros(1, np.float32)}


def x(value: float) -> dict[str, np.ndarray]:
    return {"w": np.array([value], np.float32)}


def bounded(**kwargs: float | None) -> BoundedSum:
    settings: dict[str, float | None] = {"weight_cap": 2.0, "clip_factor": 3.0}
    settings.update(kwargs)
    return BoundedSum(
        settings["weight_cap"], settings["clip_factor"], Reference(), Reference()
    )


def seeded(values: list[float]) -> Reference:
    return Reference(values)


def test_a_heavy_long_update_counts_as_two_typical_weights_of_three_typical_norms() -> (
    None
):
    # References: weights [1, 1, 1] (median 1), norms [1, 1, 1] (median 1).
    # Replies +1 (w 1), +1 (w 1), +10 (w 10): the last counts with weight
    # 2 x 1 = 2 and update 3 x 1 = 3: (1 + 1 + 2 x 3) / (1 + 1 + 2) = 2.
    total = BoundedSum(2.0, 3.0, seeded([1, 1, 1]), seeded([1, 1, 1]))
    for value, weight in ((1.0, 1.0), (1.0, 1.0), (10.0, 10.0)):
        total.add(x(value), BASE, weight)
    assert total.result(BASE)["w"][0] == pytest.approx(2.0)
    assert (total.capped, total.clipped) == (1, 1)
    # unbounded: (1 + 1 + 100) / 12
    free = BoundedSum(None, None, Reference(), Reference())
    for value, weight in ((1.0, 1.0), (1.0, 1.0), (10.0, 10.0)):
        free.add(x(value), BASE, weight)
    assert free.result(BASE)["w"][0] == pytest.approx(8.5)


def test_the_first_replies_of_a_run_wait_for_a_reference() -> None:
    # No history: +1 (w 1) and +2 (w 1) are held; with +100 (w 100) there are
    # three: median weight 1 -> cap 2, median norm 2 -> bound 6, so
    # (1 + 2 + 2 x 6) / (1 + 1 + 2) = 3.75.
    total = bounded()
    total.add(x(1.0), BASE, 1.0)
    total.add(x(2.0), BASE, 1.0)
    assert len(total.held) == 2 == total.count
    total.add(x(100.0), BASE, 100.0)
    assert total.held == [] and MIN_REFERENCE == 3
    assert total.result(BASE)["w"][0] == pytest.approx(3.75)


def test_fewer_replies_than_the_reference_needs_use_their_own_median() -> None:
    # Two replies, no history: +1 (w 1), +4 (w 2); medians 1.5 and 2.5 -> cap 3,
    # bound 7.5: nothing binds, (1 + 8) / 3 = 3.
    total = bounded()
    total.add(x(1.0), BASE, 1.0)
    total.add(x(4.0), BASE, 2.0)
    assert total.result(BASE)["w"][0] == pytest.approx(3.0)


def test_clipping_bounds_the_update_as_it_counts_not_its_raw_length() -> None:
    # FedNova divides an update by its steps: +8 after 8 steps counts as 1, the
    # fleet's typical length, so it is not clipped (raw 8 > 3 x 1).
    total = BoundedSum(None, 3.0, Reference(), seeded([1, 1, 1]))
    total.add(x(8.0), BASE, 1.0, scale=1 / 8, steps=8)
    assert total.clipped == 0


def test_a_held_reply_with_nan_is_rejected_at_once() -> None:
    total = bounded()
    with pytest.raises(ReplyRejected, match="NaN or Inf"):
        total.add(x(float("nan")), BASE, 1.0)
    assert total.held == []


def test_coordinate_median_and_trimmed_mean() -> None:
    updates = [1.0, 2.0, 3.0, 4.0, 100.0]
    median = CoordinateRobust("median")
    trimmed = CoordinateRobust("trimmed-mean", trim_fraction=0.2)
    for value in updates:
        median.add(x(value), BASE, 1.0)
        trimmed.add(x(value), BASE, 1.0)
    assert median.result(BASE)["w"][0] == pytest.approx(3.0)
    # drop floor(0.2 x 5) = 1 from each end: mean(2, 3, 4)
    assert trimmed.result(BASE)["w"][0] == pytest.approx(3.0)
    with pytest.raises(ValueError, match="trim_fraction"):
        CoordinateRobust("trimmed-mean", trim_fraction=0.5)


@pytest.mark.parametrize("aggregation", ["median", "trimmed-mean"])
def test_robust_aggregation_in_a_round(aggregation: str) -> None:
    # Nodes answer +1, +2, +3 and one +1e6: median 2.5; trimmed mean (0.25 of 4:
    # drop 1 each end) of (2, 3) = 2.5.
    grid = FakeGrid(
        {
            1: node(1.0, seconds=1.0),
            2: node(2.0, seconds=1.0),
            3: node(3.0, seconds=1.0),
            4: node(1e6, seconds=1.0),
        }
    )
    strategy = RuntimeWeightedFedAvg(
        aggregation=aggregation, trim_fraction=0.25, fraction_evaluate=0.0
    )
    result = strategy.start(grid, weights(), num_rounds=1)
    assert float(result.arrays["w"].numpy()[0]) == pytest.approx(2.5)


@pytest.mark.parametrize("cls", [RuntimeWeightedFedAvg, DeadlineFedAvg, FedBuff])
def test_the_bound_is_on_by_default_and_its_settings_are_checked(cls: type) -> None:
    strategy = cls()
    assert (strategy.weight_cap, strategy.clip_factor) == (2.0, 3.0)
    assert strategy.aggregation == "mean"
    with pytest.raises(ValueError, match="valid: mean, median, trimmed-mean"):
        cls(aggregation="krum")
    with pytest.raises(ValueError, match="weight_cap must be finite and > 0"):
        cls(weight_cap=float("nan"))
    with pytest.raises(ValueError, match="clip_factor must be finite and > 0"):
        cls(clip_factor=0.0)


def test_one_outlier_phone_moves_the_model_little_with_the_bound() -> None:
    # Five nodes move +1 each round with 10 examples; node 6 sends +1e6 with the
    # ceiling's 1e9 examples. Round 1: the first three replies form the
    # reference (medians 10 examples, |+1|); node 6 counts as 20 examples and
    # +3: (5 x 10 x 1 + 20 x 3) / 70 = 11 / 7.
    grid = FakeGrid(
        {
            **{n: node(1.0, seconds=1.0) for n in range(1, 6)},
            6: node(1e6, seconds=2.0, examples=int(1e9)),
        }
    )
    strategy = RuntimeWeightedFedAvg(weighting="examples", fraction_evaluate=0.0)
    result = strategy.start(grid, weights(), num_rounds=1)
    assert float(result.arrays["w"].numpy()[0]) == pytest.approx(11 / 7, rel=1e-5)


@pytest.mark.parametrize("cls", [RuntimeWeightedFedAvg, DeadlineFedAvg, FedBuff])
@pytest.mark.parametrize(
    ("honest", "expected"),
    [
        # 2 honest (acc 0.5, 10 examples) + 1 claiming 1e9 examples, acc 0:
        # the round's median is 10, the claim counts as 20:
        # (0.5 x 10 + 0.5 x 10 + 0 x 20) / 40 = 0.25
        (2, 0.25),
        # 3 honest + the claim: median 10, (0.5 x 30 + 0 x 20) / 50 = 0.3
        (3, 0.3),
    ],
)
def test_an_evaluation_reply_weighs_at_most_the_cap_times_the_rounds_median(
    cls: type, honest: int, expected: float
) -> None:
    nodes = {n: node(1.0, seconds=1.0, evaluate_acc=0.5) for n in range(1, honest + 1)}
    nodes[9] = node(1.0, seconds=1.0, examples=int(1e9), evaluate_acc=0.0)
    extra = {"buffer_size": honest + 1} if cls is FedBuff else {}
    strategy = cls(min_evaluate_nodes=1, min_available_nodes=1, **extra)
    result = strategy.start(FakeGrid(nodes), weights(), num_rounds=1)
    assert result.evaluate_metrics_clientapp[1]["eval-acc"] == pytest.approx(expected)
    unbounded = cls(
        min_evaluate_nodes=1, min_available_nodes=1, weight_cap=None, **extra
    ).start(FakeGrid(nodes), weights(), num_rounds=1)
    assert unbounded.evaluate_metrics_clientapp[1]["eval-acc"] < 1e-7
