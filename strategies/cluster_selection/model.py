"""Cost models and search for cluster-configuration selection.

Gu, Kong, Munir, Kim, "A Framework for Distributed Deep Learning Training with
Heterogeneous Computing Platforms", 2019 (MISSION.md, S4) profile each device for a
few steps, fit a model of its time and power, estimate time, energy and
energy-delay product (EDP) of every candidate configuration (a subset of the
devices) and train on the best one. This module holds the cost model, without any
Flower machinery, so the strategy (:mod:`.strategy`) and the evaluation
(:mod:`flowerbed.bench.selection_eval`) share it; the search over configurations
is in :mod:`.search`, refinement and racing in :mod:`.refine`.

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
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

OBJECTIVES = ("time", "energy", "edp", "time-to-accuracy")
"""What a configuration is chosen for."""
MODES = ("sync", "async")
"""Synchronous rounds (slowest member sets the pace) or FedBuff (throughputs add)."""
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
    split : bool
        sync: True splits ``W`` over the members; False gives every member
        ``steps`` per task whatever the configuration's size (the ClientApps
        decide their work: a plain Flower app without ``local-steps``).
    """

    mode: str = "sync"
    steps: int = 10
    num_rounds: int = 10
    buffer_size: int | None = None
    kappa: float = 1.0
    split: bool = True

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
        if self.mode == "sync" and self.split:
            return math.ceil(self.steps / k)
        return self.steps


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
        # A negative slope (noise, or a client that does the same work whatever
        # local-steps says) puts all of the task's time into the overhead.
        step_s = max(0.0, float(slope))
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
    ``mu`` and ``sd`` may carry a leading batch axis (draws x nodes); the result
    is then draws x configurations.
    """
    from scipy import special  # here: importing scipy costs more than the strategies

    masks = np.asarray(masks, dtype=bool)
    mu = np.asarray(mu, dtype=float)
    batched = mu.ndim == 2
    mu = np.atleast_2d(mu)
    sd = np.broadcast_to(np.asarray(sd, dtype=float), mu.shape)
    sd = np.maximum(sd, 1e-6 * np.abs(mu) + 1e-300)
    x = np.sort((mu[:, :, None] + sd[:, :, None] * _GRID).reshape(len(mu), -1))
    used = masks.any(axis=0)
    z = (x[:, None, :] - mu[:, used, None]) / sd[:, used, None]
    log_cdf = np.maximum(special.log_ndtr(z), -1e4)
    below = 1.0 - np.exp(masks[:, used].astype(float) @ log_cdf)
    # trapezoidal rule on each draw's own points (repeated points add nothing)
    area = (np.diff(x)[:, None, :] * (below[:, :, 1:] + below[:, :, :-1])).sum(axis=2)
    out = x[:, :1] + area / 2.0
    return out if batched else out[0]


_GRID = np.linspace(-6.0, 6.0, 37)
"""Standard deviations from the mean at which :func:`expected_max` resolves each
node's CDF."""


def estimate_masks(
    nodes: Sequence[NodeModel], masks: np.ndarray, workload: Workload
) -> dict[str, np.ndarray]:
    """Estimates for many configurations at once (formulas: module docstring).

    ``masks`` is a boolean array (configurations x nodes). Returns arrays
    ``round_s``, ``time``, ``energy``, ``edp``, ``time-to-accuracy`` (energy is NaN
    when a member's power is unknown).
    """
    s, c, pb, pi = _arrays(nodes)
    v, u = _variances(nodes)
    batch = estimate_batch(s[None], c[None], pb[None], pi[None], v, u, masks, workload)
    return {name: values[0] for name, values in batch.items()}


def estimate_batch(
    s: np.ndarray,
    c: np.ndarray,
    pb: np.ndarray,
    pi: np.ndarray,
    v: np.ndarray,
    u: np.ndarray,
    masks: np.ndarray,
    workload: Workload,
) -> dict[str, np.ndarray]:
    """:func:`estimate_masks` for a batch of node parameters at once.

    ``s``, ``c``, ``pb``, ``pi`` are draws x nodes (``s_i``, ``c_i``, ``Pb_i``,
    ``Pi_i``; NaN power: unknown), ``v`` and ``u`` the nodes' step and overhead
    variances; every result is draws x configurations.
    """
    masks = np.asarray(masks, dtype=bool)
    k = masks.sum(axis=1)
    if np.any(k == 0):
        raise ValueError("a configuration needs at least one node")
    w = workload
    if w.mode == "sync":
        steps = np.ceil(w.steps / k)[None, :, None]
        compute = steps * s[:, None, :]
        round_s = np.zeros((len(s), len(masks)))
        for size in np.unique(k):
            rows = k == size
            n = w.member_steps(int(size))
            round_s[:, rows] = expected_max(c + n * s, np.sqrt(u + n * v), masks[rows])
        per_node = pb[:, None, :] * compute + pi[:, None, :] * (
            round_s[:, :, None] - compute
        )
        energy_round = np.where(masks, per_node, 0.0).sum(axis=2)
        time = w.num_rounds * round_s
        energy = w.num_rounds * energy_round
    else:
        t = c + w.steps * s
        rate = np.where(masks, 1.0 / t[:, None, :], 0.0).sum(axis=2)
        round_s = 1.0 / rate
        buffer = w.buffer_size if w.buffer_size else np.maximum(1, k // 2)
        time = w.num_rounds * buffer * round_s
        power = (pb * w.steps * s + pi * c) / t
        energy = time * np.where(masks, power[:, None, :], 0.0).sum(axis=2)
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
