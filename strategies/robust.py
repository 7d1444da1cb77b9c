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

With ``pull_bound`` (opt-in: ``Robustness.hardened()``), the two are bounded
together, on the reply's pull, weight times length: an update is clipped to
``C_i = clip_factor * median(recent ||u_j||) * min(1, w_med / w_i)`` (``w_i`` its
weight after the cap, ``w_med`` the median of recent weights), so
``w_i ||u_i||`` is at most ``clip_factor * w_med * median ||u_j||`` however the
reply splits it between weight and length. Bounded apart, a reply can take both
maxima at once, ``weight_cap * clip_factor`` typical pulls, round after round
(tests/test_drift_attack.py measures what that costs). Not the default: it also
clips honest replies of above-median weight, so Flower's own FedAvg tests (with
uneven weights) no longer give FedAvg's average.

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
from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np
from flowerbed.replies import ReplyRejected
from flowerbed.strategies.accumulation import Update, UpdateAccumulator, update_norm

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

    def add_many(self, updates: Sequence[Update]) -> list[float | ReplyRejected]:
        """:meth:`add` on each in order (in one pass where it can); each one's
        outcome instead of raising: a number, or the ReplyRejected."""
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


@dataclass
class _Held:
    arrays: Mapping[str, np.ndarray]
    base: Mapping[str, np.ndarray]
    weight: float
    scale: float
    steps: float
    norm: float | None = None
    """``||x - base||``, once a pass has taken it."""


class BoundedSum:
    """:class:`UpdateAccumulator` with a weight cap and norm clipping (see module).

    ``weights`` and ``norms`` are the strategy's references, kept across rounds;
    ``weight_cap``/``clip_factor`` None turn a bound off. ``capped`` and
    ``clipped`` count the replies each bound changed. ``memory``: where the
    sums are made and ``spare`` more of it (:class:`UpdateAccumulator`:
    :meth:`add_many` writes each group's pass to memory other than the sum).
    """

    def __init__(
        self,
        weight_cap: float | None,
        clip_factor: float | None,
        weights: Reference,
        norms: Reference,
        memory: Mapping[str, np.ndarray] | None = None,
        spare: Mapping[str, np.ndarray] | None = None,
        *,
        pull_bound: bool = False,
    ) -> None:
        self.sum = UpdateAccumulator(memory, spare)
        self.pull_bound = pull_bound
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
        """Fold one update in, bounded; hold it while there is no reference.

        Raises
        ------
        ReplyRejected
            When the update holds NaN or Inf (nothing of it counts).
        """
        (outcome,) = self.add_many([Update(arrays, base, weight, scale, steps)])
        if isinstance(outcome, ReplyRejected):
            raise outcome

    def add_many(self, updates: Sequence[Update]) -> list[float | ReplyRejected]:
        """Fold several updates in, bounded, in one pass where the references exist.

        The same decisions as :meth:`add` on each in order, and the same sum to
        within float32 rounding. The weights are capped in order before the
        pass, as if every update were accepted; the pass (one for the group,
        :meth:`UpdateAccumulator.add_many`) takes each update's norm and
        NaN/Inf check; then each update's decisions are replayed in order
        against the references as they stand after the updates before it.
        When they match what was folded (no update clipped, no rejection that
        moves a later cap), the pass is kept (``keep``); otherwise the sum is
        left as it was and the group folded again one update at a time with
        the replayed decisions, so that an unbounded outlier never enters the
        float32 sum (taking it back out would cancel away the other updates'
        digits).
        Returns each update's norm as it counts (``||c_i d_i||``), or why it
        was rejected; a rejected update counts nowhere, references included.
        """
        outcomes: list[float | ReplyRejected] = []
        first = 0
        while first < len(updates) and self._references(MIN_REFERENCE) is None:
            outcomes.append(self._hold(updates[first]))
            first += 1
        rest = list(updates[first:])
        if not rest:
            return outcomes
        planned = self._planned_weights(rest)
        decisions: list[tuple[float, float | None] | None] = []

        kept = True

        def replay(folded: list[float | ReplyRejected]) -> bool:
            """Each update's decisions in order; whether the pass folded them."""
            nonlocal kept
            spoiled = False
            for update, weight_folded, outcome in zip(
                rest, planned, folded, strict=True
            ):
                if isinstance(outcome, ReplyRejected):
                    decisions.append(None)
                    outcomes.append(outcome)
                    continue
                references = self._references(MIN_REFERENCE)
                assert references is not None  # they exist once, and stay
                weight, max_norm = self._bounds(update, *references)
                if max_norm is not None and outcome > max_norm:
                    self.clipped += 1
                    spoiled = True
                spoiled = spoiled or weight != weight_folded
                decisions.append((weight, max_norm))
                norm = outcome * update.scale
                self.weights.add(update.weight)
                self.norms.add(norm)
                outcomes.append(norm)
            kept = not spoiled
            return kept

        self.sum.add_many(
            [
                Update(u.arrays, u.base, w, u.scale, u.steps)
                for u, w in zip(rest, planned, strict=True)
            ],
            keep=replay,
        )
        if kept:
            return outcomes
        for update, decision, outcome in zip(
            rest, decisions, outcomes[first:], strict=True
        ):
            if decision is not None:
                raw = float(outcome) / update.scale if update.scale > 0 else None
                self._add(replace(update, norm=raw), *decision)
        return outcomes

    def _planned_weights(self, updates: Sequence[Update]) -> list[float]:
        """Each update's weight, capped as :meth:`add` would cap it in order if
        every update before it were accepted."""
        if self.weight_cap is None:
            return [u.weight for u in updates]
        weights = Reference(self.weights.values)
        planned = []
        for update in updates:
            median = weights.median(minimum=MIN_REFERENCE)
            assert median is not None  # the references exist (add_many)
            planned.append(min(update.weight, self.weight_cap * median))
            weights.add(update.weight)
        return planned

    def _hold(self, update: Update) -> float | ReplyRejected:
        """Hold an update while there is no reference; release the held ones
        once there is. Returns its norm as it counts, or why it was rejected."""
        try:
            raw = update_norm(update.arrays, update.base)
        except ReplyRejected as rejection:  # NaN/Inf: checked before holding
            return rejection
        norm = update.scale * raw
        self.held.append(
            _Held(
                update.arrays,
                update.base,
                update.weight,
                update.scale,
                update.steps,
                raw,
            )
        )
        self.weights.add(update.weight)
        self.norms.add(norm)
        if self._references(MIN_REFERENCE) is not None:
            self._release(MIN_REFERENCE)
        return norm

    def _fold(self, update: _Held, cap: float | None, bound: float | None) -> float:
        """Fold one update, bounded; return the norm of its contribution.

        The norm bounded is that of ``c_i d_i``, the update as it counts (FedNova's
        ``1/tau_i``, a staleness discount), so that a node doing more steps is not
        clipped for its longer update.
        """
        weight, max_norm = self._bounds(update, cap, bound)
        norm = self._add(update, weight, max_norm)
        if max_norm is not None and norm > max_norm:
            self.clipped += 1
        return norm * update.scale

    def _bounds(
        self, update: _Held | Update, cap: float | None, bound: float | None
    ) -> tuple[float, float | None]:
        """The weight an update counts with (``capped`` counts a capped one)
        and the norm of ``d_i`` it is clipped to (None: not clipped)."""
        weight = update.weight
        if cap is not None and weight > cap:
            weight = cap
            self.capped += 1
        if self.pull_bound and bound and cap is not None and self.weight_cap:
            # the pull w_i ||u_i|| at most clip_factor x w_med x median norm
            typical = cap / self.weight_cap  # w_med
            if weight > typical:
                bound *= typical / weight
        # ``bound`` is on ||c_i d_i||: on ||d_i|| it is bound / c_i
        return weight, bound / update.scale if bound and update.scale > 0 else None

    def _add(
        self, update: _Held | Update, weight: float, max_norm: float | None
    ) -> float:
        """Fold ``update`` with ``weight``, clipped to ``max_norm``; its norm."""
        return self.sum.add(
            update.arrays,
            update.base,
            weight,
            scale=update.scale,
            steps=update.steps,
            max_norm=max_norm,
            norm=update.norm,
        )

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

    def add_many(self, updates: Sequence[Update]) -> list[float | ReplyRejected]:
        """:meth:`add` on each in order (all are held anyway); each one's
        outcome: 0.0 (no norm is taken) or why it was rejected."""
        outcomes: list[float | ReplyRejected] = []
        for u in updates:
            try:
                self.add(u.arrays, u.base, u.weight, scale=u.scale, steps=u.steps)
            except ReplyRejected as rejection:
                outcomes.append(rejection)
            else:
                outcomes.append(0.0)
        return outcomes

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
