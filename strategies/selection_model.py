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
from dataclasses import dataclass, replace
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
    steps: int = 0
    """Steps timed by ``train-time-s`` over those tasks (``sum n_j``)."""
    step_dof: int = 0
    """Degrees of freedom of ``v_i`` (``J - 1``; 0 when unknown)."""
    transfers: int = 0
    """Model transfers behind ``c_i`` (``sum r_j``)."""
    overhead_dof: int = 0
    """Degrees of freedom of ``u_i``."""
    power_cov: tuple[float, float, float] = (0.0, 0.0, 0.0)
    """Covariance of the fitted (``Pb_i``, ``Pi_i``): var Pb, cov, var Pi (W^2)."""
    power_shape: tuple[float, float, float] | None = None
    """``(A^T A)^-1`` of the relative least-squares power fit (var, cov, var
    entries): ``power_cov`` is it times the relative reading variance."""
    power_rel_var: float = 0.0
    """Relative variance of one ``energy-j`` reading about the fit."""
    power_dof: int = 0
    """Degrees of freedom of ``power_rel_var`` (``J - 2``)."""

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
    ``energy-j`` = Pb compute + Pi other over the tasks (two unknowns: needs
    tasks of two lengths; with one length, ``Pi`` = ``idle_fraction`` x ``Pb``).
    A meter's error is relative (a gain), so each task's equation is divided
    by its reading ``e_j`` and the fit is ordinary least squares of ones on
    ``A = [x_j / e_j, o_j / e_j]`` (weighted least squares with weights
    ``1 / e_j^2``; Seber and Lee, ch. 3). Its residual variance ``rho^2`` over
    ``J - 2`` degrees of freedom is the relative reading variance, and
    ``Cov(Pb, Pi) = rho^2 (A^T A)^-1`` (``power_cov``; ``power_shape`` keeps
    ``(A^T A)^-1`` for :func:`pool_variances`).
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
    power_shape = None
    power_rel_var = 0.0
    power_dof = 0
    powers = [o.power_w for o in observations if o.power_w is not None]
    energies = [o.energy_j for o in observations]
    if powers:
        busy_w = float(np.mean(powers))
        idle_w = idle_fraction * busy_w
    elif all(e is not None for e in energies):
        energy = np.array(energies, dtype=float)
        actual_other = np.maximum(rtt - compute, 0.0)
        if len(set(steps)) >= 2 and np.all(energy > 0):
            a = np.column_stack([compute, actual_other]) / energy[:, None]
            ones = np.ones(len(energy))
            (busy_w, idle_w), *_ = np.linalg.lstsq(a, ones, rcond=None)
            busy_w, idle_w = float(max(busy_w, 0.0)), float(max(idle_w, 0.0))
            gram = a.T @ a
            if np.linalg.cond(gram) < 1e12:
                inv = np.linalg.inv(gram)
                power_shape = (float(inv[0, 0]), float(inv[0, 1]), float(inv[1, 1]))
            power_dof = len(energy) - 2
            if power_dof > 0:
                residual = ones - a @ np.array([busy_w, idle_w])
                power_rel_var = float((residual**2).sum() / power_dof)
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
        steps=int(steps.sum()) if timed else 0,
        step_dof=len(observations) - 1 if timed else 0,
        transfers=int(transfers.sum()),
        overhead_dof=count - 1 if timed else max(count - 2, 0),
        power_cov=_scaled(power_shape, power_rel_var),
        power_shape=power_shape,
        power_rel_var=power_rel_var,
        power_dof=power_dof,
    )


def _scaled(
    shape: tuple[float, float, float] | None, factor: float
) -> tuple[float, float, float]:
    if shape is None:
        return (0.0, 0.0, 0.0)
    return (shape[0] * factor, shape[1] * factor, shape[2] * factor)


PRIOR_DOF = 4.0
"""Weight, in degrees of freedom, of the fleet's pooled variance in
:func:`pool_variances`."""


def pool_variances(
    nodes: Sequence[NodeModel], prior_dof: float = PRIOR_DOF
) -> list[NodeModel]:
    """Steady each node's variances with the fleet's, and their standard errors.

    A node profiled with two tasks has a step-time variance of one degree of
    freedom: its standard errors, and the confidence built on them, can be far
    too small by chance. Smyth's moderated variance (Smyth, "Linear Models and
    Empirical Bayes Methods for Assessing Differential Expression in
    Microarray Experiments", Statistical Applications in Genetics and Molecular
    Biology 3(1), 2004, sec. 3) shrinks each node's variance towards a prior
    pooled over all nodes::

        var~_i = (d0 var_0 + d_i var_i) / (d0 + d_i)

    with ``d_i`` the node's degrees of freedom, ``d0`` = ``prior_dof`` and
    ``var_0`` the dof-weighted mean over the fleet. Variances are pooled
    relative to the node's own scale (``v_i / s_i^2`` per step,
    ``u_i / c_i^2`` per task overhead, the relative ``energy-j`` reading
    variance), because devices differ in speed by orders of magnitude while
    their jitter, as a share, is alike. Then ``step_var``, ``step_se``,
    ``overhead_var``, ``overhead_se`` and ``power_cov`` are recomputed from the
    moderated variances (formulas: :func:`fit_node`). Nodes fitted without a
    variance of their own (``d_i = 0``) take the prior; with no node having
    one, the models are returned unchanged.
    """

    def prior(pairs: list[tuple[float, int]]) -> float | None:
        dof = sum(d for _, d in pairs if d > 0)
        if dof == 0:
            return None
        return sum(v * d for v, d in pairs if d > 0) / dof

    def moderated(own: float, dof: int, pooled: float | None) -> float:
        if pooled is None:
            return own
        return (prior_dof * pooled + dof * own) / (prior_dof + dof)

    step0 = prior(
        [(n.step_var / n.step_s**2, n.step_dof) for n in nodes if n.step_s > 0]
    )
    over0 = prior(
        [
            (n.overhead_var / n.overhead_s**2, n.overhead_dof)
            for n in nodes
            if n.overhead_s > 0
        ]
    )
    power0 = prior([(n.power_rel_var, n.power_dof) for n in nodes])
    out = []
    for n in nodes:
        step_rel = moderated(n.step_var / n.step_s**2, n.step_dof, step0)
        step_var = step_rel * n.step_s**2 if n.steps else n.step_var
        over_rel = (
            moderated(n.overhead_var / n.overhead_s**2, n.overhead_dof, over0)
            if n.overhead_s > 0
            else 0.0
        )
        timed = n.steps > 0 and n.transfers > 0
        overhead_var = over_rel * n.overhead_s**2 if timed else n.overhead_var
        power_rel = moderated(n.power_rel_var, n.power_dof, power0)
        out.append(
            replace(
                n,
                step_var=step_var,
                step_se=math.sqrt(step_var / n.steps) if n.steps else n.step_se,
                overhead_var=overhead_var,
                # c = 2 m; u = 2 w; se(c) = 2 sqrt(w / sum r) = sqrt(2 u / sum r)
                overhead_se=math.sqrt(2 * overhead_var / n.transfers)
                if timed
                else n.overhead_se,
                power_cov=_scaled(n.power_shape, power_rel),
                power_rel_var=power_rel,
            )
        )
    return out


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
    near_probability: float = 1.0
    """Share of draws in which the choice is within ``indifference`` of the
    lowest (equal to ``probability`` when ``indifference`` is 0)."""
    chosen: tuple[int, ...] = ()
    """The configuration the figures are about: the lowest point estimate."""

    @property
    def within_uncertainty(self) -> bool:
        """True when the runner-up is closer than two standard deviations."""
        return self.runner_up is not None and self.gap < 2 * self.gap_sd


def _draw_nodes(
    nodes: Sequence[NodeModel], rng: np.random.Generator, power_gain_error: float
) -> list[NodeModel]:
    out = []
    for m in nodes:
        z_s, z_c, z_p, z_b, z_i = rng.standard_normal(5)
        gain = max(0.0, 1.0 + power_gain_error * z_p)
        busy, idle = m.busy_w, m.idle_w
        var_b, cov, var_i = m.power_cov
        if busy is not None and idle is not None and var_b > 0:
            # (z_b, z_i) -> correlated (busy, idle) errors by Cholesky factors
            sd_b = math.sqrt(var_b)
            rest = max(var_i - cov**2 / var_b, 0.0)
            busy = max(busy + sd_b * z_b, 0.0)
            idle = max(idle + cov / sd_b * z_b + math.sqrt(rest) * z_i, 0.0)
        out.append(
            NodeModel(
                m.node_id,
                max(m.step_s + m.step_se * z_s, 1e-12),
                max(m.overhead_s + m.overhead_se * z_c, 0.0),
                None if busy is None else busy * gain,
                None if idle is None else idle * gain,
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
    drawn = [
        estimate_masks(_draw_nodes(nodes, rng, power_gain_error), lead, workload)
        for _ in range(draws)
    ]
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
        values = np.array([d[o][cols] for d in drawn])
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


DEFAULT_TARGET_CONFIDENCE = 0.99
"""Refinement stops once the choice is this likely to be the best."""
DEFAULT_INDIFFERENCE = 0.002
"""Configurations within this share of each other count as equally good when
refinement decides whether it is sure (:func:`confidence`)."""
DEFAULT_RACE_SHARE = 0.1
"""Most training rounds racing may give to a rival, as a share of the job."""
RACE_GREEDY_EVERY = 5
"""Once no round may go to a rival, racing refits every this many rounds."""
DEFAULT_PROFILE_BUDGET = 0.05
"""Most profiling time, as a share of the chosen configuration's estimated job
(each rehearsal batch costs about one round, 1/R of an R-round job)."""


def rehearsal_steps(node: NodeModel, workload: Workload, k: int) -> int:
    """Steps of a refinement task on ``node`` when ``k`` nodes train.

    The task a member of a ``k``-node configuration runs in the job
    (``workload.member_steps(k)``), and at least as many steps as fit in the
    node's transfer time (``ceil(c_i / s_i)``), so that compute is at least half
    of the task: that separates busy from idle power, and on a node whose
    transfers dominate (a phone on a slow uplink) a step costs little next to
    the transfer that carries it.
    """
    floor = math.ceil(node.overhead_s / node.step_s) if node.step_s > 0 else 1
    return max(1, workload.member_steps(k), min(floor, 10 * workload.steps))


SENSITIVITY_SHARE = 0.9
"""Refinement measures the nodes behind this share of the gap's variance."""


def informative_nodes(
    nodes: Sequence[NodeModel],
    workload: Workload,
    objective: str,
    sure: Confidence,
    share: float = SENSITIVITY_SHARE,
) -> list[int]:
    """The nodes whose fits most blur the choice against its rivals.

    For the choice ``S`` (``sure.chosen``) and each rival ``S'`` (those best in
    at least :data:`RIVAL_SHARE` of the confidence draws, else the runner-up)
    the decision rests on the relative gap ``g = f(S') / f(S) - 1`` of the
    objective ``f``. To first order (the delta method; Casella and Berger,
    "Statistical Inference", 2nd ed., 2002, sec. 5.5.4) its variance is a sum
    over nodes and their fitted parameters ``theta`` (``s_i``, ``c_i``, and
    ``Pb_i``, ``Pi_i`` for energy and EDP)::

        Var g ~ sum_i sum_theta (dg / dtheta_i)^2 se(theta_i)^2

    with each derivative taken by a finite difference of one standard error.
    A node that shares both configurations still counts when it moves the
    gap (in synchronous rounds it may set the pace of one and not the other).
    Returns the nodes with the largest terms that together make up ``share``
    of the variance, over all rivals, largest first. Node ids are those of
    ``nodes``.
    """
    rivals = sure.rivals or ((sure.runner_up,) if sure.runner_up is not None else ())
    if not rivals:
        return []
    ids = [n.node_id for n in nodes]
    rows = np.array([[i in set(r) for i in ids] for r in (sure.chosen, *rivals)])
    base = estimate_masks(nodes, rows, workload)[objective]
    gap0 = base[1:] / base[0] - 1.0
    power = objective in ("energy", "edp")
    terms = np.zeros((len(nodes), len(rivals)))
    for i, m in enumerate(nodes):
        if not rows[:, i].any():
            continue
        moves = [
            replace(m, step_s=m.step_s + m.step_se),
            replace(m, overhead_s=m.overhead_s + m.overhead_se),
        ]
        var_b, _, var_i = m.power_cov
        if power and m.busy_w is not None and m.idle_w is not None:
            moves += [
                replace(m, busy_w=m.busy_w + math.sqrt(var_b)),
                replace(m, idle_w=m.idle_w + math.sqrt(var_i)),
            ]
        for moved in moves:
            trial = list(nodes)
            trial[i] = moved
            values = estimate_masks(trial, rows, workload)[objective]
            terms[i] += (values[1:] / values[0] - 1.0 - gap0) ** 2
    order: list[int] = []
    for r in range(len(rivals)):
        total = terms[:, r].sum()
        if total <= 0:
            continue
        covered = 0.0
        for i in np.argsort(-terms[:, r], kind="stable"):
            if covered >= share * total or terms[i, r] <= 0:
                break
            covered += terms[i, r]
            if ids[i] not in order:
                order.append(ids[i])
    return order


CONFIRM_FACTOR = 10
"""A confidence that reaches the target is confirmed with this many times the
draws (:func:`settled_confidence`)."""


def settled_confidence(
    nodes: Sequence[NodeModel],
    workload: Workload,
    objective: str,
    masks: np.ndarray,
    *,
    target: float,
    indifference: float,
    draws: int,
    seed: int,
    point: dict[str, np.ndarray] | None = None,
) -> Confidence:
    """The confidence refinement and racing stop on, confirmed before it counts.

    :func:`confidence` from the fits' errors only (no sensor calibration
    error, which more samples cannot shrink). A loop that stops the first
    time a figure estimated from ``draws`` random draws crosses ``target``
    stops early by chance: with 100 draws a true 95% reads 99% or more about
    4% of the time, and the loops look again after every batch or round.
    So a figure at or above ``target`` is estimated again from
    ``CONFIRM_FACTOR`` x ``draws`` fresh draws, and that one is returned.
    ``point``: as for :func:`confidence`.
    """
    if point is None:
        point = estimate_masks(nodes, masks, workload)
    sure = confidence(
        nodes,
        workload,
        objective,
        masks,
        draws=draws,
        seed=seed,
        indifference=indifference,
        point=point,
    )[objective]
    if sure.near_probability < target:
        return sure
    return confidence(
        nodes,
        workload,
        objective,
        masks,
        draws=CONFIRM_FACTOR * draws,
        seed=seed + 1_000_003,
        indifference=indifference,
        point=point,
    )[objective]


@dataclass
class RaceState:
    """Where racing stands (:func:`race_next`)."""

    budget: int
    """Rounds that may still go to a rival."""
    explored: int = 0
    """Rounds given to rivals so far."""
    settled: bool = False
    """The choice reached the target confidence; racing is over."""
    last_explored: bool = False
    """The previous round ran on a rival."""
    rounds: int = 0
    """Training rounds finished."""
    choice: tuple[int, ...] | None = None
    """The choice in use (kept while within ``indifference`` of the lowest)."""

    def tick(self) -> bool:
        """Count a finished round; True when racing should look again now.

        Every round while rounds may still go to rivals; after that, every
        :data:`RACE_GREEDY_EVERY` rounds (the choice still follows the members'
        refitted estimates, without rivals' rounds), until settled.
        """
        self.rounds += 1
        if self.settled:
            return False
        return self.explored < self.budget or self.rounds % RACE_GREEDY_EVERY == 0


def race_next(
    nodes: Sequence[NodeModel],
    workload: Workload,
    objective: str,
    masks: np.ndarray,
    state: RaceState,
    *,
    target: float = DEFAULT_TARGET_CONFIDENCE,
    indifference: float = DEFAULT_INDIFFERENCE,
    draws: int = CONFIDENCE_DRAWS,
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The choice and the configuration the next training round runs on.

    Racing (Maron and Moore, "Hoeffding Races: Accelerating Model Selection
    Search for Classification and Function Approximation", NIPS 1993): while
    the job trains, the leading configurations are compared on real rounds
    instead of in profiling, whose time is pure overhead. A round on a rival
    is a training round all the same; it costs only the gap between the two.
    After every round the caller refits the nodes with the members' replies;
    this returns the lowest estimate as the choice (the choice in use stays
    while it is within ``indifference`` of the lowest, so twins do not take
    turns) and, while the choice is
    less than ``target`` sure to be within ``indifference`` of the best
    (:func:`settled_confidence`), every other round the leading
    rival (the first of ``rivals``, else the runner-up) as the round to run,
    while fewer than ``state.budget`` rounds have gone to rivals. Callers ask
    when :meth:`RaceState.tick` says so. Once sure, ``state`` is settled and
    the choice is final (re-selection on disappearance or drift still
    applies). Updates ``state``.
    """
    point = estimate_masks(nodes, masks, workload)
    est = point[objective]
    ids = [n.node_id for n in nodes]
    row = int(np.argmin(est))
    if state.choice is not None and set(state.choice) <= set(ids):
        kept = np.array([i in set(state.choice) for i in ids])
        rows = np.flatnonzero((masks == kept).all(axis=1))
        if len(rows) and est[rows[0]] <= (1.0 + indifference) * est[row]:
            row = int(rows[0])
    choice = tuple(ids[i] for i in np.flatnonzero(masks[row]))
    state.choice = choice
    sure = settled_confidence(
        nodes,
        workload,
        objective,
        masks,
        target=target,
        indifference=indifference,
        draws=draws,
        seed=state.rounds,
        point=point,
    )
    if sure.near_probability >= target:
        state.settled = True
        return choice, choice
    rival = sure.rivals[0] if sure.rivals else sure.runner_up
    if rival is None or state.explored >= state.budget or state.last_explored:
        state.last_explored = False
        return choice, choice
    state.explored += 1
    state.last_explored = True
    return choice, tuple(rival)


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
