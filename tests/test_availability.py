"""The diurnal availability model against its formula, and the grid that applies it."""

import math
from collections.abc import Iterable

import numpy as np
import pytest
from flowerbed.grid import GridWrapper
from flowerbed.sims.availability import AvailabilityGrid, DiurnalAvailability


def test_probability_follows_the_cosine_over_the_day() -> None:
    m = DiurnalAvailability(10, mean=0.3, amplitude=0.6, peak_hour=2.0)
    assert m.probability(2.0) == pytest.approx(0.48)  # 0.3 x 1.6 at the peak
    assert m.probability(14.0) == pytest.approx(0.12)  # 0.3 x 0.4 at the trough
    assert m.probability(8.0) == pytest.approx(0.3)  # cos(pi/2) = 0
    assert m.probability(26.0) == pytest.approx(0.48)  # a day later


@pytest.mark.parametrize(("start_hour", "expected"), [(2.0, 0.48), (14.0, 0.12)])
def test_share_of_eligible_devices_matches_the_formula(
    start_hour: float, expected: float
) -> None:
    m = DiurnalAvailability(40_000, timezone_spread_h=0.0, start_hour=start_hour)
    share = m.available_mask(0.0).mean()
    # binomial standard error sqrt(p (1-p) / n) < 0.0025; allow 4 of them
    assert share == pytest.approx(expected, abs=0.01)


def test_local_hours_are_the_slot_start_plus_each_devices_offset() -> None:
    m = DiurnalAvailability(1000, timezone_spread_h=3.0, start_hour=20.0, slot_s=600)
    hours = m.local_hours(1_250.0)  # slot 2 starts at 1,200 s = 20:20
    offsets = np.mod(hours - (20.0 + 1200 / 3600), 24.0)
    offsets = np.where(offsets > 12, offsets - 24, offsets)
    assert offsets.min() >= -3.0 and offsets.max() <= 3.0
    assert np.array_equal(hours, m.local_hours(1_799.0))  # same slot


def test_eligibility_is_drawn_per_slot_and_repeats_by_seed() -> None:
    a = DiurnalAvailability(500, seed=7)
    b = DiurnalAvailability(500, seed=7)
    assert np.array_equal(a.available_mask(100.0), b.available_mask(599.0))
    assert not np.array_equal(a.available_mask(100.0), a.available_mask(700.0))
    other = DiurnalAvailability(500, seed=8)
    assert not np.array_equal(a.available_mask(100.0), other.available_mask(100.0))
    mask = a.available_mask(100.0)
    assert a.available([3, 4, 5, 6], 100.0) == [d for d in (3, 4, 5, 6) if mask[d]]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_devices": 0}, "num_devices must be >= 1"),
        ({"mean": 0.0}, "mean must be in"),
        ({"amplitude": 1.0}, "amplitude must be in"),
        ({"mean": 0.8, "amplitude": 0.5}, "mean x \\(1 \\+ amplitude\\) must be <= 1"),
        ({"slot_s": 0.0}, "slot_s must be > 0"),
    ],
)
def test_bad_parameters_say_which(kwargs: dict, message: str) -> None:  # type: ignore[type-arg]
    args = {"num_devices": 10, **kwargs}
    with pytest.raises(ValueError, match=message):
        DiurnalAvailability(**args)


def test_time_must_be_finite() -> None:
    with pytest.raises(ValueError, match="time must be finite"):
        DiurnalAvailability(3).available_mask(math.inf)


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t

    def wait(self, seconds: float) -> None:
        self.t += seconds


class _Grid(GridWrapper):
    def __init__(self) -> None:
        self.clock = _Clock()

    def get_node_ids(self) -> Iterable[int]:
        return [100, 101, 102, 103, 104, 105]


def test_grid_offers_only_the_eligible_devices_at_the_clocks_now() -> None:
    inner = _Grid()
    model = DiurnalAvailability(6, seed=1)
    grid = AvailabilityGrid(inner, model, {100 + i: i for i in range(6)})
    for t in (0.0, 650.0, 7_000.0):
        inner.clock.t = t
        mask = model.available_mask(t)
        assert list(grid.get_node_ids()) == [100 + i for i in range(6) if mask[i]]
