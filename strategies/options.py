"""Option objects shared by the data-parallel strategies.

A strategy takes Flower ``FedAvg``'s arguments under Flower's names, plus a few of
these small objects, each grouping one concern and checking its own values:

- :class:`WorkBalance`: how replies are weighted and how much work each node gets
  (RuntimeWeightedFedAvg, DeadlineFedAvg, FedBuff);
- :class:`Robustness`: the reply ceiling, the bounded-influence defence, robust
  aggregation and quarantine (the same three);
- :class:`Deadlines`: when a synchronous round closes and what nodes do about it
  (DeadlineFedAvg);
- :class:`Staleness`: how updates computed on an older model count (DeadlineFedAvg's
  late updates, FedBuff);
- :class:`Buffering`: FedBuff's asynchrony.

The flat keywords these replace (``DeadlineFedAvg(weight_cap=3.0)``) still work for
one release and warn with the object to use instead (:func:`take_options`).
"""

from __future__ import annotations

import inspect
import math
import os
import sys
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from flowerbed.replies import MAX_NUM_EXAMPLES
from flowerbed.strategies.staleness import StalenessFn, polynomial_staleness
from flwr.serverapp.strategy import FedAvg

from .robust import AGGREGATIONS, DEFAULT_CLIP_FACTOR, DEFAULT_WEIGHT_CAP

_HERE = os.path.dirname(os.path.abspath(__file__))
"""This package's folder: a deprecation names the first caller outside it."""

WEIGHTINGS = ("runtime", "throughput", "fednova", "examples")
"""Valid values of :attr:`WorkBalance.weighting`."""
DEFAULT_WEIGHTING = "fednova"
"""FedNova's normalised averaging: on unequal fleets with non-IID data it matched
FedAvg with equal work and beat the other weightings with balanced (unequal) work
(docs/strategies/runtime-weighted.md)."""
DEFAULT_SPEED_SMOOTHING = 0.5
DEFAULT_QUARANTINE_AFTER = 3
DEFAULT_QUARANTINE_ROUNDS = 5

PATIENT_PERCENTILE = 80.0
"""The two-speed deadline's patient percentile (see
:func:`flowerbed.strategies.durations.two_speed_percentile`)."""
FAST_PERCENTILE = 30.0
"""The two-speed deadline's default fast percentile."""
DEFAULT_WAIT_RATIO = 5.0
"""Largest ratio of the patient to the fast percentile of recent durations at
which the two-speed deadline still waits for the patient one."""
DEFAULT_MIN_BATCH_SIZE = 4
"""Smallest batch a node sized to the deadline still trains on."""
FEDAVG_PARAMETERS = tuple(inspect.signature(FedAvg).parameters)
"""Flower ``FedAvg``'s arguments, in its order: a strategy passes them on."""


def _check(rules: list[tuple[bool, str]], owner: str) -> None:
    for ok, message in rules:
        if not ok:
            raise ValueError(f"{owner}: {message}")


def _positive(value: float | None) -> bool:
    return value is None or (value > 0 and math.isfinite(value))


@dataclass(frozen=True)
class WorkBalance:
    """How replies are weighted and how much work each node is given.

    Parameters
    ----------
    weighting : str (default: "fednova")
        One of ``"runtime"``, ``"throughput"``, ``"fednova"``, ``"examples"``
        (formulas in :class:`~flowerbed.strategies.RuntimeWeightedFedAvg`).
    balance_work : bool (default: False)
        Assign ``local-steps`` proportional to each node's smoothed speed.
    local_steps : int, optional (default: None)
        Base work ``L`` per node; None: ``train_config["local-steps"]``. Sent as
        ``local-steps`` when set (needed when ``balance_work`` is on).
    speed_smoothing : float (default: 0.5)
        Weight ``a`` of the newest speed measurement, in (0, 1].
    min_local_steps : int (default: 1)
        Fewest steps work balancing assigns.
    max_local_steps : int, optional (default: None)
        Most steps work balancing assigns; None means ``4 * L``.
    """

    weighting: str = DEFAULT_WEIGHTING
    balance_work: bool = False
    local_steps: int | None = None
    speed_smoothing: float = DEFAULT_SPEED_SMOOTHING
    min_local_steps: int = 1
    max_local_steps: int | None = None

    def __post_init__(self) -> None:
        if self.weighting not in WEIGHTINGS:
            raise ValueError(
                f"unknown weighting {self.weighting!r}; valid: {', '.join(WEIGHTINGS)}"
            )
        steps = self.max_local_steps
        _check(
            [
                (
                    0 < self.speed_smoothing <= 1,
                    f"speed_smoothing must be in (0, 1], got {self.speed_smoothing}",
                ),
                (
                    self.local_steps is None or self.local_steps >= 1,
                    f"local_steps must be >= 1, got {self.local_steps}",
                ),
                (
                    self.min_local_steps >= 1,
                    f"min_local_steps must be >= 1, got {self.min_local_steps}",
                ),
                (
                    steps is None or steps >= self.min_local_steps,
                    f"max_local_steps ({steps}) must be >= min_local_steps "
                    f"({self.min_local_steps})",
                ),
            ],
            "WorkBalance",
        )

    def summary_lines(self) -> list[str]:
        """This work balance in a strategy's summary (its configuration log)."""
        return [
            f"\t│\t├── Weighting: {self.weighting}",
            f"\t│\t├── Work balancing: {self.balance_work} (base local steps "
            f"{self.local_steps}, smoothing {self.speed_smoothing:.2f})",
        ]


@dataclass(frozen=True)
class Robustness:
    """Reply ceiling, bounded influence, robust aggregation and quarantine.

    Parameters
    ----------
    max_num_examples : float (default: 1e9)
        Ceiling on a reply's weight (``weighted_by_key``): a reply above it is
        rejected, naming the ceiling.
    weight_cap : float, optional (default: 2.0)
        A reply's weight counts as at most ``weight_cap`` times the median
        weight of recent replies (>= 1). None: no cap.
    clip_factor : float, optional (default: 3.0)
        An update longer than ``clip_factor`` times the median norm of recent
        updates is scaled down to that length (Sun et al. 2019). None: off.
    aggregation : str (default: "mean")
        ``"mean"`` (weighted, streaming, with the bounds above), ``"median"`` or
        ``"trimmed-mean"`` (coordinate-wise, Yin et al. 2018; O(n * model)
        memory).
    trim_fraction : float (default: 0.2)
        Share of the largest and of the smallest values ``"trimmed-mean"`` drops
        per coordinate, in [0, 0.5).
    quarantine_after : int (default: 3)
        Consecutive rejected replies that put a node in quarantine.
    quarantine_rounds : int (default: 5)
        Rounds a quarantined node sits out (0 disables quarantine).
    pull_bound : bool (default: False)
        Bound a reply's weight and update length together (its pull, weight
        times length) instead of each on its own; see
        :mod:`flowerbed.strategies.robust` and :meth:`hardened`.
    """

    max_num_examples: float = MAX_NUM_EXAMPLES
    weight_cap: float | None = DEFAULT_WEIGHT_CAP
    clip_factor: float | None = DEFAULT_CLIP_FACTOR
    aggregation: str = "mean"
    trim_fraction: float = 0.2
    quarantine_after: int = DEFAULT_QUARANTINE_AFTER
    quarantine_rounds: int = DEFAULT_QUARANTINE_ROUNDS
    pull_bound: bool = False

    def summary_lines(self) -> list[str]:
        """These settings in a strategy's summary (its configuration log)."""
        return [
            f"\t│\t├── Quarantine: after {int(self.quarantine_after)} rejected "
            f"replies, for {int(self.quarantine_rounds)} rounds",
            f"\t│\t├── Influence bound: {self.aggregation} aggregation, weight cap "
            f"{self.weight_cap}, clip factor {self.clip_factor}, num-examples "
            f"ceiling {self.max_num_examples:g}",
        ]

    @classmethod
    def hardened(cls) -> Robustness:
        """The bound for fleets with a patient attacker: each reply pulls at most
        1.5 typical replies (weight times update length, ``pull_bound``). On
        the default scenario, one node in ten sending its update reversed at
        this bound for 30 rounds cost 0.6-0.9 points where the default bound
        let it cost up to 12 (tests/test_drift_attack.py;
        docs/strategies/index.md, "Bounded influence: what is and is not
        bounded")."""
        return cls(clip_factor=1.5, pull_bound=True)

    def __post_init__(self) -> None:
        for label in ("max_num_examples", "weight_cap", "clip_factor"):
            value = getattr(self, label)
            if not _positive(value):
                raise ValueError(f"{label} must be finite and > 0, got {value}")
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(
                f"unknown aggregation {self.aggregation!r}; valid: "
                f"{', '.join(AGGREGATIONS)}"
            )
        cap = self.weight_cap
        _check(
            [
                (
                    cap is None or cap >= 1,
                    f"weight_cap must be >= 1 (or None), got {cap}",
                ),
                (
                    0 <= self.trim_fraction < 0.5,
                    f"trim_fraction must be in [0, 0.5), got {self.trim_fraction}",
                ),
                (
                    self.quarantine_after >= 1,
                    f"quarantine_after must be >= 1, got {self.quarantine_after}",
                ),
                (
                    self.quarantine_rounds >= 0,
                    f"quarantine_rounds must be >= 0, got {self.quarantine_rounds}",
                ),
            ],
            "Robustness",
        )


@dataclass(frozen=True)
class Deadlines:
    """When a synchronous round closes, and what nodes do about it.

    Formulas and sources in :class:`~flowerbed.strategies.DeadlineFedAvg` and,
    for the adaptive deadline and its pacer,
    :class:`~flowerbed.strategies.adaptive_deadline.AdaptiveDeadline`.

    Parameters
    ----------
    deadline_s : float, optional (default: None)
        Fixed deadline in clock seconds; with ``adaptive_deadline`` the first
        round's deadline. None: wait for all (FedAvg behaviour) unless adaptive.
    adaptive_deadline : bool (default: False)
        Derive each round's deadline from recent durations.
    deadline_percentile : float, optional (default: None)
        ``p``, in (0, 100], the same every round. None: two speeds with
        ``partial_work``, 80 without.
    fast_percentile : float (default: 30)
        The two-speed deadline's fast percentile, in (0, 80].
    wait_ratio : float (default: 5)
        Largest ratio of the 80th to the ``fast_percentile``-th percentile of
        recent full-work durations at which the two-speed deadline waits for
        the 80th; >= 1.
    deadline_window : int (default: 3)
        ``W``: rounds of durations the percentile looks at.
    deadline_growth : float (default: 1.5)
        Factor by which the deadline grows when fewer than ``p``% of the nodes
        finished in time; > 1.
    pacer_step : float, optional (default: None)
        Relative change of the pacing factor per adjustment, in [0, 1) (0: no
        pacing). None: 0.1 with a fixed ``deadline_percentile``, 0 with two
        speeds.
    pacer_window : int (default: 2)
        Rounds per pacing decision.
    pacing_bounds : tuple[float, float] (default: (0.5, 4.0))
        Smallest and largest pacing factor.
    progress_metric : str, optional (default: None)
        Accuracy metric the pacer follows; None looks for ``accuracy`` then
        ``eval-acc``.
    over_selection : float (default: 1.0)
        Sampling factor, >= 1 (1.3 is the customary value).
    partial_work : bool (default: False)
        Send ``deadline-s`` so nodes stop in time and report partial work.
    work_fraction : float (default: 0.8)
        Share of the deadline a node may use (``deadline-s``) until its
        lateness is known (``learn_margin``), or always without it: the rest
        is for transfers and delivery.
    learn_margin : bool (default: True)
        Learn each node's lateness (how long after its ``deadline-s`` its
        reply arrives) from replies that stopped at their deadline, and send
        ``deadline-s = D - lateness - 2% of D`` instead of ``work_fraction *
        D`` (:meth:`~flowerbed.strategies.DeadlineFedAvg.node_deadline`).
    min_batch_size : int (default: 4)
        With partial work, also send ``min-batch-size``: a node that cannot
        finish one step of its batch inside the deadline trains one step on the
        largest batch that fits, if it holds at least this many samples. 0: off.
    late_updates : bool (default: True)
        Fold replies that miss their round into later rounds (:class:`Staleness`).
    min_completion : int, optional (default: 1)
        Fewest usable replies to update the model; None means
        ``min_train_nodes``.
    evaluate_timeout_s : float, optional (default: None)
        Clock seconds federated evaluation waits for replies; None means a
        quarter of the round's deadline (``timeout`` while there is none).
    """

    deadline_s: float | None = None
    adaptive_deadline: bool = False
    deadline_percentile: float | None = None
    fast_percentile: float = FAST_PERCENTILE
    wait_ratio: float = DEFAULT_WAIT_RATIO
    deadline_window: int = 3
    deadline_growth: float = 1.5
    pacer_step: float | None = None
    pacer_window: int = 2
    pacing_bounds: tuple[float, float] = (0.5, 4.0)
    progress_metric: str | None = None
    over_selection: float = 1.0
    partial_work: bool = False
    work_fraction: float = 0.8
    learn_margin: bool = True
    min_batch_size: int = DEFAULT_MIN_BATCH_SIZE
    late_updates: bool = True
    min_completion: int | None = 1
    evaluate_timeout_s: float | None = None

    def __post_init__(self) -> None:
        p = self.deadline_percentile
        low, high = self.pacing_bounds
        _check(
            [
                (
                    self.deadline_s is None or self.deadline_s > 0,
                    "deadline_s must be > 0",
                ),
                (p is None or 0 < p <= 100, "deadline_percentile must be in (0, 100]"),
                (
                    0 < self.fast_percentile <= PATIENT_PERCENTILE,
                    f"fast_percentile must be in (0, {PATIENT_PERCENTILE:g}]",
                ),
                (self.wait_ratio >= 1, "wait_ratio must be >= 1"),
                (self.deadline_window >= 1, "deadline_window must be >= 1"),
                (self.deadline_growth > 1, "deadline_growth must be > 1"),
                (
                    self.pacer_step is None or 0 <= self.pacer_step < 1,
                    "pacer_step must be in [0, 1)",
                ),
                (self.pacer_window >= 1, "pacer_window must be >= 1"),
                (0 < low <= 1 <= high, "pacing_bounds: lo<=1<=hi"),
                (self.over_selection >= 1, "over_selection must be >= 1"),
                (0 < self.work_fraction <= 1, "work_fraction must be in (0, 1]"),
                (self.min_batch_size >= 0, "min_batch_size must be >= 0 (0: off)"),
                (
                    self.min_completion is None or self.min_completion >= 1,
                    "min_completion must be >= 1 (or None)",
                ),
                (
                    self.evaluate_timeout_s is None or self.evaluate_timeout_s > 0,
                    "evaluate_timeout_s must be > 0",
                ),
            ],
            "Deadlines",
        )


RECOMMENDED_PERCENTILE = 20.0
"""The recommended deadline's percentile of recent full-work durations."""
RECOMMENDED_DEADLINES = Deadlines(
    adaptive_deadline=True,
    deadline_percentile=RECOMMENDED_PERCENTILE,
    pacer_step=0.0,
    partial_work=True,
    work_fraction=1.0,
)
"""flowerbed's one recommended default (``strategy = "deadline"``,
:meth:`~flowerbed.strategies.DeadlineFedAvg.recommended`): an adaptive
deadline at the 20th percentile of the last rounds' full-work durations,
partial work sized to it per device with each node's lateness learnt (a node
whose lateness is not known yet may use the whole deadline; its first reply
that stops there teaches it), late updates, no pacer. Why these values:
docs/strategies/deadline.md."""


@dataclass(frozen=True)
class Staleness:
    """How an update computed on an older model counts.

    Parameters
    ----------
    max_staleness : int (default: 2 in DeadlineFedAvg, 10 in FedBuff)
        Oldest update (in rounds or model versions) still used.
    staleness_fn : str or callable (default: "polynomial", 1/sqrt(1+s))
        Discount ``s(tau)`` of a stale update; a name from
        :data:`flowerbed.strategies.staleness.STALENESS_FUNCTIONS` or a function
        of the staleness (FedBuff, Nguyen et al., AISTATS 2022, Sec. 3).
    """

    max_staleness: int = 2
    staleness_fn: str | StalenessFn = polynomial_staleness

    def __post_init__(self) -> None:
        _check([(self.max_staleness >= 0, "max_staleness must be >= 0")], "Staleness")


@dataclass(frozen=True)
class Buffering:
    """FedBuff's asynchrony (Nguyen et al., AISTATS 2022, Alg. 1).

    Parameters
    ----------
    concurrency : int, optional (default: None)
        Nodes training at once; None means twice FedAvg's sample size
        (``fraction_train`` of connected nodes, at least ``min_train_nodes``).
    buffer_size : int, optional (default: None)
        K, replies per model version; None means ``max(1, concurrency // 4)``
        (an update is then on average 4 versions old).
    server_learning_rate : float (default: 1.0)
        ``eta_g``.
    server_momentum : float (default: 0.0)
        ``beta`` of the server's momentum on the buffered update (FedAvgM, Hsu
        et al., 2019, Sec. 3, as the server optimiser of FedBuff's Alg. 1); 0 is
        plain FedBuff.
    evaluate_every : int (default: 1)
        Evaluate every this many versions.
    abandon_after : float, optional (default: 2.0)
        Give up on a task outstanding for longer than this many times the
        slowest of the last 100 completed round trips (once 10 are known): its
        slot goes to an idle node, and its reply, should it come, is ignored.
        None: wait for every task until its message expires.
    """

    concurrency: int | None = None
    buffer_size: int | None = None
    server_learning_rate: float = 1.0
    server_momentum: float = 0.0
    evaluate_every: int = 1
    abandon_after: float | None = 2.0

    def __post_init__(self) -> None:
        _check(
            [
                (
                    self.concurrency is None or self.concurrency >= 1,
                    "concurrency must be >= 1",
                ),
                (
                    self.buffer_size is None or self.buffer_size >= 1,
                    "buffer_size must be >= 1",
                ),
                (self.server_learning_rate > 0, "server_learning_rate must be > 0"),
                (
                    0 <= self.server_momentum < 1,
                    f"server_momentum must be in [0, 1), got {self.server_momentum}",
                ),
                (self.evaluate_every >= 1, "evaluate_every must be >= 1"),
                (
                    self.abandon_after is None or self.abandon_after > 1,
                    "abandon_after must be > 1 (or None: never)",
                ),
            ],
            "Buffering",
        )


def pop_fields(flat: dict[str, Any], option: Any) -> dict[str, Any]:
    """Take out of ``flat`` the settings named like a field of ``option``."""
    names = {f.name for f in fields(option)}
    return {name: flat.pop(name) for name in list(flat) if name in names}


def take_options(
    owner: str,
    flat: dict[str, Any],
    wanted: Mapping[str, tuple[Any, Any]],
) -> dict[str, Any]:
    """Each option object a constructor takes, from the object or old keywords.

    ``wanted`` maps a constructor argument (``"robustness"``) to what the caller
    passed (None: not given) and the strategy's default object. Keywords in
    ``flat`` that name a field of one of those objects (``weight_cap=3.0``) are
    taken out of ``flat`` and applied to the default with a DeprecationWarning
    naming the object to use; giving both the object and one of its fields as a
    keyword is a TypeError. What stays in ``flat`` is the caller's business.
    """
    taken: dict[str, Any] = {}
    for argument, (given, default) in wanted.items():
        old = pop_fields(flat, default)
        if not old:
            taken[argument] = default if given is None else given
            continue
        kind = type(default).__name__
        if given is not None:
            raise TypeError(
                f"{owner}() got {argument}= and its field(s) "
                f"{', '.join(sorted(old))} as keywords: put them in the {kind}"
            )
        settings = ", ".join(f"{k}={v!r}" for k, v in old.items())
        level, frame = 1, sys._getframe(0)
        while frame.f_back is not None and frame.f_code.co_filename.startswith(_HERE):
            frame, level = frame.f_back, level + 1
        warnings.warn(
            f"{owner}({', '.join(f'{k}=...' for k in old)}) is deprecated: pass "
            f"{argument}={kind}({settings}); the flat keywords go in the next "
            "release",
            DeprecationWarning,
            stacklevel=level,
        )
        taken[argument] = replace(default, **old)
    return taken


def refuse_unknown(owner: str, flat: Mapping[str, Any], valid: list[str]) -> None:
    """TypeError naming keywords no option object or parameter takes."""
    if flat:
        raise TypeError(
            f"{owner}() got unexpected keyword argument(s) {', '.join(sorted(flat))}; "
            f"valid: {', '.join(valid)}"
        )


def copy_fields(target: object, *options: object) -> None:
    """Make each option's fields attributes of ``target`` (what the strategies'
    methods and a user's subclass read: ``self.weight_cap``)."""
    for option in options:
        for f in fields(option):  # type: ignore[arg-type]
            setattr(target, f.name, getattr(option, f.name))


def option_defaults(strategy: type) -> dict[str, Any]:
    """Each option argument of ``strategy``'s constructors and its default object.

    A class declares its own option arguments in ``OPTION_DEFAULTS``, a mapping
    of the argument to its default object; a subclass that lists an argument of
    its base again gives it another default.
    """
    defaults: dict[str, Any] = {}
    for klass in reversed(strategy.__mro__):
        defaults.update(vars(klass).get("OPTION_DEFAULTS", {}))
    return defaults


def adopt_options(strategy: object, flat: dict[str, Any], **given: Any) -> None:
    """Set each option object a constructor was ``given`` on ``strategy``.

    An argument that was not given (None) takes the class's default object
    (:func:`option_defaults`), with the fields of ``flat`` keywords applied and
    deprecated (:func:`take_options`). Each object becomes the attribute named
    like its argument (``strategy.robustness``), and its fields attributes too
    (:func:`copy_fields`).
    """
    defaults = option_defaults(type(strategy))
    options = take_options(
        type(strategy).__name__,
        flat,
        {argument: (value, defaults[argument]) for argument, value in given.items()},
    )
    for argument, option in options.items():
        setattr(strategy, argument, option)
    copy_fields(strategy, *options.values())


def adopt_declared(strategy: object, kwargs: dict[str, Any]) -> None:
    """Set every option object ``strategy``'s class declares, from ``kwargs``.

    The one rule of the strategies' constructors: each argument of
    :func:`option_defaults` (``robustness=``) is taken out of ``kwargs`` and
    adopted with the flat keywords of its fields (:func:`adopt_options`). What
    then stays in ``kwargs`` must be one of Flower ``FedAvg``'s arguments, which
    the caller passes on; any other name is a TypeError listing the valid ones.
    """
    declared = option_defaults(type(strategy))
    adopt_options(
        strategy, kwargs, **{name: kwargs.pop(name, None) for name in declared}
    )
    owner = type(strategy)
    refuse_unknown(
        owner.__name__,
        {k: v for k, v in kwargs.items() if k not in FEDAVG_PARAMETERS},
        [*constructor_keywords(owner), *FEDAVG_PARAMETERS],
    )


def _passes_everything_on(init: Any) -> bool:
    """True for ``__init__(self, *args, <keyword-only>..., **kwargs)``."""
    kinds = [p.kind for p in inspect.signature(init).parameters.values()][1:]
    return (
        inspect.Parameter.VAR_POSITIONAL in kinds
        and inspect.Parameter.VAR_KEYWORD in kinds
        and inspect.Parameter.POSITIONAL_OR_KEYWORD not in kinds
    )


def declared_signature(strategy: type) -> inspect.Signature | None:
    """What ``strategy(...)`` takes, for ``help()`` and ``inspect.signature``.

    The constructors of the strategies that adopt their options with
    :func:`adopt_declared` take ``(*args, **kwargs)``; their signature is Flower
    ``FedAvg``'s arguments, then the keyword-only arguments of their own
    constructors and each option argument with its default object. None (so
    that ``inspect`` reads the constructor itself) for a subclass with a
    constructor of its own that names its arguments.
    """
    init = vars(strategy).get("__init__")
    if init is not None and not _passes_everything_on(init):
        return None
    params = list(inspect.signature(FedAvg).parameters.values())
    seen = {p.name for p in params}
    for klass in strategy.__mro__:
        own = vars(klass).get("__init__")
        if own is None:
            continue
        if not _passes_everything_on(own):
            break
        for p in inspect.signature(own).parameters.values():
            if p.kind is inspect.Parameter.KEYWORD_ONLY and p.name not in seen:
                params.append(p)
                seen.add(p.name)
    for name, default in option_defaults(strategy).items():
        if name not in seen:
            params.append(
                inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default)
            )
            seen.add(name)
    return inspect.Signature(params)


def group_settings(strategy: type, settings: dict[str, Any]) -> dict[str, Any]:
    """``settings`` with the fields of ``strategy``'s option objects grouped.

    Each name goes to the option object that has a field of that name, starting
    from the strategy's default object; other names pass through.
    """
    for argument, default in option_defaults(strategy).items():
        mine = pop_fields(settings, default)
        if mine:
            settings[argument] = replace(default, **mine)
    return settings


def constructor_keywords(strategy: type) -> list[str]:
    """The keyword-only and option arguments of ``strategy``'s constructors (for
    the message that refuses an unknown one)."""
    names = list(option_defaults(strategy))
    for klass in strategy.__mro__:
        code = getattr(klass.__dict__.get("__init__"), "__code__", None)
        if code is None:
            continue
        start = code.co_argcount
        names += code.co_varnames[start : start + code.co_kwonlyargcount]
    return sorted(set(names))
