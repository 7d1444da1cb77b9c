"""A board's compute speed for sizing tiles: the fixed cost per step kept apart.

A member's compute seconds per step are not proportional to the work its tile
gives it: every step also pays a cost that does not grow with the tile (Python
and operator dispatch for each layer of each group, halo bookkeeping, the small
tensors of the head), so a small tile looks slow per MAC. Sizing tiles by
``MACs / seconds`` then feeds back: the board that got the smaller tile measures
slower, gets a smaller tile still, and two equal boards drift apart. This module
keeps the two costs apart, the linear model of a step's compute::

    seconds(m) = fixed_s + m / rate

(``m`` the step's forward MACs on the board, ``rate`` its MACs per second), and
the planner sizes tiles by ``rate`` alone
(:func:`flowerbed.parallel.tiles.grouping.plan_tiles`: area in proportion to
speed), so boards with equal ``rate`` get equal tiles whatever their tiles were
before.

How each observation ``(m, seconds)`` of a completed segment updates the model
(:meth:`SpeedModel.observe`):

- the first: ``rate`` is the profile's (measured on two crop sizes, so it is the
  slope, fixed cost excluded) and the residual ``seconds - m / rate`` is the
  fixed cost;
- when ``m`` changed by at least :data:`MIN_SPREAD` since the previous
  observation, the two points give the line: ``1 / rate`` is the slope and
  ``fixed_s`` the intercept;
- otherwise the board as a whole ran ``s = seconds / predicted`` times slower
  (or faster): both costs scale by ``s`` (a throttled CPU is slower at
  everything).

Each new estimate is blended with the old one by exponential smoothing with
weight ``a`` (``x <- a x_new + (1 - a) x``; seconds per MAC are blended, so
rates combine harmonically), so one noisy segment moves the tiles little.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MIN_SPREAD = 0.2
"""Least relative change of a board's MACs per step between two observations
for them to fit the line (closer points make the slope noise)."""
DEFAULT_SMOOTHING = 0.5
"""Weight of a new estimate (``a``)."""


def _positive(value: float, name: str) -> float:
    if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


def two_point_rate(
    small: tuple[float, float], large: tuple[float, float]
) -> tuple[float, float]:
    """``(rate, fixed_s)`` of the line through two ``(macs, seconds)`` timings.

    The slope is seconds per MAC; when it is not positive (timing noise on
    almost equal times), the larger timing's ``macs / seconds`` with no fixed
    cost is the answer.
    """
    (m1, t1), (m2, t2) = small, large
    for name, value in (("macs", m1), ("macs", m2), ("seconds", t1), ("seconds", t2)):
        _positive(value, name)
    if m2 != m1:
        slope = (t2 - t1) / (m2 - m1)
        if slope > 0:
            fixed = max(0.0, t2 - m2 * slope)
            return 1.0 / slope, fixed
    return m2 / t2, 0.0


@dataclass
class SpeedModel:
    """One board's ``seconds(m) = fixed_s + m / rate`` (module doc).

    Attributes
    ----------
    rate : float
        MACs per second of the work that grows with the tile (the planner's
        speed).
    fixed_s : float
        Seconds per step that do not grow with the tile.
    smoothing : float
        Weight ``a`` of a new estimate, in (0, 1].
    last : tuple of float, optional
        The previous observation ``(macs, seconds)``.
    """

    rate: float
    fixed_s: float = 0.0
    smoothing: float = DEFAULT_SMOOTHING
    last: tuple[float, float] | None = None

    def __post_init__(self) -> None:
        _positive(self.rate, "rate")
        if not (math.isfinite(self.fixed_s) and self.fixed_s >= 0):
            raise ValueError(f"fixed_s must be >= 0, got {self.fixed_s!r}")
        if not 0 < self.smoothing <= 1:
            raise ValueError(f"smoothing must be in (0, 1], got {self.smoothing!r}")

    def predict(self, macs: float) -> float:
        """Seconds of a step of ``macs`` MACs."""
        return self.fixed_s + macs / self.rate

    def observe(self, macs: float, seconds: float) -> None:
        """Update from a segment's ``(MACs per step, compute seconds per step)``."""
        macs, seconds = _positive(macs, "macs"), _positive(seconds, "seconds")
        if self.last is None:
            # the profile's rate excludes the fixed cost: the residual is it
            fixed = max(0.0, seconds - macs / self.rate)
            rate = self.rate if fixed > 0 else macs / seconds
            self.rate, self.fixed_s = rate, fixed
            self.last = (macs, seconds)
            return
        last_macs, last_seconds = self.last
        spread = abs(macs - last_macs) / max(macs, last_macs)
        fitted = None
        if spread >= MIN_SPREAD:
            small, large = sorted([(last_macs, last_seconds), (macs, seconds)])
            if (large[1] - small[1]) > 0:
                fitted = two_point_rate(small, large)
        if fitted is None:
            scale = seconds / self.predict(macs)
            fitted = (self.rate / scale, self.fixed_s * scale)
        new_rate, new_fixed = fitted
        a = self.smoothing
        self.rate = 1.0 / (a / new_rate + (1 - a) / self.rate)
        self.fixed_s = a * new_fixed + (1 - a) * self.fixed_s
        self.last = (macs, seconds)
