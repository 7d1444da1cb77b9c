"""How far one reply can move the model: the bounds ``aggregate_train`` applies.

:class:`InfluenceBound` makes the sum an aggregation folds into, from
:class:`~flowerbed.strategies.options.Robustness`: a :class:`~.robust.BoundedSum`
(each weight capped at ``weight_cap`` times the median of recent weights, each
update clipped to ``clip_factor`` times the median of recent norms), or a
coordinate-wise robust aggregation (:class:`~.robust.CoordinateRobust`). It caps
the aggregated metrics as the model was capped, and evaluation weights against
the round's own median, and keeps the memory the sums are made in.
"""

from __future__ import annotations

from collections.abc import Mapping
from logging import INFO

import numpy as np
from flowerbed.strategies.accumulation import MetricsAccumulator
from flwr.supercore import log

from .options import Robustness
from .robust import BoundedSum, CoordinateRobust, Reference, UpdateSum


class SumMemory:
    """Where the next aggregation makes its sums: no fresh pages to fault in
    each round (see :class:`~flowerbed.strategies.accumulation.UpdateAccumulator`)."""

    def __init__(self) -> None:
        self.result: dict[str, np.ndarray] = {}
        """The last aggregation's result once encoded."""
        self.spare: dict[str, np.ndarray] = {}
        """The last aggregation's other sum memory (``BoundedSum.add_many``
        writes each group's pass beside the sum)."""

    def take(self) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """The memory kept (result, spare), handed over once."""
        taken = self.result, self.spare
        self.result, self.spare = {}, {}
        return taken

    def keep(
        self,
        new: Mapping[str, np.ndarray],
        current: Mapping[str, np.ndarray],
        updates: UpdateSum,
    ) -> None:
        """Keep an aggregation's result ``new`` (where it is not ``current``'s
        memory) and the other memory of its sum."""
        self.result = {
            name: value
            for name, value in new.items()
            if not np.may_share_memory(value, current[name])
        }
        if isinstance(updates, BoundedSum):
            self.spare = updates.sum.leftover()


class InfluenceBound:
    """The influence bound of one strategy (module docstring).

    Parameters
    ----------
    robustness : Robustness
        ``aggregation``, ``trim_fraction``, ``weight_cap``, ``clip_factor`` and
        ``pull_bound``.
    """

    def __init__(self, robustness: Robustness) -> None:
        self.robustness = robustness
        self.memory = SumMemory()
        """Where the next aggregation makes its sums."""

    def new_sum(self, weights: Reference, norms: Reference, *, clip: bool) -> UpdateSum:
        """What one aggregation folds updates into, bounded against the recent
        ``weights`` and ``norms`` (no clipping without ``clip``)."""
        settings = self.robustness
        if settings.aggregation != "mean":
            return CoordinateRobust(settings.aggregation, settings.trim_fraction)
        memory, spare = self.memory.take()
        return BoundedSum(
            settings.weight_cap,
            settings.clip_factor if clip else None,
            weights,
            norms,
            memory,
            spare,
            pull_bound=settings.pull_bound,
        )

    def say_bounded(self, server_round: int, updates: UpdateSum) -> None:
        """The round's line counting capped weights and clipped updates."""
        if isinstance(updates, BoundedSum) and (updates.capped or updates.clipped):
            log(
                INFO,
                "round %s: influence bound: %d weights capped at %g x the median, "
                "%d updates clipped to %g x the median norm",
                server_round,
                updates.capped,
                self.robustness.weight_cap,
                updates.clipped,
                self.robustness.clip_factor,
            )

    def cap_metrics(self, metrics: MetricsAccumulator, weights: Reference) -> None:
        """Weigh the train metrics as the model was: at most ``weight_cap``
        times the median of the recent ``weights``."""
        reference = weights.median(minimum=1)
        weight_cap = self.robustness.weight_cap
        if weight_cap is not None and reference is not None:
            metrics.cap(weight_cap * reference)

    def cap_evaluation(self, server_round: int, metrics: MetricsAccumulator) -> None:
        """The weight cap on evaluation replies: at most ``weight_cap`` times the
        median of the round's evaluation weights.

        Test sets are not training sets, so the scale is this round's own
        evaluation weights, not the training reference.
        """
        weights = metrics.weights()
        median = float(np.median(weights)) if weights else 0.0
        weight_cap = self.robustness.weight_cap
        if weight_cap is None or median <= 0:
            return
        capped = metrics.cap(weight_cap * median)
        if capped:
            log(
                INFO,
                "round %s: influence bound: %d evaluation weights capped at %g x "
                "the round's median",
                server_round,
                capped,
                weight_cap,
            )
