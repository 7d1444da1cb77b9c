"""How often cluster selection picks the truly best configuration (for the bench).

:func:`evaluate_selection` draws random heterogeneous fleets from the device
catalogue (``flowerbed.sims.devices.DEVICES``) and, per objective, compares the
configuration :func:`flowerbed.strategies.cluster_selection.select` chooses from
*simulated profiling* with the best configuration by *ground truth*.

Truth and estimate differ as a real deployment's would:

- **Truth** runs every configuration for ``truth_rounds`` rounds on the virtual
  clock: the cost functions of ``flowerbed.sims.vclock`` (``step_seconds``,
  ``transfer_seconds``, ``energy_joules``) with the node's true device, plus
  run-time noise: each round every node's compute time is multiplied by a
  lognormal factor (per-step jitter ``step_jitter``, averaged over the round's
  steps: sigma / sqrt(steps)) and each transfer by its own lognormal factor
  (``network_jitter``). The same draws serve every configuration (common random
  numbers), and the figure is the mean over the rounds, scaled to the job: the
  configuration's *expected* cost. ``truth_rounds`` rounds rank every
  configuration; the leading ones (:data:`TRUTH_SHORTLIST` per objective) are
  simulated again for ``truth_fine_rounds`` rounds, so that the true best is
  resolved to well under 0.1% (with a few thousand rounds, configurations
  within about 0.1% of each other swap places between random streams, and any
  one job's own luck is not something a selection can predict).
- **Estimate** sees only what the nodes report during profiling, as the
  strategy does: for each profiling task, ``num-steps``, ``train-time-s``
  (the sum of that many jittered steps: a few steps are far noisier than a
  round's average), ``energy-j`` with a per-node sensor gain error
  ``power_gain_error`` and reading noise ``power_noise``, and the round trip
  (compute plus the task's own jittered transfers).
  :func:`flowerbed.strategies.cluster_selection.fit_node` turns that into
  per-node models, never seeing the devices' catalogue numbers.
- Every node is its own unit: speed and power are the catalogue's times a
  lognormal unit factor (``unit_spread``), so two boards of one class differ.

Noise magnitudes are assumptions, not measurements; they are arguments so the
bench can report sensitivity. Time to accuracy uses the same participation model
in truth and estimate (rounds = R (1 + kappa / k), Li et al., ICLR 2020,
Theorem 3; see :mod:`flowerbed.strategies.cluster_selection.model`): the
evaluation tests the systems half of that objective, not the statistical model.

Profiling is adaptive, as the strategy's: every node runs ``profile_steps``
back to back and nodes that finish early repeat them while they expect to be
done before the slowest (the probe); then, per objective, refinement rehearses
the nodes the choice hinges on until it is ``target_confidence`` sure or
``profile_budget`` of the estimated job is spent (:func:`_refine`, as
:meth:`ClusterSelection.refine`). Profiling overhead = profiling time (until the
last profiling task returns) / (profiling time + the chosen configuration's
true job time). Fleet, profiling, refinement and truth draw from separate
random streams.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from flowerbed.models import build_model, cost_factor, model_num_bytes
from flowerbed.sims import vclock
from flowerbed.sims.devices import DEVICES, DeviceProfile
from flowerbed.strategies.cluster_selection import (
    CONFIDENCE_DRAWS,
    DEFAULT_INDIFFERENCE,
    DEFAULT_PROFILE_BUDGET,
    DEFAULT_RACE_SHARE,
    DEFAULT_TARGET_CONFIDENCE,
    OBJECTIVES,
    NodeModel,
    Observation,
    RaceState,
    Workload,
    all_masks,
    confidence,
    estimate_masks,
    expected_round_trip,
    fit_node,
    informative_nodes,
    pool_variances,
    profiling_end,
    race_next,
    rehearsal_steps,
    select,
    settled_confidence,
)

PAPER_BEST_FRACTION = 0.7667
"""Gu, Kong, Munir, Kim (2019): the best configuration was picked in 76.67%."""
DEFAULT_PROFILE_MAX_TASKS = 32
"""Most profiling tasks one node runs (the strategy's default, see there)."""
NEAR_BEST = 0.01
"""A choice within 1% of the best counts as near-best."""


def _lognormal(rng: np.random.Generator, sigma: float | np.ndarray, size: Any) -> Any:
    """Mean-one lognormal factors: exp(sigma z - sigma^2 / 2)."""
    z = rng.standard_normal(size)
    return np.exp(sigma * z - sigma**2 / 2)


def _draw_fleet(
    rng: np.random.Generator, min_nodes: int, max_nodes: int, unit_spread: float
) -> list[DeviceProfile]:
    names = list(DEVICES)
    n = int(rng.integers(min_nodes, max_nodes + 1))
    drawn = rng.choice(names, n)
    while len(set(drawn)) < 2:
        drawn = rng.choice(names, n)
    fleet = []
    for name in drawn:
        d = DEVICES[str(name)]
        speed, power = _lognormal(rng, unit_spread, 2)
        fleet.append(
            replace(
                d,
                geekbench5_multi=d.geekbench5_multi * speed,
                busy_w=d.busy_w * power,
                idle_w=d.idle_w * power,
            )
        )
    return fleet


def _profile(
    rng: np.random.Generator,
    units: _Units,
    profile_steps: Sequence[int],
    max_tasks: int,
) -> tuple[list[list[Observation]], float]:
    """Simulated adaptive profiling: each node's observations; its duration.

    As :meth:`ClusterSelection.profile`: every node runs the tasks of
    ``profile_steps`` back to back. A node that has done them starts another
    (cycling through ``profile_steps``, at most ``max_tasks`` in all) while
    some node has not, if it expects to finish before the nodes still owing
    tasks do (:func:`~flowerbed.strategies.cluster_selection.profiling_end`, from
    the replies seen so far); profiling ends when the last task returns.
    """
    n = len(units.devices)
    observed: list[list[Observation]] = [[] for _ in range(n)]
    ends: list[list[float]] = [[] for _ in range(n)]
    required = len(profile_steps)

    def run(i: int, now: float) -> float:
        steps = profile_steps[len(observed[i]) % required]
        obs = units.task(rng, i, steps)
        observed[i].append(obs)
        ends[i].append(now + obs.round_trip_s)
        return ends[i][-1]

    def seen(i: int, now: float) -> list[Observation]:
        return [o for o, e in zip(observed[i], ends[i], strict=True) if e <= now]

    events = [(0.0, i) for i in range(n)]
    while events:
        now, i = heapq.heappop(events)
        if len(observed[i]) >= required:
            owing = [m for m in range(n) if len(seen(m, now)) < required]
            if not owing or len(observed[i]) >= max_tasks:
                continue
            projected = profiling_end(
                [
                    (
                        ends[m][len(seen(m, now)) - 1] if seen(m, now) else 0.0,
                        profile_steps[len(seen(m, now)) : required],
                        seen(m, now),
                    )
                    for m in owing
                ]
            )
            steps = profile_steps[len(observed[i]) % required]
            if now + expected_round_trip(seen(i, now), steps) > projected:
                continue
        heapq.heappush(events, (run(i, now), i))
    return observed, float(max(e[-1] for e in ends))


@dataclass(frozen=True)
class _Units:
    """The simulated fleet: each node's device, true costs and sensor gain."""

    devices: Sequence[DeviceProfile]
    step_s: np.ndarray
    down_s: np.ndarray
    up_s: np.ndarray
    gain: np.ndarray
    noise: dict[str, float]

    def task(self, rng: np.random.Generator, i: int, steps: int) -> Observation:
        """One simulated timed training task as node ``i`` would report it."""
        noise = self.noise
        train = float(
            (self.step_s[i] * _lognormal(rng, noise["step_jitter"], steps)).sum()
        )
        comm = float(
            (
                np.array([self.down_s[i], self.up_s[i]])
                * _lognormal(rng, noise["network_jitter"], 2)
            ).sum()
        )
        energy = vclock.energy_joules(self.devices[i], train, comm) * (
            self.gain[i] + noise["power_noise"] * rng.standard_normal()
        )
        return Observation(
            steps=steps, round_trip_s=train + comm, train_time_s=train, energy_j=energy
        )


def _refine(
    rng: np.random.Generator,
    units: _Units,
    observed: list[list[Observation]],
    started: float,
    masks: np.ndarray,
    workload: Workload,
    objective: str,
    target: float,
    budget: float,
    draws: int,
    indifference: float,
) -> tuple[list[NodeModel], float, int, list[list[Observation]]]:
    """As :meth:`ClusterSelection.refine`: rehearse the nodes the choice hinges on.

    While the probability, from what profiling can still shrink (the fits'
    standard errors, no sensor calibration error), that the choice is within
    ``indifference`` of the best is below ``target``,
    and the next batch is expected to end within ``budget`` x the choice's
    estimated job, the informative nodes
    (:func:`~flowerbed.strategies.cluster_selection.informative_nodes`) each run one
    rehearsal task (:func:`~flowerbed.strategies.cluster_selection.rehearsal_steps`)
    in parallel. Returns the models, when profiling ended, the batches run and
    the observations.
    """
    observed = [list(o) for o in observed]
    models = pool_variances([fit_node(i, o) for i, o in enumerate(observed)])
    now = started
    batches = 0
    while True:
        est = estimate_masks(models, masks, workload)
        row = int(np.argmin(est[objective]))
        job = est["time-to-accuracy" if objective == "time-to-accuracy" else "time"]
        chosen = [int(i) for i in np.flatnonzero(masks[row])]
        sure = settled_confidence(
            models,
            workload,
            objective,
            masks,
            target=target,
            indifference=indifference,
            draws=draws,
            seed=batches,
            point=est,
        )
        if sure.near_probability >= target:
            break
        nodes = informative_nodes(models, workload, objective, sure)
        plan = {i: rehearsal_steps(models[i], workload, len(chosen)) for i in nodes}
        expected = max(
            (expected_round_trip(observed[i], n) for i, n in plan.items()), default=0
        )
        if not plan or now + expected > budget * float(job[row]):
            break
        took = []
        for i, n in plan.items():
            obs = units.task(rng, i, n)
            observed[i].append(obs)
            took.append(obs.round_trip_s)
        now += max(took)
        batches += 1
        models = pool_variances([fit_node(i, o) for i, o in enumerate(observed)])
    return models, now, batches, observed


def _race(
    rng: np.random.Generator,
    units: _Units,
    observed: list[list[Observation]],
    masks: np.ndarray,
    workload: Workload,
    objective: str,
    target: float,
    indifference: float,
    draws: int,
    race_share: float,
) -> tuple[int, list[int], int]:
    """As the strategy's racing: train, learn from every reply, try the rival.

    Every round of the job is simulated on the configuration in use; each
    member's reply (a task of the member's steps, jittered as in profiling)
    joins its observations. Until the choice is ``target`` sure (within
    ``indifference``) the models are refitted (after every round while fewer
    than ``race_share`` x ``num_rounds`` rounds have gone to rivals, then
    every :data:`~flowerbed.strategies.cluster_selection.RACE_GREEDY_EVERY`),
    the choice follows the lowest estimate, and every other round may run on
    the leading rival instead
    (:func:`~flowerbed.strategies.cluster_selection.race_next`). Returns the
    configuration in use at the end of the job, the row of every round, and the
    rounds spent on rivals.
    """
    observed = [list(o) for o in observed]
    models = pool_variances([fit_node(i, o) for i, o in enumerate(observed)])
    state = RaceState(budget=math.floor(race_share * workload.num_rounds))
    ids = [m.node_id for m in models]
    rows: list[int] = []
    choice = int(np.argmin(estimate_masks(models, masks, workload)[objective]))
    due = False  # the first round runs on the choice, as in the strategy
    for _ in range(workload.num_rounds):
        row = choice
        if due:
            models = pool_variances([fit_node(i, o) for i, o in enumerate(observed)])
            choice_members, run_members = race_next(
                models,
                workload,
                objective,
                masks,
                state,
                target=target,
                indifference=indifference,
                draws=draws,
            )
            choice = _row(masks, [ids.index(n) for n in choice_members])
            row = _row(masks, [ids.index(n) for n in run_members])
        rows.append(row)
        members = [int(i) for i in np.flatnonzero(masks[row])]
        steps = workload.member_steps(len(members))
        for i in members:
            obs = units.task(rng, i, steps)
            observed[i].append(obs)
        due = state.tick()
    return choice, rows, state.explored


TRUTH_SHORTLIST = 16
"""Leading configurations per objective whose truth is simulated again, longer."""
TRUTH_FINE_FACTOR = 25
"""Default ``truth_fine_rounds`` as a multiple of ``truth_rounds``."""
TRUTH_CHUNK = 100
"""Rounds of the truth simulated at once (bounds its memory)."""


def _truth(
    rng: np.random.Generator,
    units: _Units,
    masks: np.ndarray,
    workload: Workload,
    truth_rounds: int,
) -> dict[str, np.ndarray]:
    """Each configuration's expected cost on the virtual clock with run-time noise.

    The mean over ``truth_rounds`` simulated rounds (common random numbers for
    every configuration), scaled to the job's ``num_rounds``. Uses the true
    devices and costs of ``units``, not its sensor gains.
    """
    fleet, step_s, noise = units.devices, units.step_s, units.noise
    down_s, up_s = units.down_s, units.up_s
    n = len(fleet)
    k = masks.sum(axis=1)
    w = workload
    round_sum = np.zeros(len(masks))
    energy_sum = np.zeros(len(masks))
    task_total = np.zeros(n)
    energy_total = np.zeros(n)
    done = 0
    while done < truth_rounds:
        rounds = min(TRUTH_CHUNK, truth_rounds - done)
        done += rounds
        z = rng.standard_normal((rounds, n))
        comm = down_s * _lognormal(rng, noise["network_jitter"], (rounds, n))
        comm = comm + up_s * _lognormal(rng, noise["network_jitter"], (rounds, n))
        if w.mode == "sync":
            steps = np.ceil(w.steps / k)
            sigma = noise["step_jitter"] / np.sqrt(steps)
            jitter = np.exp(
                sigma[:, None, None] * z[None] - sigma[:, None, None] ** 2 / 2
            )
            compute = steps[:, None, None] * step_s[None, None, :] * jitter
            task = comm[None] + compute
            round_s = np.where(masks[:, None, :], task, 0.0).max(axis=2)
            energy_round = np.zeros_like(round_s)
            for i, device in enumerate(fleet):
                e = vclock.energy_joules(
                    device, compute[:, :, i], round_s - compute[:, :, i]
                )
                energy_round += np.where(masks[:, i : i + 1], e, 0.0)
            round_sum += round_s.sum(axis=1)
            energy_sum += energy_round.sum(axis=1)
        else:
            sigma = noise["step_jitter"] / np.sqrt(w.steps)
            compute = w.steps * step_s * np.exp(sigma * z - sigma**2 / 2)
            # per node: summed task seconds and energy, for rates and powers
            task_total += (comm + compute).sum(axis=0)
            energy_total += np.array(
                [
                    vclock.energy_joules(d, compute[:, i], comm[:, i]).sum()
                    for i, d in enumerate(fleet)
                ]
            )
    if w.mode == "sync":
        time = w.num_rounds * round_sum / truth_rounds
        energy = w.num_rounds * energy_sum / truth_rounds
    else:
        rate = truth_rounds / task_total
        power = energy_total / task_total
        buffer = w.buffer_size if w.buffer_size else np.maximum(1, k // 2)
        time = w.num_rounds * buffer / (masks * rate).sum(axis=1)
        energy = time * (masks * power).sum(axis=1)
    return {
        "time": time,
        "energy": energy,
        "edp": time * energy,
        "time-to-accuracy": time * (1.0 + w.kappa / k),
    }


def _row(masks: np.ndarray, members: Sequence[int]) -> int:
    target = np.zeros(masks.shape[1], dtype=bool)
    target[list(members)] = True
    return int(np.flatnonzero((masks == target).all(axis=1))[0])


def _oracle_models(units: _Units) -> list[NodeModel]:
    """The true devices and jitter as node models: what perfect profiling would fit.

    A mean-one lognormal factor of sigma has variance ``exp(sigma^2) - 1``; a step
    of ``s`` seconds has variance ``s^2 (exp(sigma_step^2) - 1)`` and the two
    transfers ``(down^2 + up^2) (exp(sigma_net^2) - 1)``.
    """
    step_s, down_s, up_s, noise = units.step_s, units.down_s, units.up_s, units.noise
    step_factor = math.expm1(noise["step_jitter"] ** 2)
    net_factor = math.expm1(noise["network_jitter"] ** 2)
    return [
        NodeModel(
            i,
            float(step_s[i]),
            float(down_s[i] + up_s[i]),
            d.busy_w,
            d.idle_w,
            step_var=float(step_s[i] ** 2 * step_factor),
            overhead_var=float((down_s[i] ** 2 + up_s[i] ** 2) * net_factor),
        )
        for i, d in enumerate(units.devices)
    ]


def evaluate_selection(
    num_fleets: int = 30,
    seed: int = 0,
    *,
    min_nodes: int = 2,
    max_nodes: int = 12,
    mode: str = "sync",
    model: str = "lenet",
    in_channels: int = 1,
    image_size: int = 28,
    num_classes: int = 10,
    batch_size: int = 16,
    local_steps: int = 10,
    num_rounds: int = 100,
    kappa: float = 1.0,
    profile_steps: Sequence[int] = (1, 3),
    profile_max_tasks: int = DEFAULT_PROFILE_MAX_TASKS,
    step_jitter: float = 0.10,
    network_jitter: float = 0.20,
    power_gain_error: float = 0.03,
    power_noise: float = 0.01,
    unit_spread: float = 0.05,
    truth_rounds: int = 2000,
    truth_fine_rounds: int | None = None,
    target_confidence: float = DEFAULT_TARGET_CONFIDENCE,
    profile_budget: float = DEFAULT_PROFILE_BUDGET,
    indifference: float = DEFAULT_INDIFFERENCE,
    race_share: float = DEFAULT_RACE_SHARE,
    objectives: Sequence[str] = OBJECTIVES,
    confidence_draws: int = CONFIDENCE_DRAWS,
    also: Sequence[tuple[float, Sequence[str]]] = (),
    jobs: int = 1,
) -> dict[str, Any]:
    """Accuracy of cluster selection over ``num_fleets`` random fleets.

    Each fleet has 2..12 nodes (``min_nodes``..``max_nodes``) of at least two
    device classes. A synchronous round's work is ``local_steps`` x fleet size
    optimiser steps of ``batch_size`` samples, split over the chosen nodes (the
    strategy's default ``round_steps``); async tasks are ``local_steps`` steps.
    The job is ``num_rounds`` rounds. Profiling is adaptive: every node runs the
    ``profile_steps`` tasks, and nodes that finish early repeat them (at most
    ``profile_max_tasks``) until the slowest is done. See the module docstring
    for how truth and estimate differ. Returns plain JSON-able data::

        {"num_fleets", "seed", "mode", "fleet_sizes", "device_counts", "setup",
         "noise", "truth", "estimate", "paper_best_fraction", "profiling",
         "objectives": {objective: {
             "best_fraction", "near_best_fraction", "mean_regret_pct",
             "max_regret_pct", "profiling_overhead_pct", "mean_nodes_chosen",
             "mean_nodes_best", "polynomial_best_fraction",
             "polynomial_mean_regret_pct", "oracle_best_fraction",
             "oracle_mean_regret_pct", "mean_confidence",
             "within_uncertainty_fraction", "confident_fraction",
             "confident_best_fraction", "profiling_mean_seconds",
             "profiling_mean_tasks_per_node", "refinement_mean_batches"}}}

    ``best_fraction``: share of fleets where the chosen configuration is the true
    best; ``near_best_fraction``: within 1% of it; regret: % the chosen
    configuration's true cost exceeds the best's; the ``polynomial_`` figures are
    the same fleets with the polynomial search instead of the exhaustive one.
    ``oracle_``: the same estimate formulas fed the true devices and jitter
    (perfect profiling), so what is left is the truth's own round-to-round
    randomness and the model's approximations: a ceiling for ``best_fraction``.
    ``mean_confidence``: mean of the selection's own confidence
    (:func:`flowerbed.strategies.cluster_selection.confidence`, ``confidence_draws``
    draws, power gain error ``power_gain_error``); ``within_uncertainty_fraction``:
    fleets where the runner-up's estimate is within two standard deviations;
    ``confident_fraction``: fleets with confidence >= 0.95, and
    ``confident_best_fraction`` the share of those whose choice before
    training was the true best (None when there are none); the confidence
    figures describe the choice before training. ``profiling`` describes the
    probe shared by the objectives; each objective's ``profiling_*`` and
    ``refinement_mean_batches`` include its own refinement.

    ``also``: further (``power_gain_error``, ``objectives``) settings evaluated on
    the same fleets, returned under ``"also"`` in that order, each as this
    result's ``objectives`` and ``profiling``. Every draw comes from a stream of its
    own (fleet, purpose), and the truth does not depend on the power meters, so
    each setting's figures equal a separate call's; the truth is simulated once.
    ``jobs``: worker processes over the fleets (the figures do not depend on it).
    """
    if num_fleets < 1:
        raise ValueError(f"num_fleets must be >= 1, got {num_fleets}")
    if not 1 <= min_nodes <= max_nodes <= 16 or max_nodes < 2:
        raise ValueError(
            "need 1 <= min_nodes <= max_nodes <= 16 and max_nodes >= 2, got "
            f"min_nodes={min_nodes}, max_nodes={max_nodes}"
        )
    if profile_max_tasks < len(profile_steps):
        raise ValueError(
            f"profile_max_tasks must be >= len(profile_steps) = {len(profile_steps)}, "
            f"got {profile_max_tasks}"
        )
    settings = [(power_gain_error, tuple(objectives))]
    settings += [(float(g), tuple(o)) for g, o in also]
    for name in {o for _, objs in settings for o in objs}:
        if name not in OBJECTIVES:
            raise ValueError(
                f"unknown objective {name!r}; valid choices: {', '.join(OBJECTIVES)}"
            )
    if truth_fine_rounds is None:
        truth_fine_rounds = TRUTH_FINE_FACTOR * truth_rounds
    noise = {
        "step_jitter": step_jitter,
        "network_jitter": network_jitter,
        "power_gain_error": power_gain_error,
        "power_noise": power_noise,
        "unit_spread": unit_spread,
    }
    plan = _Plan(
        seed=seed,
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        unit_spread=unit_spread,
        mode=mode,
        batch_size=batch_size,
        local_steps=local_steps,
        num_rounds=num_rounds,
        kappa=kappa,
        factor=cost_factor(model, in_channels, image_size, num_classes),
        nbytes=model_num_bytes(
            build_model(model, in_channels, image_size, num_classes)
        ),
        noise=noise,
        profile_steps=tuple(profile_steps),
        profile_max_tasks=profile_max_tasks,
        truth_rounds=truth_rounds,
        truth_fine_rounds=truth_fine_rounds,
        target_confidence=target_confidence,
        profile_budget=profile_budget,
        indifference=indifference,
        race_share=race_share,
        confidence_draws=confidence_draws,
        settings=tuple(settings),
    )
    if jobs > 1 and num_fleets > 1:
        with ProcessPoolExecutor(min(jobs, num_fleets)) as pool:
            fleets = list(pool.map(_fleet, [plan] * num_fleets, range(num_fleets)))
    else:
        fleets = [_fleet(plan, f) for f in range(num_fleets)]
    sizes = [fl["size"] for fl in fleets]
    devices = Counter(name for fl in fleets for name in fl["devices"])
    nbytes = plan.nbytes
    summaries = [
        _summarise([fl["outcomes"][j] for fl in fleets], objs)
        for j, (_, objs) in enumerate(settings)
    ]
    out: dict[str, Any] = {
        "num_fleets": num_fleets,
        "seed": seed,
        "mode": mode,
        "fleet_sizes": sizes,
        "device_counts": dict(sorted(devices.items())),
        "setup": {
            "model": model,
            "input": [in_channels, image_size, image_size],
            "model_bytes": nbytes,
            "batch_size": batch_size,
            "local_steps": local_steps,
            "round_steps": "local_steps x fleet size" if mode == "sync" else None,
            "num_rounds": num_rounds,
            "kappa": kappa,
            "profile_steps": list(profile_steps),
            "profile_max_tasks": profile_max_tasks,
            "truth_rounds": truth_rounds,
            "truth_fine_rounds": truth_fine_rounds,
            "truth_shortlist": TRUTH_SHORTLIST,
            "target_confidence": target_confidence,
            "profile_budget": profile_budget,
            "indifference": indifference,
            "race_share": race_share,
            "confidence_draws": confidence_draws,
        },
        "noise": noise,
        "truth": "every configuration on the virtual clock (flowerbed.sims.vclock) "
        "with the true devices and per-round compute and network jitter",
        "estimate": "per-node models fitted from simulated adaptive profiling "
        "reports (train-time-s of a few jittered steps, round trip, noisy "
        "energy-j); round time as the expected maximum of the members' task times",
        "paper_best_fraction": PAPER_BEST_FRACTION,
    }
    out.update(summaries[0])
    out["also"] = [
        {"power_gain_error": g, **summary}
        for (g, _), summary in zip(settings[1:], summaries[1:], strict=True)
    ]
    return out


@dataclass(frozen=True)
class _Plan:
    """What every fleet of :func:`evaluate_selection` needs (sent to workers)."""

    seed: int
    min_nodes: int
    max_nodes: int
    unit_spread: float
    mode: str
    batch_size: int
    local_steps: int
    num_rounds: int
    kappa: float
    factor: float
    nbytes: int
    noise: dict[str, float]
    profile_steps: tuple[int, ...]
    profile_max_tasks: int
    truth_rounds: int
    truth_fine_rounds: int
    target_confidence: float
    profile_budget: float
    indifference: float
    race_share: float
    confidence_draws: int
    settings: tuple[tuple[float, tuple[str, ...]], ...]


_FIELDS = (
    "best",
    "near",
    "regret",
    "overhead",
    "chosen",
    "best_k",
    "poly_best",
    "poly_regret",
    "oracle_best",
    "oracle_regret",
    "confidence",
    "within",
    "confident",
    "confident_best",
    "tasks",
    "batches",
    "profile_s",
    "raced",
    "job_regret",
    "before_best",
    "before_regret",
)
"""Per-fleet figures :func:`_fleet` collects for each objective."""


def _fleet(p: _Plan, f: int) -> dict[str, Any]:
    """Fleet ``f``: its draw, the truth once, then each setting's profiling,
    refinement, racing and figures (:data:`_FIELDS` per objective)."""
    rng = np.random.default_rng([p.seed, f])
    fleet = _draw_fleet(rng, p.min_nodes, p.max_nodes, p.unit_spread)
    step_s = np.array([vclock.step_seconds(d, p.batch_size, p.factor) for d in fleet])
    down_s = np.array(
        [vclock.transfer_seconds(p.nbytes, d.downlink_mbps) for d in fleet]
    )
    up_s = np.array([vclock.transfer_seconds(p.nbytes, d.uplink_mbps) for d in fleet])
    workload = Workload(
        mode=p.mode,
        steps=p.local_steps * len(fleet) if p.mode == "sync" else p.local_steps,
        num_rounds=p.num_rounds,
        kappa=p.kappa,
    )
    # the truth and the oracle use the true devices, never the meters' gains
    exact = _Units(fleet, step_s, down_s, up_s, np.ones(len(fleet)), p.noise)
    masks = all_masks(len(fleet))
    truth = _truth(
        np.random.default_rng([p.seed, f, 2]), exact, masks, workload, p.truth_rounds
    )
    shortlist = np.unique(
        np.concatenate(
            [np.argsort(truth[o], kind="stable")[:TRUTH_SHORTLIST] for o in OBJECTIVES]
        )
    )
    fine = _truth(
        np.random.default_rng([p.seed, f, 5]),
        exact,
        masks[shortlist],
        workload,
        p.truth_fine_rounds,
    )
    for o in OBJECTIVES:
        truth[o][shortlist] = fine[o]
    perfect = estimate_masks(_oracle_models(exact), masks, workload)
    outcomes = []
    for gain_error, objectives in p.settings:
        gain = 1 + gain_error * np.random.default_rng([p.seed, f, 3]).standard_normal(
            len(fleet)
        )
        noise = {**p.noise, "power_gain_error": gain_error}
        units = _Units(fleet, step_s, down_s, up_s, gain, noise)
        observed, probe_s = _profile(
            np.random.default_rng([p.seed, f, 1]),
            units,
            p.profile_steps,
            p.profile_max_tasks,
        )
        per: dict[str, dict[str, list[float]]] = {
            o: {name: [] for name in _FIELDS} for o in objectives
        }
        for index, objective in enumerate(objectives):
            models, profile_s, batches, seen = _refine(
                np.random.default_rng([p.seed, f, 4, index]),
                units,
                observed,
                probe_s,
                masks,
                workload,
                objective,
                p.target_confidence,
                p.profile_budget,
                p.confidence_draws,
                p.indifference,
            )
            acc = per[objective]
            acc["tasks"].append(float(np.mean([m.tasks for m in models])))
            acc["batches"].append(batches)
            acc["profile_s"].append(profile_s)
            estimated = estimate_masks(models, masks, workload)
            sure = confidence(
                models,
                workload,
                objective,
                masks,
                power_gain_error=gain_error,
                draws=p.confidence_draws,
                seed=f,
            )[objective]
            cost = truth[objective]
            best = float(cost.min())
            poly = select(models, workload, objective, search="polynomial")
            before = int(np.argmin(estimated[objective]))
            if p.mode == "sync" and p.race_share > 0:
                final, rows, raced = _race(
                    np.random.default_rng([p.seed, f, 6, index]),
                    units,
                    seen,
                    masks,
                    workload,
                    objective,
                    p.target_confidence,
                    p.indifference,
                    p.confidence_draws,
                    p.race_share,
                )
            else:
                final, rows, raced = before, [before], 0
            acc["raced"].append(raced)
            acc["job_regret"].append(100 * (float(np.mean(cost[rows])) / best - 1.0))
            for row, best_key, regret_key in (
                (final, "best", "regret"),
                (before, "before_best", "before_regret"),
                (_row(masks, poly.members), "poly_best", "poly_regret"),
                (int(np.argmin(perfect[objective])), "oracle_best", "oracle_regret"),
            ):
                regret = float(cost[row] / best - 1.0)
                acc[best_key].append(float(regret <= 1e-12))
                acc[regret_key].append(100 * regret)
            row = final
            regret = float(cost[row] / best - 1.0)
            acc["near"].append(float(regret <= NEAR_BEST))
            acc["chosen"].append(int(masks[row].sum()))
            acc["best_k"].append(int(masks[int(np.argmin(cost))].sum()))
            job = "time-to-accuracy" if objective == "time-to-accuracy" else "time"
            job_s = float(truth[job][row])
            acc["overhead"].append(100 * profile_s / (profile_s + job_s))
            acc["confidence"].append(sure.probability)
            acc["within"].append(float(sure.within_uncertainty))
            acc["confident"].append(float(sure.probability >= 0.95))
            if sure.probability >= 0.95:
                acc["confident_best"].append(acc["before_best"][-1])
        outcomes.append(
            {"probe_tasks": [len(o) for o in observed], "probe_s": probe_s, "per": per}
        )
    return {
        "size": len(fleet),
        "devices": [d.name for d in fleet],
        "outcomes": outcomes,
    }


def _summarise(
    outcomes: Sequence[dict[str, Any]], objectives: Sequence[str]
) -> dict[str, Any]:
    """One setting's ``profiling`` and ``objectives`` over its fleets' outcomes."""
    probe_tasks = [t for o in outcomes for t in o["probe_tasks"]]
    slowest_tasks = [min(o["probe_tasks"]) for o in outcomes]
    probe_times = [o["probe_s"] for o in outcomes]
    per = {
        name: {
            field: [x for o in outcomes for x in o["per"][name][field]]
            for field in _FIELDS
        }
        for name in objectives
    }
    return {
        "profiling": {
            "probe_mean_seconds": float(np.mean(probe_times)),
            "probe_mean_tasks_per_node": float(np.mean(probe_tasks)),
            "probe_min_tasks_per_node": int(np.min(probe_tasks)),
            "probe_max_tasks_per_node": int(np.max(probe_tasks)),
            "probe_mean_tasks_of_slowest_node": float(np.mean(slowest_tasks)),
        },
        "objectives": {
            o: {
                "best_fraction": float(np.mean(v["best"])),
                "near_best_fraction": float(np.mean(v["near"])),
                "mean_regret_pct": float(np.mean(v["regret"])),
                "max_regret_pct": float(np.max(v["regret"])),
                "profiling_overhead_pct": float(np.mean(v["overhead"])),
                "profiling_mean_seconds": float(np.mean(v["profile_s"])),
                "profiling_mean_tasks_per_node": float(np.mean(v["tasks"])),
                "refinement_mean_batches": float(np.mean(v["batches"])),
                "before_training_best_fraction": float(np.mean(v["before_best"])),
                "before_training_mean_regret_pct": float(np.mean(v["before_regret"])),
                "race_mean_rounds": float(np.mean(v["raced"])),
                "job_mean_regret_pct": float(np.mean(v["job_regret"])),
                "mean_nodes_chosen": float(np.mean(v["chosen"])),
                "mean_nodes_best": float(np.mean(v["best_k"])),
                "polynomial_best_fraction": float(np.mean(v["poly_best"])),
                "polynomial_mean_regret_pct": float(np.mean(v["poly_regret"])),
                "oracle_best_fraction": float(np.mean(v["oracle_best"])),
                "oracle_mean_regret_pct": float(np.mean(v["oracle_regret"])),
                "mean_confidence": float(np.mean(v["confidence"])),
                "within_uncertainty_fraction": float(np.mean(v["within"])),
                "confident_fraction": float(np.mean(v["confident"])),
                "confident_best_fraction": float(np.mean(v["confident_best"]))
                if v["confident_best"]
                else None,
            }
            for o, v in per.items()
        },
    }
