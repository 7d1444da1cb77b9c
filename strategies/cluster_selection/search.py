"""The search over cluster configurations, and how sure its choice is.


Search (:func:`select`): exhaustive over all subsets up to
:data:`EXHAUSTIVE_MAX_NODES` nodes; beyond that :func:`prefix_masks`. For
synchronous rounds it keeps, for each ``k``, the ``k`` nodes with the smallest
``mu_i + z sd_i`` (``z`` in :data:`PREFIX_QUANTILES`). This is exact for
``time`` and ``time-to-accuracy`` when the members' task times for that ``k``
are stochastically ordered as their means (no jitter, or equal ``sd_i``): the
maximum is increasing in each member, so swapping in a stochastically smaller
node never raises its expectation (Shaked and Shanthikumar, "Stochastic
Orders", Springer 2007, Theorem 1.A.3). With unequal ``sd_i`` it is a
heuristic. For asynchronous rounds it scans the prefixes of the nodes sorted by
throughput ``1/t_i`` (mean task times): exact for ``time`` and
``time-to-accuracy``, which depend on the members only through ``k`` and the
summed rate, and for each ``k`` the ``k`` fastest have the largest rate. For
``energy`` and ``edp`` (sums over members, not a max) the prefixes of these
orders and of energy per task are a heuristic.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .model import (
    Estimate,
    NodeModel,
    Workload,
    _arrays,
    _pick,
    _variances,
    check_objective,
    estimate_batch,
    estimate_masks,
)

EXHAUSTIVE_MAX_NODES = 12
"""Largest fleet searched exhaustively by default (4,095 configurations)."""
EXHAUSTIVE_LIMIT = 20
"""Largest fleet that may be searched exhaustively at all (about a million)."""


def all_masks(num_nodes: int, min_size: int = 1) -> np.ndarray:
    """Every subset of ``num_nodes`` nodes with at least ``min_size`` members."""
    if num_nodes > EXHAUSTIVE_LIMIT:
        raise ValueError(
            f"{num_nodes} nodes is too many to search exhaustively (at most "
            f"{EXHAUSTIVE_LIMIT}); use the polynomial search"
        )
    codes = np.arange(1, 2**num_nodes)
    masks = (codes[:, None] >> np.arange(num_nodes)[None, :]) & 1
    masks = masks.astype(bool)
    return masks[masks.sum(axis=1) >= min_size]


PREFIX_QUANTILES = (0.0, 1.0, 2.0, 3.0)
"""Sync polynomial search: for each ``k``, also the ``k`` nodes with the smallest
``mu_i + z sd_i`` for these ``z`` (exact when task times are stochastically
ordered as their means; see the module docstring)."""


def prefix_masks(
    nodes: Sequence[NodeModel], workload: Workload, min_size: int = 1
) -> np.ndarray:
    """The candidates of the polynomial search (see the module docstring).

    O(n) orders of n nodes, n prefixes each: O(n^2 log n) to build, O(n^3) to
    evaluate.
    """
    s, c, pb, pi = _arrays(nodes)
    v, u = _variances(nodes)
    n = len(nodes)
    rows = []
    if workload.mode == "sync":
        for k in range(min_size, n + 1):
            compute = workload.member_steps(k) * s
            t = c + compute
            sd = np.sqrt(u + workload.member_steps(k) * v)
            energy = np.nan_to_num(pb * compute + pi * c, nan=0.0)
            quantiles = [t + z * sd for z in PREFIX_QUANTILES]
            for key in (*quantiles, energy):
                mask = np.zeros(n, dtype=bool)
                mask[np.argsort(key, kind="stable")[:k]] = True
                rows.append(mask)
    else:
        t = c + workload.steps * s
        energy_per_task = np.nan_to_num(pb * workload.steps * s + pi * c, nan=0.0)
        for key in (t, energy_per_task):
            order = np.argsort(key, kind="stable")
            for k in range(min_size, n + 1):
                mask = np.zeros(n, dtype=bool)
                mask[order[:k]] = True
                rows.append(mask)
    return np.unique(np.array(rows), axis=0)


def search_masks(
    nodes: Sequence[NodeModel],
    workload: Workload,
    min_size: int = 1,
    search: str = "auto",
    *,
    exhaustive_max_nodes: int = EXHAUSTIVE_MAX_NODES,
) -> np.ndarray:
    """The configurations ``search`` considers (see :func:`select`)."""
    exhaustive = search == "exhaustive" or (
        search == "auto" and len(nodes) <= exhaustive_max_nodes
    )
    if exhaustive:
        return all_masks(len(nodes), min_size)
    return prefix_masks(nodes, workload, min_size)


def select(
    nodes: Sequence[NodeModel],
    workload: Workload,
    objective: str,
    *,
    min_size: int = 1,
    search: str = "auto",
    exhaustive_max_nodes: int = EXHAUSTIVE_MAX_NODES,
) -> Estimate:
    """The configuration with the lowest estimate for ``objective``.

    ``search`` is ``"exhaustive"``, ``"polynomial"`` or ``"auto"`` (exhaustive up to
    ``exhaustive_max_nodes`` nodes).
    """
    check_objective(objective)
    searches = ("auto", "exhaustive", "polynomial")
    if search not in searches:
        raise ValueError(
            f"unknown search {search!r}; valid choices: {', '.join(searches)}"
        )
    if not 1 <= min_size <= len(nodes):
        raise ValueError(
            f"need at least {min_size} node(s) to choose from, have {len(nodes)}"
        )
    if objective in ("energy", "edp"):
        unknown = [n.node_id for n in nodes if n.busy_w is None or n.idle_w is None]
        if unknown:
            raise ValueError(
                f"objective {objective!r} needs each node's power, but nodes "
                f"{unknown} reported neither power-w nor energy-j; choose "
                "'time' or 'time-to-accuracy'"
            )
    masks = search_masks(
        nodes, workload, min_size, search, exhaustive_max_nodes=exhaustive_max_nodes
    )
    est = estimate_masks(nodes, masks, workload)
    return _pick(nodes, masks, est, int(np.argmin(est[objective])))


CONFIDENCE_DRAWS = 100
"""Parameter draws behind :func:`confidence`."""
CONFIDENCE_CANDIDATES = 12
"""Leading configurations (by point estimate) that :func:`confidence` compares."""
RIVAL_SHARE = 0.05
"""A configuration that is best in at least this share of draws is a rival."""


@dataclass(frozen=True)
class Confidence:
    """How sure the estimate is that its choice beats the other leading ones.

    ``probability``: share of parameter draws in which the chosen configuration
    has the lowest estimate among the ``candidates`` leading configurations;
    ``runner_up`` and ``gap`` (``(runner-up - chosen) / chosen``, point
    estimates) name the closest alternative; ``gap_sd`` is that gap's standard
    deviation over the draws; ``rivals`` are the other configurations that are
    best in at least :data:`RIVAL_SHARE` of the draws.
    """

    probability: float
    runner_up: tuple[int, ...] | None
    gap: float
    gap_sd: float
    rivals: tuple[tuple[int, ...], ...]
    candidates: int
    near_probability: float = 1.0
    """Share of draws in which the choice is within ``indifference`` of the
    lowest (equal to ``probability`` when ``indifference`` is 0)."""
    chosen: tuple[int, ...] = ()
    """The configuration the figures are about: the lowest point estimate."""

    @property
    def within_uncertainty(self) -> bool:
        """True when the runner-up is closer than two standard deviations."""
        return self.runner_up is not None and self.gap < 2 * self.gap_sd


def _draw_arrays(
    nodes: Sequence[NodeModel],
    rng: np.random.Generator,
    power_gain_error: float,
    draws: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``draws`` x nodes arrays of ``s_i``, ``c_i``, ``Pb_i``, ``Pi_i`` as
    :func:`confidence` draws them (NaN power: unknown). Five standard normals per
    node and draw, in node order within a draw: (step, overhead, gain, busy, idle).
    """
    z = rng.standard_normal((draws, len(nodes), 5))
    step = np.array([m.step_s for m in nodes])
    step_se = np.array([m.step_se for m in nodes])
    over = np.array([m.overhead_s for m in nodes])
    over_se = np.array([m.overhead_se for m in nodes])
    nan = float("nan")
    busy = np.array([nan if m.busy_w is None else m.busy_w for m in nodes])
    idle = np.array([nan if m.idle_w is None else m.idle_w for m in nodes])
    var_b, cov, var_i = np.array([m.power_cov for m in nodes]).reshape(-1, 3).T
    gain = np.maximum(0.0, 1.0 + power_gain_error * z[:, :, 2])
    # (z_b, z_i) -> correlated (busy, idle) errors by Cholesky factors, where the
    # node has both powers and a busy-power variance
    spread = ~np.isnan(busy) & ~np.isnan(idle) & (var_b > 0)
    sd_b = np.sqrt(np.where(spread, var_b, 1.0))
    rest = np.sqrt(np.maximum(var_i - cov**2 / sd_b**2, 0.0))
    busy_d = np.where(spread, np.maximum(busy + sd_b * z[:, :, 3], 0.0), busy)
    idle_d = np.where(
        spread,
        np.maximum(idle + cov / sd_b * z[:, :, 3] + rest * z[:, :, 4], 0.0),
        idle,
    )
    return (
        np.maximum(step + step_se * z[:, :, 0], 1e-12),
        np.maximum(over + over_se * z[:, :, 1], 0.0),
        busy_d * gain,
        idle_d * gain,
    )


def confidence(
    nodes: Sequence[NodeModel],
    workload: Workload,
    objectives: str | Sequence[str],
    masks: np.ndarray,
    *,
    power_gain_error: float = 0.0,
    draws: int = CONFIDENCE_DRAWS,
    candidates: int = CONFIDENCE_CANDIDATES,
    seed: int = 0,
    indifference: float = 0.0,
    point: dict[str, np.ndarray] | None = None,
) -> dict[str, Confidence]:
    """Per objective, confidence that the lowest estimate among ``masks`` is best.

    A parametric bootstrap (Efron and Tibshirani, "An Introduction to the
    Bootstrap", Chapman & Hall 1993, ch. 6): each draw replaces every node's
    ``s_i`` and ``c_i`` by ``Normal(fit, se^2)`` (standard errors from
    :func:`fit_node`) and scales its power by ``1 + power_gain_error z``
    (a sensor's calibration error, which more samples do not shrink; an input,
    because profiling cannot see it), then re-estimates, for each objective,
    the ``candidates`` configurations with the lowest point estimates. The
    draws are seeded (``seed``) and shared by the objectives.

    ``near_probability`` is the share of draws in which the choice is within
    ``indifference`` (relative) of the lowest: Bechhofer's indifference zone
    (Bechhofer, "A Single-Sample Multiple Decision Procedure for Ranking Means
    of Normal Populations with known Variances", Annals of Mathematical
    Statistics 25(1), 1954): configurations closer than that are equally good
    for the job, and no amount of profiling need tell them apart.

    ``point`` is :func:`estimate_masks` of ``nodes`` over ``masks`` when the
    caller already has it (it is the costly part for a large search).
    """
    names = [objectives] if isinstance(objectives, str) else list(objectives)
    for name in names:
        check_objective(name)
    masks = np.asarray(masks, dtype=bool)
    if point is None:
        point = estimate_masks(nodes, masks, workload)
    orders = {o: np.argsort(point[o], kind="stable")[:candidates] for o in names}
    rows = np.unique(np.concatenate(list(orders.values())))
    lead = masks[rows]
    rng = np.random.default_rng(seed)
    step_var = np.array([n.step_var for n in nodes])
    overhead_var = np.array([n.overhead_var for n in nodes])
    drawn = estimate_batch(
        *_draw_arrays(nodes, rng, power_gain_error, draws),
        step_var,
        overhead_var,
        lead,
        workload,
    )
    out = {}
    for o, order in orders.items():
        members = [
            tuple(n.node_id for n, m in zip(nodes, masks[r], strict=True) if m)
            for r in order
        ]
        if len(order) == 1:
            out[o] = Confidence(1.0, None, math.inf, 0.0, (), 1, chosen=members[0])
            continue
        cols = np.searchsorted(rows, order)
        values = drawn[o][:, cols]
        wins = np.bincount(values.argmin(axis=1), minlength=len(order)) / draws
        gaps = values[:, 1] / values[:, 0] - 1.0
        out[o] = Confidence(
            probability=float(wins[0]),
            runner_up=members[1],
            gap=float(point[o][order[1]] / point[o][order[0]] - 1.0),
            gap_sd=float(gaps.std(ddof=1)),
            rivals=tuple(
                members[i] for i in range(1, len(order)) if wins[i] >= RIVAL_SHARE
            ),
            candidates=len(order),
            near_probability=float(
                np.mean(values[:, 0] <= (1.0 + indifference) * values.min(axis=1))
            ),
            chosen=members[0],
        )
    return out
