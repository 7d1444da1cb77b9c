"""Cost models and search for cluster-configuration selection.

Gu, Kong, Munir, Kim, "A Framework for Distributed Deep Learning Training with
Heterogeneous Computing Platforms", 2019 (MISSION.md, S4) profile each device for a
few steps, fit a model of its time and power, estimate time, energy and
energy-delay product (EDP) of every candidate configuration (a subset of the
devices) and train on the best one. This module holds that arithmetic, without any
Flower machinery, so the strategy (:mod:`flowerbed.strategies.cluster_selection`)
and the evaluation (:mod:`flowerbed.strategies.selection_eval`) share it.

Per node ``i`` (fitted from profiling, :func:`fit_node`):

    s_i  seconds per optimiser step        c_i  seconds per task outside compute
    Pb_i watts while training              Pi_i watts otherwise (communicating, idle)

Synchronous rounds (FedAvg and kin). The job is ``R`` rounds; a round's work of
``W`` optimiser steps is split evenly over the ``k = |S|`` members (Gu et al. split
a fixed training job across the configuration's devices), and the slowest member
sets the pace (FedScale, ``client_metadata.py``: time = compute + bytes/bandwidth)::

    n_k       = ceil(W / k)                                   steps per member
    t_i       ~ Normal(c_i + n_k s_i, u_i + n_k v_i)          member i's task
    T_round   = E[max_{i in S} t_i]                           (:func:`expected_max`)
    E_round   = sum_{i in S} [ Pb_i n_k s_i + Pi_i (T_round - n_k s_i) ]
    time      = R T_round,    energy = R E_round,    EDP = time x energy

Asynchronous buffered rounds (FedBuff, Nguyen et al., AISTATS 2022): every member
trains continuously, each task of ``L`` steps; the job is ``R`` model versions of
``K`` replies. Throughputs add up::

    t_i    = c_i + L s_i,      rate = sum_{i in S} 1 / t_i      (tasks per second)
    time   = R K / rate          (K = max(1, k // 2) unless set: FedBuff's default)
    energy = time x sum_{i in S} (Pb_i L s_i + Pi_i c_i) / t_i

Time to accuracy. More members per round see more (and more varied) data per
round, so fewer rounds reach the target. Li, Huang, Yang, Wang, Zhang, "On the
Convergence of FedAvg on Non-IID Data", ICLR 2020, Theorem 3: with ``k`` nodes
sampled per round, the bound on the rounds to reach accuracy eps is proportional
to ``B + C``, where ``C = 4 E^2 G^2 / k`` is the partial-participation variance
term. Writing ``C = B kappa / k`` gives rounds = R (1 + kappa / k), ``R`` the
rounds with every update averaged over infinitely many nodes and ``kappa`` the
weight of the participation term (a property of the data and model; fit it from
runs at two fleet sizes)::

    time_to_accuracy = time x (1 + kappa / k)

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
from typing import Any

import numpy as np
from scipy import special

OBJECTIVES = ("time", "energy", "edp", "time-to-accuracy")
"""What a configuration is chosen for."""
MODES = ("sync", "async")
"""Synchronous rounds (slowest member sets the pace) or FedBuff (throughputs add)."""
EXHAUSTIVE_MAX_NODES = 12
"""Largest fleet searched exhaustively by default (4,095 configurations)."""
EXHAUSTIVE_LIMIT = 20
"""Largest fleet that may be searched exhaustively at all (about a million)."""
IDLE_FRACTION = 0.4
"""Idle / busy power when a node reports only its busy power: the median ratio of
the device catalogue (``flowerbed.sims.devices``: Pi 4B 2.7/6.4 = 0.42, Pi 5
2.7/7.0 = 0.39, low-end phone 0.40, Galaxy S10 0.20, Jetson Nano 0.19)."""


@dataclass(frozen=True)
class NodeModel:
    """What a node costs, fitted from profiling (see the module docstring)."""

    node_id: int
    step_s: float
    """``s_i``: seconds per optimiser step."""
    overhead_s: float
    """``c_i``: seconds per task outside compute (model down and up, start-up)."""
    busy_w: float | None = None
    """``Pb_i``: watts while training; None when the node reports no power."""
    idle_w: float | None = None
    """``Pi_i``: watts while communicating or waiting."""
    step_var: float = 0.0
    """``v_i``: variance of one step's time (s^2); a task of ``n`` steps has
    compute variance ``n v_i`` (independent steps)."""
    overhead_var: float = 0.0
    """``u_i``: variance of the per-task overhead (s^2)."""
    step_se: float = 0.0
    """Standard error of ``s_i`` (seconds per step)."""
    overhead_se: float = 0.0
    """Standard error of ``c_i`` (seconds)."""
    tasks: int = 0
    """Profiling tasks the fit used."""

    def task_mean_sd(self, steps: int | np.ndarray) -> tuple[Any, Any]:
        """Mean and standard deviation of a task of ``steps`` steps.

        ``mu = c_i + n s_i``, ``sd = sqrt(u_i + n v_i)`` (overhead and steps
        independent).
        """
        return (
            self.overhead_s + steps * self.step_s,
            np.sqrt(self.overhead_var + steps * self.step_var),
        )


@dataclass(frozen=True)
class Observation:
    """One profiling or training task as the server saw it.

    ``round_trip_s`` is dispatch to reply on the grid's clock; the others are the
    reply's ``num-steps``, ``train-time-s``, ``comm-time-s``, ``energy-j`` and
    ``power-w`` (None when absent). ``transfers`` is how many times the model
    travelled (2 for a training task, 1 for a profiling query that returns no
    model).
    """

    steps: int
    round_trip_s: float
    train_time_s: float | None = None
    comm_time_s: float | None = None
    energy_j: float | None = None
    power_w: float | None = None
    transfers: int = 2


@dataclass(frozen=True)
class Workload:
    """The job a configuration is estimated for.

    Parameters
    ----------
    mode : str
        ``"sync"`` or ``"async"``.
    steps : int
        sync: optimiser steps per round, split over the members (``W``);
        async: steps per task (``L``).
    num_rounds : int
        ``R``: rounds (sync) or model versions (async) of the job.
    buffer_size : int or None
        ``K``: replies per model version (async only); None means FedBuff's
        default with every member training, ``max(1, k // 2)``.
    kappa : float
        Weight of the participation term in the rounds to accuracy.
    """

    mode: str = "sync"
    steps: int = 10
    num_rounds: int = 10
    buffer_size: int | None = None
    kappa: float = 1.0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(
                f"unknown mode {self.mode!r}; valid choices: {', '.join(MODES)}"
            )
        if min(self.steps, self.num_rounds, self.buffer_size or 1) < 1:
            raise ValueError(
                "steps, num_rounds and buffer_size must be >= 1, got "
                f"{self.steps}, {self.num_rounds}, {self.buffer_size}"
            )
        if self.kappa < 0:
            raise ValueError(f"kappa must be >= 0, got {self.kappa}")

    def member_steps(self, k: int) -> int:
        """Steps each of ``k`` members takes per task: ``ceil(W / k)`` in sync."""
        return math.ceil(self.steps / k) if self.mode == "sync" else self.steps


@dataclass(frozen=True)
class Estimate:
    """Estimated cost of one configuration."""

    members: tuple[int, ...]
    round_s: float
    """sync: ``T_round``; async: mean seconds between replies (``1 / rate``)."""
    time_s: float
    energy_j: float
    edp: float
    time_to_accuracy_s: float

    def value(self, objective: str) -> float:
        """The estimate's figure for ``objective`` (one of :data:`OBJECTIVES`)."""
        check_objective(objective)
        return {
            "time": self.time_s,
            "energy": self.energy_j,
            "edp": self.edp,
            "time-to-accuracy": self.time_to_accuracy_s,
        }[objective]


def check_objective(objective: str) -> None:
    if objective not in OBJECTIVES:
        raise ValueError(
            f"unknown objective {objective!r}; valid choices: {', '.join(OBJECTIVES)}"
        )


def fit_node(
    node_id: int,
    observations: Sequence[Observation],
    idle_fraction: float = IDLE_FRACTION,
) -> NodeModel:
    """Fit ``s_i``, ``c_i``, their variances, ``Pb_i``, ``Pi_i`` from timed tasks.

    Task ``j`` took ``n_j`` steps in ``x_j`` seconds of compute and ``o_j``
    seconds outside it over ``r_j`` model transfers (2 for a training task, 1
    for a query). Steps are independent with mean ``s`` and variance ``v``, so
    ``E x_j = n_j s`` and ``Var x_j = n_j v``; the best linear unbiased
    estimator is weighted least squares with weights ``1 / n_j``, and its
    weighted residual sum of squares over ``J - 1`` degrees of freedom is
    unbiased for ``v`` (Aitken's generalised least squares; Seber and Lee,
    "Linear Regression Analysis", 2nd ed., Wiley 2003, ch. 3)::

        s = sum x_j / sum n_j
        v = sum (x_j - n_j s)^2 / n_j / (J - 1),       se(s) = sqrt(v / sum n_j)

    Transfers are treated the same way (mean ``m``, variance ``w`` each; a
    training task's overhead is two of them), which for training tasks alone
    is the sample mean and the sample variance (``ddof = 1``) of ``o_j``::

        m = sum o_j / sum r_j,     w = sum (o_j - r_j m)^2 / r_j / (J - 1)
        c = 2 m,   u = 2 w,        se(c) = 2 sqrt(w / sum r_j)

    When there are training tasks, ``c``, ``u`` and ``se(c)`` come from them
    alone: a query's one transfer (the download) says nothing about the upload,
    which on a phone is the slower link. With one task the variances are
    unknown and set to 0. ``x_j`` is
    ``train-time-s``; without it (a plain Flower client) ``s`` and ``c`` are
    the ordinary least-squares slope and intercept of round trip against steps
    (needs tasks of at least two lengths), all of the residual variance
    (``J - 2`` degrees of freedom) is put on ``u``, and ``v = 0``. ``o_j`` is
    ``comm-time-s`` when reported, else round trip minus compute.

    Power: the mean ``power-w`` as ``Pb_i`` when reported (``Pi_i`` =
    ``idle_fraction`` x ``Pb_i``, see :data:`IDLE_FRACTION`); else from
    ``energy-j`` = Pb compute + Pi other, by least squares over the tasks (two
    unknowns: needs tasks of two lengths; with one length, ``Pi`` =
    ``idle_fraction`` x ``Pb``).
    """
    if not observations:
        raise ValueError(f"node {node_id}: no profiling observation to fit")
    steps = np.array([o.steps for o in observations], dtype=float)
    rtt = np.array([o.round_trip_s for o in observations])
    transfers = np.array([o.transfers for o in observations], dtype=float)
    if np.any(steps < 1):
        raise ValueError(f"node {node_id}: a profiling task took no step")
    count = len(observations)
    train = [o.train_time_s for o in observations]
    timed = all(t is not None for t in train)
    if timed:
        compute = np.array(train, dtype=float)
        step_s = float(compute.sum() / steps.sum())
        step_var = (
            float(((compute - steps * step_s) ** 2 / steps).sum() / (count - 1))
            if count > 1
            else 0.0
        )
        step_se = math.sqrt(step_var / steps.sum())
    elif len(set(steps)) >= 2:
        slope, _ = np.polyfit(steps, rtt, 1)
        step_s = float(slope)
        compute = steps * step_s
        step_var = 0.0
        step_se = 0.0
    else:
        raise ValueError(
            f"node {node_id}: without train-time-s, profiling needs tasks of two "
            "lengths (profile_steps with two different values)"
        )
    other = np.array(
        [
            o.comm_time_s if o.comm_time_s is not None else r - c
            for o, r, c in zip(observations, rtt, compute, strict=True)
        ]
    )
    if timed and transfers.max() == 2 and transfers.min() < 2:
        both = transfers == 2
        other, transfers, count = other[both], transfers[both], int(both.sum())
    per_transfer = float(other.sum() / transfers.sum())
    overhead_s = max(0.0, 2 * per_transfer)
    if timed:
        transfer_var = (
            float(((other - transfers * per_transfer) ** 2 / transfers).sum())
            / (count - 1)
            if count > 1
            else 0.0
        )
        overhead_var = 2 * transfer_var
        overhead_se = 2 * math.sqrt(transfer_var / transfers.sum())
    else:
        residual = rtt - compute - overhead_s
        overhead_var = float((residual**2).sum() / (count - 2)) if count > 2 else 0.0
        overhead_se = math.sqrt(overhead_var / count)
        spread = float(((steps - steps.mean()) ** 2).sum())
        step_se = math.sqrt(overhead_var / spread)
    busy_w = idle_w = None
    powers = [o.power_w for o in observations if o.power_w is not None]
    energies = [o.energy_j for o in observations]
    if powers:
        busy_w = float(np.mean(powers))
        idle_w = idle_fraction * busy_w
    elif all(e is not None for e in energies):
        energy = np.array(energies, dtype=float)
        actual_other = np.maximum(rtt - compute, 0.0)
        if len(set(steps)) >= 2:
            a = np.column_stack([compute, actual_other])
            (busy_w, idle_w), *_ = np.linalg.lstsq(a, energy, rcond=None)
            busy_w, idle_w = float(max(busy_w, 0.0)), float(max(idle_w, 0.0))
        else:
            busy_w = float(
                energy.sum() / (compute.sum() + idle_fraction * actual_other.sum())
            )
            idle_w = idle_fraction * busy_w
    return NodeModel(
        node_id,
        max(step_s, 1e-12),
        overhead_s,
        busy_w,
        idle_w,
        step_var=step_var,
        overhead_var=overhead_var,
        step_se=step_se,
        overhead_se=overhead_se,
        tasks=len(observations),
    )


def _arrays(
    nodes: Sequence[NodeModel],
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    s = np.array([n.step_s for n in nodes])
    c = np.array([n.overhead_s for n in nodes])
    nan = float("nan")
    pb = np.array([nan if n.busy_w is None else n.busy_w for n in nodes])
    pi = np.array([nan if n.idle_w is None else n.idle_w for n in nodes])
    return s, c, pb, pi


def _variances(nodes: Sequence[NodeModel]) -> tuple[np.ndarray, np.ndarray]:
    v = np.array([n.step_var for n in nodes])
    u = np.array([n.overhead_var for n in nodes])
    return v, u


def expected_max(mu: np.ndarray, sd: np.ndarray, masks: np.ndarray) -> np.ndarray:
    """``E[max_{i in S} t_i]`` for each configuration ``S`` (a row of ``masks``).

    ``t_i ~ Normal(mu_i, sd_i^2)``, independent. The maximum of independent,
    non-identically distributed variables has CDF ``prod_{i in S} F_i(x)``
    (David and Nagaraja, "Order Statistics", 3rd ed., Wiley 2003, sec. 5.2), and
    for a variable that is (up to ``Phi(-6)`` ~ 1e-9) at least ``a``,
    ``E[X] = a + int_a^inf (1 - F(x)) dx``::

        E[T_round] = a + int_a^b (1 - prod_{i in S} Phi((x - mu_i) / sd_i)) dx
        a = min_i (mu_i - 6 sd_i),   b = max_i (mu_i + 6 sd_i)

    integrated by the trapezoidal rule on the points ``mu_i + q sd_i``, ``q`` in
    steps of 1/3 from -6 to 6, for every node (so each CDF is resolved on its
    own scale, and a configuration's figure does not depend on the others
    estimated with it). ``sd_i`` is floored at ``1e-6 mu_i`` so that a deterministic
    node is a (resolved) step. With every ``sd_i = 0`` this is ``max_i mu_i``.
    The rule's error is below 5e-4 of the members' ``sd`` in the tests, far
    below what profiling can resolve.
    Hand checks: two identical members give ``mu + sd / sqrt(pi)``, three give
    ``mu + 1.5 sd / sqrt(pi)`` (the expected largest of 2 and 3 standard
    normals, 0.5642 and 0.8463).
    """
    masks = np.asarray(masks, dtype=bool)
    mu = np.asarray(mu, dtype=float)
    sd = np.maximum(np.asarray(sd, dtype=float), 1e-6 * np.abs(mu) + 1e-300)
    q = np.linspace(-6.0, 6.0, 37)
    x = np.unique((mu[:, None] + sd[:, None] * q[None, :]).ravel())
    used = masks.any(axis=0)
    z = (x[None, :] - mu[used, None]) / sd[used, None]
    log_cdf = np.maximum(special.log_ndtr(z), -1e4)
    below = 1.0 - np.exp(masks[:, used].astype(float) @ log_cdf)
    return x[0] + np.trapezoid(below, x, axis=1)


def estimate_masks(
    nodes: Sequence[NodeModel], masks: np.ndarray, workload: Workload
) -> dict[str, np.ndarray]:
    """Estimates for many configurations at once (formulas: module docstring).

    ``masks`` is a boolean array (configurations x nodes). Returns arrays
    ``round_s``, ``time``, ``energy``, ``edp``, ``time-to-accuracy`` (energy is NaN
    when a member's power is unknown).
    """
    masks = np.asarray(masks, dtype=bool)
    s, c, pb, pi = _arrays(nodes)
    k = masks.sum(axis=1)
    if np.any(k == 0):
        raise ValueError("a configuration needs at least one node")
    w = workload
    if w.mode == "sync":
        v, u = _variances(nodes)
        steps = np.ceil(w.steps / k)[:, None]
        compute = steps * s[None, :]
        round_s = np.zeros(len(masks))
        for size in np.unique(k):
            rows = k == size
            n = w.member_steps(int(size))
            round_s[rows] = expected_max(c + n * s, np.sqrt(u + n * v), masks[rows])
        per_node = pb * compute + pi * (round_s[:, None] - compute)
        energy_round = np.where(masks, per_node, 0.0).sum(axis=1)
        time = w.num_rounds * round_s
        energy = w.num_rounds * energy_round
    else:
        t = c + w.steps * s
        rate = np.where(masks, 1.0 / t, 0.0).sum(axis=1)
        round_s = 1.0 / rate
        buffer = w.buffer_size if w.buffer_size else np.maximum(1, k // 2)
        time = w.num_rounds * buffer * round_s
        power = (pb * w.steps * s + pi * c) / t
        energy = time * np.where(masks, power, 0.0).sum(axis=1)
    return {
        "round_s": round_s,
        "time": time,
        "energy": energy,
        "edp": time * energy,
        "time-to-accuracy": time * (1.0 + w.kappa / k),
    }


def estimate(
    nodes: Sequence[NodeModel], members: Sequence[int], workload: Workload
) -> Estimate:
    """Estimate of one configuration, ``members`` being node ids of ``nodes``."""
    ids = [n.node_id for n in nodes]
    unknown = set(members) - set(ids)
    if unknown:
        raise ValueError(f"nodes {sorted(unknown)} have no model; known: {ids}")
    mask = np.array([[i in set(members) for i in ids]])
    return _pick(nodes, mask, estimate_masks(nodes, mask, workload), 0)


def _pick(
    nodes: Sequence[NodeModel], masks: np.ndarray, est: dict[str, np.ndarray], row: int
) -> Estimate:
    members = tuple(n.node_id for n, m in zip(nodes, masks[row], strict=True) if m)
    return Estimate(
        members=members,
        round_s=float(est["round_s"][row]),
        time_s=float(est["time"][row]),
        energy_j=float(est["energy"][row]),
        edp=float(est["edp"][row]),
        time_to_accuracy_s=float(est["time-to-accuracy"][row]),
    )


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

    @property
    def within_uncertainty(self) -> bool:
        """True when the runner-up is closer than two standard deviations."""
        return self.runner_up is not None and self.gap < 2 * self.gap_sd


def _draw_nodes(
    nodes: Sequence[NodeModel], rng: np.random.Generator, power_gain_error: float
) -> list[NodeModel]:
    out = []
    for m in nodes:
        z_s, z_c, z_p = rng.standard_normal(3)
        gain = max(0.0, 1.0 + power_gain_error * z_p)
        out.append(
            NodeModel(
                m.node_id,
                max(m.step_s + m.step_se * z_s, 1e-12),
                max(m.overhead_s + m.overhead_se * z_c, 0.0),
                None if m.busy_w is None else m.busy_w * gain,
                None if m.idle_w is None else m.idle_w * gain,
                step_var=m.step_var,
                overhead_var=m.overhead_var,
            )
        )
    return out


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
    """
    names = [objectives] if isinstance(objectives, str) else list(objectives)
    for name in names:
        check_objective(name)
    masks = np.asarray(masks, dtype=bool)
    point = estimate_masks(nodes, masks, workload)
    orders = {o: np.argsort(point[o], kind="stable")[:candidates] for o in names}
    rows = np.unique(np.concatenate(list(orders.values())))
    lead = masks[rows]
    rng = np.random.default_rng(seed)
    drawn = [
        estimate_masks(_draw_nodes(nodes, rng, power_gain_error), lead, workload)
        for _ in range(draws)
    ]
    out = {}
    for o, order in orders.items():
        if len(order) == 1:
            out[o] = Confidence(1.0, None, math.inf, 0.0, (), 1)
            continue
        cols = np.searchsorted(rows, order)
        values = np.array([d[o][cols] for d in drawn])
        wins = np.bincount(values.argmin(axis=1), minlength=len(order)) / draws
        gaps = values[:, 1] / values[:, 0] - 1.0
        members = [
            tuple(n.node_id for n, m in zip(nodes, masks[r], strict=True) if m)
            for r in order
        ]
        out[o] = Confidence(
            probability=float(wins[0]),
            runner_up=members[1],
            gap=float(point[o][order[1]] / point[o][order[0]] - 1.0),
            gap_sd=float(gaps.std(ddof=1)),
            rivals=tuple(
                members[i] for i in range(1, len(order)) if wins[i] >= RIVAL_SHARE
            ),
            candidates=len(order),
        )
    return out


def expected_round_trip(observations: Sequence[Observation], steps: int) -> float:
    """Expected round trip of a task of ``steps`` steps from a node's tasks so far.

    ``s`` = sum of ``train-time-s`` / sum of steps (as :func:`fit_node`; the
    round trip stands in for a task without ``train-time-s``), then the mean
    round trip outside compute plus ``steps x s``. Adaptive profiling uses it
    to project when the slowest node will be done; no observation gives inf.
    """
    if not observations:
        return math.inf
    total = sum(o.steps for o in observations)
    compute = sum(
        o.train_time_s if o.train_time_s is not None else o.round_trip_s
        for o in observations
    )
    step_s = compute / total
    other = sum(o.round_trip_s - o.steps * step_s for o in observations)
    return max(0.0, other / len(observations)) + steps * step_s


def profiling_end(
    owing: Sequence[tuple[float, Sequence[int], Sequence[Observation]]],
) -> float:
    """When the nodes that still owe profiling tasks should be done.

    Each entry is (dispatch time of the node's task in flight, steps of that
    task and of the tasks it still owes after it, the node's finished tasks).
    A node's end is its dispatch time plus the expected round trips
    (:func:`expected_round_trip`); infinite while a node has finished none.
    """
    return max(
        (
            started + sum(expected_round_trip(done, n) for n in steps)
            for started, steps, done in owing
        ),
        default=-math.inf,
    )
