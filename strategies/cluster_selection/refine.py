"""Refinement (rehearse the nodes a choice hinges on) and racing (train on rivals).

The formulas and their sources are in each function's docstring;
docs/strategies/cluster-selection.md tells the story.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from .model import NodeModel, Observation, Workload, estimate_masks
from .search import CONFIDENCE_DRAWS, Confidence, confidence

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
