"""Bounded influence: how far one node's reply can move the global model.

The strategies serve fleets of devices nobody here controls: a phone may send an
update a million times too large, or claim to have trained on 10^15 samples. Two
bounds limit any one reply, both relative to what the fleet recently sent:

- **Weight cap**: a reply's weight ``w_i`` counts as at most
  ``weight_cap * median(recent weights)``. With ``n`` replies of typical weight,
  one reply's share of the round's total weight is then at most
  ``weight_cap / (weight_cap + n - 1)``.
- **Norm clipping** (Sun, Kairouz, Suresh, McMahan, "Can You Really Backdoor
  Federated Learning?", 2019, Sec. 4: bounding the norm of each update defeats
  most boosted, model-replacement updates): an update as it counts,
  ``u_i = c_i (x_i - x_i0)`` (``c_i`` FedNova's ``1/tau_i`` and a staleness
  discount, 1 for FedAvg), longer than ``C = clip_factor * median(recent
  ||u_j||)`` is scaled down to that length, ``u_i * min(1, C / ||u_i||)``.
  Without a global model (``aggregate_train`` called on its own) replies are
  whole models, not updates, and only the weight cap applies.

"Recent" is the last :data:`HISTORY` accepted replies, this round's included,
so the bounds follow the fleet as training converges; the median is robust to a
minority of outliers. Until :data:`MIN_REFERENCE` replies have been seen in a
run there is no reference: those first replies are held (at most
``MIN_REFERENCE`` models) and folded once the reference exists, or at the end of
the round against the median of what arrived.

For users who want more, :class:`CoordinateRobust` replaces the weighted mean by
a coordinate-wise median or trimmed mean of the updates (Yin, Chen, Ramchandran,
Bartlett, "Byzantine-Robust Distributed Learning: Towards Optimal Statistical
Rates", ICML 2018, Sec. 3; Flower ships both as FedMedian and FedTrimmedAvg).
They hold every update of the round: O(n * model) memory instead of O(model).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from .utils import ReplyRejected, UpdateAccumulator

HISTORY = 64
"""Accepted replies whose weights and update norms form the reference."""
MIN_REFERENCE = 3
"""Replies needed before the reference (their median) is trusted."""
DEFAULT_WEIGHT_CAP = 2.0
"""Default ``weight_cap``: a reply weighs at most 2 typical replies (chosen by the
poisoning measurement in tests/test_influence_gateway.py: honest runs unchanged,
a x1e6 phone at the num-examples ceiling costs under 2 points)."""
DEFAULT_CLIP_FACTOR = 3.0
"""Default ``clip_factor``: updates longer than 3 typical ones are clipped."""
AGGREGATIONS = ("mean", "median", "trimmed-mean")
"""Valid values of the strategies' ``aggregation``."""


class UpdateSum(Protocol):
    """What a strategy folds its updates into (UpdateAccumulator's interface)."""

    @property
    def count(self) -> int:
        """Updates folded (or held) so far."""
        ...

    def add(
        self,
        arrays: Mapping[str, np.ndarray],
        base: Mapping[str, np.ndarray],
        weight: float,
        *,
        scale: float = 1.0,
        steps: float = 1.0,
    ) -> object:
        """Fold one update in (raises ReplyRejected for NaN/Inf)."""
        ...

    def result(
        self,
        current: Mapping[str, np.ndarray],
        *,
        normalise_steps: bool = False,
        step_size: float = 1.0,
    ) -> dict[str, np.ndarray]:
        """The new model from ``current``."""
        ...


class Reference:
    """The last :data:`HISTORY` values of a quantity; their median is the scale."""

    def __init__(self, values: Sequence[float] = ()) -> None:
        self.values: deque[float] = deque(values, maxlen=HISTORY)

    def add(self, value: float) -> None:
        self.values.append(value)

    def median(self, *, minimum: int = MIN_REFERENCE) -> float | None:
        """The median once at least ``minimum`` values are known, else None."""
        if len(self.values) < max(1, minimum):
            return None
        return float(np.median(np.fromiter(self.values, float)))


def update_norm(
    arrays: Mapping[str, np.ndarray], base: Mapping[str, np.ndarray]
) -> float:
    """``||x - base||`` over the float arrays; ReplyRejected if not finite."""
    squares = 0.0
    for name, value in arrays.items():
        if np.asarray(value).dtype.kind != "f":
            continue
        delta = np.subtract(value, base[name], dtype=np.float64)
        squares += float(np.dot(delta.ravel(), delta.ravel()))
        if not math.isfinite(squares):
            raise ReplyRejected(f"array {name!r} contains NaN or Inf")
    return math.sqrt(squares)


@dataclass
class _Held:
    arrays: Mapping[str, np.ndarray]
    base: Mapping[str, np.ndarray]
    weight: float
    scale: float
    steps: float


class BoundedSum:
    """:class:`UpdateAccumulator` with a weight cap and norm clipping (see module).

    ``weights`` and ``norms`` are the strategy's references, kept across rounds;
    ``weight_cap``/``clip_factor`` None turn a bound off. ``capped`` and
    ``clipped`` count the replies each bound changed. ``memory``: where the
    sums are made (:class:`UpdateAccumulator`).
    """

    def __init__(
        self,
        weight_cap: float | None,
        clip_factor: float | None,
        weights: Reference,
        norms: Reference,
        memory: Mapping[str, np.ndarray] | None = None,
    ) -> None:
        self.sum = UpdateAccumulator(memory)
        self.weight_cap = weight_cap
        self.clip_factor = clip_factor
        self.weights = weights
        self.norms = norms
        self.held: list[_Held] = []
        self.capped = 0
        self.clipped = 0

    @property
    def count(self) -> int:
        return self.sum.count + len(self.held)

    def _references(self, minimum: int) -> tuple[float | None, float | None] | None:
        """(weight cap, norm bound), or None while a needed reference is missing."""
        cap = bound = None
        if self.weight_cap is not None:
            median = self.weights.median(minimum=minimum)
            if median is None:
                return None
            cap = self.weight_cap * median
        if self.clip_factor is not None:
            median = self.norms.median(minimum=minimum)
            if median is None:
                return None
            bound = self.clip_factor * median if median > 0 else None
        return cap, bound

    def add(
        self,
        arrays: Mapping[str, np.ndarray],
        base: Mapping[str, np.ndarray],
        weight: float,
        *,
        scale: float = 1.0,
        steps: float = 1.0,
    ) -> None:
        """Fold one update in, bounded; hold it while there is no reference."""
        references = self._references(MIN_REFERENCE)
        if references is None:
            norm = scale * update_norm(arrays, base)  # rejects NaN/Inf first
            self.held.append(_Held(arrays, base, weight, scale, steps))
            self.weights.add(weight)
            self.norms.add(norm)
            if self._references(MIN_REFERENCE) is not None:
                self._release(MIN_REFERENCE)
            return
        norm = self._fold(_Held(arrays, base, weight, scale, steps), *references)
        self.weights.add(weight)
        self.norms.add(norm)

    def _fold(self, update: _Held, cap: float | None, bound: float | None) -> float:
        """Fold one update, bounded; return the norm of its contribution.

        The norm bounded is that of ``c_i d_i``, the update as it counts (FedNova's
        ``1/tau_i``, a staleness discount), so that a node doing more steps is not
        clipped for its longer update.
        """
        weight = update.weight
        if cap is not None and weight > cap:
            weight = cap
            self.capped += 1
        max_norm = bound / update.scale if bound and update.scale > 0 else None
        norm = self.sum.add(
            update.arrays,
            update.base,
            weight,
            scale=update.scale,
            steps=update.steps,
            max_norm=max_norm,
        )
        if max_norm is not None and norm > max_norm:
            self.clipped += 1
        return norm * update.scale

    def _release(self, minimum: int) -> None:
        references = self._references(minimum)
        assert references is not None
        held, self.held = self.held, []
        for update in held:
            self._fold(update, *references)

    def result(
        self,
        current: Mapping[str, np.ndarray],
        *,
        normalise_steps: bool = False,
        step_size: float = 1.0,
    ) -> dict[str, np.ndarray]:
        """Fold what is held (against the median of what arrived), then the model."""
        if self.held:
            self._release(1)
        return self.sum.result(
            current, normalise_steps=normalise_steps, step_size=step_size
        )


class CoordinateRobust:
    """Coordinate-wise median or trimmed mean of the round's updates.

    Each update enters as ``c_i (x_i - base_i)`` (its staleness discount and, with
    FedNova, ``1/tau_i``); the new model is ``x + eta m A`` where ``A`` is, per
    coordinate, the median of the updates (``"median"``) or the mean of those
    left after dropping the ``floor(trim_fraction n)`` largest and smallest
    (``"trimmed-mean"``), and ``m`` FedNova's ``tau_eff`` or 1 (Yin et al., ICML
    2018, Sec. 3). Weights do not enter the average, as in Flower's FedMedian and
    FedTrimmedAvg. Holds every update: O(n * model) memory.
    """

    def __init__(self, method: str, trim_fraction: float = 0.2) -> None:
        if method not in ("median", "trimmed-mean"):
            raise ValueError(
                f"unknown robust aggregation {method!r}; valid: median, trimmed-mean"
            )
        if not 0 <= trim_fraction < 0.5:
            raise ValueError(f"trim_fraction must be in [0, 0.5), got {trim_fraction}")
        self.method = method
        self.trim_fraction = trim_fraction
        self.updates: list[dict[str, np.ndarray]] = []
        self.total_weight = 0.0
        self.weighted_steps = 0.0

    @property
    def count(self) -> int:
        return len(self.updates)

    def add(
        self,
        arrays: Mapping[str, np.ndarray],
        base: Mapping[str, np.ndarray],
        weight: float,
        *,
        scale: float = 1.0,
        steps: float = 1.0,
    ) -> None:
        """Keep ``scale (x - base)``; ReplyRejected if it is not finite."""
        update = {}
        for name, value in arrays.items():
            delta = np.subtract(value, base[name], dtype=np.float64)
            delta *= scale
            if not np.isfinite(delta).all():
                raise ReplyRejected(f"array {name!r} contains NaN or Inf")
            update[name] = delta
        self.updates.append(update)
        self.total_weight += weight
        self.weighted_steps += weight * steps

    def result(
        self,
        current: Mapping[str, np.ndarray],
        *,
        normalise_steps: bool = False,
        step_size: float = 1.0,
    ) -> dict[str, np.ndarray]:
        if not self.updates:
            raise ValueError("no updates to aggregate")
        m = self.weighted_steps / self.total_weight if normalise_steps else 1.0
        trim = math.floor(self.trim_fraction * len(self.updates))
        out: dict[str, np.ndarray] = {}
        for name, value in current.items():
            stack = np.stack([u[name] for u in self.updates])
            if self.method == "median":
                centre = np.median(stack, axis=0)
            else:
                ordered = np.sort(stack, axis=0)
                centre = ordered[trim : len(self.updates) - trim].mean(axis=0)
            new = value.astype(np.float64) + step_size * m * centre
            if value.dtype.kind in "iub":
                new = np.rint(new)
            out[name] = new.astype(value.dtype)
        return out
