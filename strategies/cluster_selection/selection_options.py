"""ClusterSelection's option objects, one concern each, each checking its values.

- :class:`SelectionGoal`: what is optimised, for which job, over which
  configurations;
- :class:`Profiling`: the timed profiling tasks;
- :class:`Certainty`: how sure the choice must be (refinement, racing and the
  confidence figure);
- :class:`Tracking`: when training re-selects.

The flat keywords these replace (``ClusterSelection(objective="energy")``) still
work for one release and warn with the object to use instead
(:func:`flowerbed.strategies.options.take_options`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..options import _check
from .model import MODES, check_objective
from .refine import (
    DEFAULT_INDIFFERENCE,
    DEFAULT_PROFILE_BUDGET,
    DEFAULT_RACE_SHARE,
    DEFAULT_TARGET_CONFIDENCE,
)
from .search import CONFIDENCE_DRAWS, EXHAUSTIVE_MAX_NODES

DEFAULT_PROFILE_STEPS = (1, 3)
"""Steps of the two timed profiling tasks (two lengths separate s_i from c_i)."""
DEFAULT_PROFILE_MAX_TASKS = 32
"""Most profiling tasks one node runs while slower nodes finish theirs."""
DEFAULT_POWER_GAIN_ERROR = 0.03
"""Assumed relative calibration error of a node's power sensor, for the confidence
figure only (an INA219-class shunt monitor is specified to about 1%, a phone's fuel
gauge is worse; 3% is an assumption, not a measurement)."""
DEFAULT_PROFILE_TIMEOUT_S = 600.0
"""Clock seconds a profiling task may take; slower nodes are left out."""
DEFAULT_DRIFT_TOLERANCE = 0.25
"""Relative gap between measured and estimated round time that triggers re-selection."""
DEFAULT_DROP_AFTER_FAILURES = 2
"""Consecutive failed or missing replies after which a member counts as gone."""


@dataclass(frozen=True)
class SelectionGoal:
    """What the selection optimises, for which job, over which configurations.

    Parameters
    ----------
    objective : str (default: "time")
        ``"time"``, ``"energy"``, ``"edp"`` or ``"time-to-accuracy"``.
    mode : str, optional (default: None)
        ``"sync"`` (the slowest member sets the pace) or ``"async"`` (throughputs
        add up); None means ``"async"`` for a wrapped ``FedBuff``, else ``"sync"``.
    round_steps : int, optional (default: None)
        sync: optimiser steps per round, split over the members; None means the
        train config's ``local-steps`` times the number of profiled nodes (the
        work the whole fleet would do). Without either, each task is estimated
        as ``max(profile_steps)`` steps and each ClientApp does its own work
        (no ``local-steps`` is sent); logged once.
    kappa : float (default: 1.0)
        Weight of the participation term in the rounds to accuracy,
        rounds = R (1 + kappa / k) (Li et al., ICLR 2020, Theorem 3).
    search : str (default: "auto")
        ``"exhaustive"``, ``"polynomial"`` or ``"auto"``.
    exhaustive_max_nodes : int (default: 12)
        ``"auto"`` searches exhaustively up to this many nodes.
    min_nodes : int, optional (default: None)
        Smallest configuration; None means the wrapped strategy's
        ``max(min_train_nodes, min_available_nodes)`` (it would wait forever for
        more nodes than it is shown).
    """

    objective: str = "time"
    mode: str | None = None
    round_steps: int | None = None
    kappa: float = 1.0
    search: str = "auto"
    exhaustive_max_nodes: int = EXHAUSTIVE_MAX_NODES
    min_nodes: int | None = None

    def __post_init__(self) -> None:
        check_objective(self.objective)
        if self.mode is not None and self.mode not in MODES:
            raise ValueError(
                f"unknown mode {self.mode!r}; valid choices: {', '.join(MODES)}"
            )
        _check(
            [
                (
                    self.round_steps is None or self.round_steps >= 1,
                    "round_steps must be >= 1",
                ),
                (self.kappa >= 0, "kappa must be >= 0"),
                (
                    self.min_nodes is None or self.min_nodes >= 1,
                    "min_nodes must be >= 1",
                ),
            ],
            type(self).__name__,
        )


@dataclass(frozen=True)
class Profiling:
    """The timed profiling tasks every node runs before the selection.

    Parameters
    ----------
    profile_steps : Sequence[int] (default: (1, 3))
        Steps of the timed profiling tasks; the query asks for the largest.
    use_query : bool (default: True)
        Try the board clients' profiling query before training tasks.
    profile_timeout_s : float (default: 600.0)
        Clock seconds the profiling phase may take; silent nodes are left out.
    profile_max_tasks : int (default: 32)
        Most profiling tasks one node runs: nodes that finish ``profile_steps``
        early repeat them, up to this many, until the slowest node is done.
    """

    profile_steps: Sequence[int] = DEFAULT_PROFILE_STEPS
    use_query: bool = True
    profile_timeout_s: float = DEFAULT_PROFILE_TIMEOUT_S
    profile_max_tasks: int = DEFAULT_PROFILE_MAX_TASKS

    def __post_init__(self) -> None:
        steps = tuple(int(s) for s in self.profile_steps)
        object.__setattr__(self, "profile_steps", steps)
        _check(
            [
                (
                    len(steps) >= 1 and min(steps) >= 1,
                    "profile_steps must be one or more step counts >= 1",
                ),
                (self.profile_timeout_s > 0, "profile_timeout_s must be > 0"),
                (
                    self.profile_max_tasks >= len(steps),
                    "profile_max_tasks must be >= len(profile_steps)",
                ),
            ],
            type(self).__name__,
        )


@dataclass(frozen=True)
class Certainty:
    """How sure the choice must be: refinement, racing, the confidence figure.

    Parameters
    ----------
    target_confidence : float (default: 0.99)
        Refinement stops once the choice is this likely to beat its rivals, by
        the fits' standard errors.
    profile_budget : float (default: 0.05)
        Refinement stops before profiling would take more than this share of
        the chosen configuration's estimated job; 0 turns refinement off.
    indifference : float (default: 0.002)
        Configurations within this share of each other's estimate count as
        equally good for ``target_confidence`` (Bechhofer's indifference zone):
        refinement does not spend the budget telling twins apart.
    race_share : float (default: 0.1)
        Synchronous mode: while the choice is not ``target_confidence`` sure,
        training rounds keep refining it (racing, see
        :func:`~flowerbed.strategies.cluster_selection.race_next`): every reply
        refits its node, the choice follows the lowest estimate, and every
        other round, at most ``race_share`` x ``num_rounds`` in all, runs on
        the leading rival; after that the choice is refitted every
        :data:`~flowerbed.strategies.cluster_selection.RACE_GREEDY_EVERY`
        rounds until sure. 0 turns racing off.
    power_gain_error : float (default: 0.03)
        Assumed relative calibration error of the power sensors, used only by
        the confidence figure (it cannot be seen in profiling).
    confidence_draws : int (default: 100)
        Parameter draws behind the confidence figure logged with each selection.
    """

    target_confidence: float = DEFAULT_TARGET_CONFIDENCE
    profile_budget: float = DEFAULT_PROFILE_BUDGET
    indifference: float = DEFAULT_INDIFFERENCE
    race_share: float = DEFAULT_RACE_SHARE
    power_gain_error: float = DEFAULT_POWER_GAIN_ERROR
    confidence_draws: int = CONFIDENCE_DRAWS

    def __post_init__(self) -> None:
        _check(
            [
                (
                    0 <= self.target_confidence <= 1,
                    "target_confidence must be between 0 and 1",
                ),
                (self.profile_budget >= 0, "profile_budget must be >= 0"),
                (self.indifference >= 0, "indifference must be >= 0"),
                (0 <= self.race_share <= 1, "race_share must be between 0 and 1"),
                (self.power_gain_error >= 0, "power_gain_error must be >= 0"),
                (self.confidence_draws >= 2, "confidence_draws must be >= 2"),
            ],
            type(self).__name__,
        )


@dataclass(frozen=True)
class Tracking:
    """When training re-selects: a member lost, or the estimate drifted.

    Parameters
    ----------
    drift_tolerance : float (default: 0.25)
        Relative gap between measured and estimated round time that triggers
        re-selection.
    drop_after_failures : int (default: 2)
        Consecutive failed or missing replies after which a member counts as gone.
    """

    drift_tolerance: float = DEFAULT_DRIFT_TOLERANCE
    drop_after_failures: int = DEFAULT_DROP_AFTER_FAILURES

    def __post_init__(self) -> None:
        _check(
            [
                (self.drift_tolerance > 0, "drift_tolerance must be > 0"),
                (self.drop_after_failures >= 1, "drop_after_failures must be >= 1"),
            ],
            type(self).__name__,
        )
