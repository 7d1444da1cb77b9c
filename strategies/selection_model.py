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
    t_i       = c_i + n_k s_i                                 member i's task
    T_round   = max_{i in S} t_i
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
:data:`EXHAUSTIVE_MAX_NODES` nodes; beyond that :func:`polynomial_search`. For
synchronous rounds it sorts the nodes by ``t_i(k)`` for each ``k`` and keeps the
``k`` fastest: exact for ``time`` and ``time-to-accuracy`` (both depend on the
members only through ``max t_i(k)`` and ``k``). For asynchronous rounds it scans
the prefixes of the nodes sorted by throughput ``1/t_i``: exact for ``time`` and
``time-to-accuracy``, which depend on the members only through ``k`` and the
summed rate, and for each ``k`` the ``k`` fastest have the largest rate. For
``energy`` and ``edp`` (sums over members, not a max) the prefixes of two orders
(by ``t_i(k)`` and by energy per task) are a heuristic.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

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
    """Fit ``s_i``, ``c_i``, ``Pb_i``, ``Pi_i`` from a node's timed tasks.

    - ``s_i``: sum of ``train-time-s`` / sum of steps when every task reports it;
      otherwise the least-squares slope of round trip against steps (needs tasks
      of at least two lengths).
    - ``c_i``: ``comm-time-s`` when reported, else round trip minus train time (the
      intercept of the fit when there is no train time); scaled to a training
      task's two transfers when a task moved the model once.
    - power: the mean ``power-w`` as ``Pb_i`` when reported (``Pi_i`` =
      ``idle_fraction`` x ``Pb_i``, see :data:`IDLE_FRACTION`); else from
      ``energy-j`` = Pb compute + Pi other, by least squares over the tasks
      (two unknowns: needs tasks of two lengths; with one length, ``Pi`` =
      ``idle_fraction`` x ``Pb``).
    """
    if not observations:
        raise ValueError(f"node {node_id}: no profiling observation to fit")
    steps = np.array([o.steps for o in observations], dtype=float)
    rtt = np.array([o.round_trip_s for o in observations])
    if np.any(steps < 1):
        raise ValueError(f"node {node_id}: a profiling task took no step")
    train = [o.train_time_s for o in observations]
    if all(t is not None for t in train):
        compute = np.array(train, dtype=float)
        step_s = float(compute.sum() / steps.sum())
    elif len(set(steps)) >= 2:
        slope, _ = np.polyfit(steps, rtt, 1)
        step_s = float(slope)
        compute = steps * step_s
    else:
        raise ValueError(
            f"node {node_id}: without train-time-s, profiling needs tasks of two "
            "lengths (profile_steps with two different values)"
        )
    other = np.array(
        [
            (o.comm_time_s if o.comm_time_s is not None else r - c) * 2 / o.transfers
            for o, r, c in zip(observations, rtt, compute, strict=True)
        ]
    )
    overhead_s = float(max(0.0, other.mean()))
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
    return NodeModel(node_id, max(step_s, 1e-12), overhead_s, busy_w, idle_w)


def _arrays(
    nodes: Sequence[NodeModel],
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    s = np.array([n.step_s for n in nodes])
    c = np.array([n.overhead_s for n in nodes])
    nan = float("nan")
    pb = np.array([nan if n.busy_w is None else n.busy_w for n in nodes])
    pi = np.array([nan if n.idle_w is None else n.idle_w for n in nodes])
    return s, c, pb, pi


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
        steps = np.ceil(w.steps / k)[:, None]
        compute = steps * s[None, :]
        t = c[None, :] + compute
        round_s = np.where(masks, t, 0.0).max(axis=1)
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


def prefix_masks(
    nodes: Sequence[NodeModel], workload: Workload, min_size: int = 1
) -> np.ndarray:
    """The candidates of the polynomial search (see the module docstring).

    O(n) orders of n nodes, n prefixes each: O(n^2 log n) to build, O(n^3) to
    evaluate.
    """
    s, c, pb, pi = _arrays(nodes)
    n = len(nodes)
    rows = []
    if workload.mode == "sync":
        for k in range(min_size, n + 1):
            compute = workload.member_steps(k) * s
            t = c + compute
            energy = np.nan_to_num(pb * compute + pi * c, nan=0.0)
            for key in (t, energy):
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
    exhaustive = search == "exhaustive" or (
        search == "auto" and len(nodes) <= exhaustive_max_nodes
    )
    masks = (
        all_masks(len(nodes), min_size)
        if exhaustive
        else prefix_masks(nodes, workload, min_size)
    )
    est = estimate_masks(nodes, masks, workload)
    return _pick(nodes, masks, est, int(np.argmin(est[objective])))
