"""Profiling and refinement: the timed tasks that fit every node's model.

:class:`Profiler` runs ClusterSelection's profiling phase on a Flower Grid (the
query, then adaptive training tasks, :meth:`Profiler.profile`), fits and pools the
node models (:meth:`Profiler.fit`), and rehearses the nodes the choice hinges on
until it is sure enough (:meth:`Profiler.refine`). It keeps every observation, so
racing during training (:class:`~.selector.Selector`) refits from them too.
"""

from __future__ import annotations

from logging import INFO, WARNING

import numpy as np
from flowerbed import keys
from flowerbed.clock import Clock, clock_of
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid
from flwr.supercore import log

from .model import (
    NodeModel,
    Observation,
    Workload,
    estimate_masks,
    fit_node,
    pool_variances,
)
from .observe import observation_of, timed_exchange
from .refine import (
    expected_round_trip,
    informative_nodes,
    profiling_end,
    rehearsal_steps,
    settled_confidence,
)
from .search import search_masks
from .selection_options import Certainty, Profiling, SelectionGoal


class Profiler:
    """The profiling phase's settings, every node's observations, and its cost."""

    def __init__(
        self, profiling: Profiling, certainty: Certainty, goal: SelectionGoal
    ) -> None:
        self.profiling = profiling
        self.certainty = certainty
        self.goal = goal
        self.observations: dict[int, list[Observation]] = {}
        """Every node's observations: profiling, rehearsals, racing's replies."""
        self.profile_s = 0.0
        """Clock seconds the profiling phase took (probe and refinement)."""
        self.refine_batches = 0
        """Rehearsal batches the refinement ran."""

    def message(
        self,
        node: int,
        query: bool,
        steps: int,
        arrays: ArrayRecord,
        train_config: ConfigRecord,
    ) -> Message:
        """``node``'s profiling query (``query``) or training task of ``steps``."""
        if query:
            config = ConfigRecord({keys.PROFILE_STEPS: steps})
            return Message(
                RecordDict({keys.ARRAYS: arrays, keys.CONFIG: config}),
                node,
                MessageType.QUERY,
            )
        config = ConfigRecord(dict(train_config))
        config.pop(keys.DEADLINE_S, None)
        config[keys.LOCAL_STEPS] = steps
        config[keys.SERVER_ROUND] = 0
        return Message(
            RecordDict({keys.ARRAYS: arrays, keys.CONFIG: config}),
            node,
            MessageType.TRAIN,
        )

    def _adaptively(
        self,
        grid: Grid,
        clock: Clock,
        nodes: list[int],
        observed: dict[int, list[Observation]],
        arrays: ArrayRecord,
        train_config: ConfigRecord,
        deadline: float,
    ) -> None:
        """Every node trains ``profile_steps``; early finishers repeat until all have.

        Training tasks, because only they move the model both ways (a query's
        reply carries no model, so it cannot time the upload). A node that has
        done its ``len(profile_steps)`` tasks gets another (cycling through
        ``profile_steps``, at most ``profile_max_tasks`` in all) as long as
        another node has not, and only if it expects to finish before the
        nodes still owing tasks do
        (:func:`~flowerbed.strategies.cluster_selection.profiling_end`, from the
        replies so far; a node that would not is done). The phase ends when the
        last task in flight returns, so its length is set by the slowest node.
        A failed reply, or silence until ``deadline``, ends a node's profiling.
        """
        required = len(self.profiling.profile_steps)
        flight: dict[str, tuple[int, int, float]] = {}
        stopped: set[int] = set()
        done = dict.fromkeys(nodes, 0)

        def trained(n: int) -> list[Observation]:
            return [o for o in observed[n] if o.transfers == 2]

        def fits(n: int, busy: dict[int, tuple[int, float]]) -> bool:
            """Another task on ``n`` ends before the nodes still owing tasks."""
            owing = [m for m in nodes if m not in stopped and done[m] < required]
            if not owing:
                return False
            now = clock.now()
            projected = profiling_end(
                [
                    (
                        busy[m][1] if m in busy else now,
                        self.profiling.profile_steps[done[m] : required],
                        trained(m),
                    )
                    for m in owing
                ]
            )
            steps = self.profiling.profile_steps[done[n] % required]
            return now + expected_round_trip(trained(n), steps) <= projected

        def send(targets: list[int]) -> None:
            plan = [
                (n, self.profiling.profile_steps[done[n] % required]) for n in targets
            ]
            messages = [
                self.message(n, False, steps, arrays, train_config) for n, steps in plan
            ]
            now = clock.now()
            for (n, steps), mid in zip(plan, grid.push_messages(messages), strict=True):
                flight[mid] = (n, steps, now)

        send(nodes)
        while flight:
            for reply in grid.pull_messages(list(flight)):
                node, steps, sent = flight.pop(reply.metadata.reply_to_message_id)
                obs = observation_of(reply, clock.now() - sent, steps, 2)
                if obs is None:
                    stopped.add(node)
                    continue
                observed[node].append(obs)
                done[node] += 1
            busy = {n: (steps, sent) for n, steps, sent in flight.values()}
            idle = []
            for n in nodes:
                if n in busy or n in stopped:
                    continue
                if done[n] < required or (
                    done[n] < self.profiling.profile_max_tasks and fits(n, busy)
                ):
                    idle.append(n)
                else:
                    stopped.add(n)
            if idle and clock.now() < deadline:
                send(idle)
            remaining = deadline - clock.now()
            if not flight or remaining <= 0:
                break
            clock.wait(remaining)

    def profile(
        self,
        grid: Grid,
        arrays: ArrayRecord,
        train_config: ConfigRecord,
    ) -> dict[int, NodeModel]:
        """Time every connected node (query, then training tasks); fit models.

        The query (when ``use_query``) adds a compute and power sample; the
        adaptive training phase (:meth:`_adaptively`) times every node,
        the slowest running ``profile_steps`` once while faster nodes repeat
        them.
        """
        clock = clock_of(grid)
        started = clock.now()
        deadline = started + self.profiling.profile_timeout_s
        nodes = sorted(grid.get_node_ids())
        observed: dict[int, list[Observation]] = {n: [] for n in nodes}
        if self.profiling.use_query:
            steps = max(self.profiling.profile_steps)
            replies = timed_exchange(
                grid,
                clock,
                [self.message(n, True, steps, arrays, train_config) for n in nodes],
                self.profiling.profile_timeout_s,
            )
            for node, (reply, rtt) in replies.items():
                obs = observation_of(reply, rtt, steps, 1)
                if obs is not None and obs.train_time_s is not None:
                    observed[node].append(obs)
        log(
            INFO,
            "ClusterSelection: %d of %d node(s) answered the profiling query; "
            "timing %s training steps on every node, repeated by early finishers",
            sum(1 for n in nodes if observed[n]),
            len(nodes),
            list(self.profiling.profile_steps),
        )
        self._adaptively(grid, clock, nodes, observed, arrays, train_config, deadline)
        self.observations = observed
        models = self.fit(observed)
        self.profile_s = clock.now() - started
        self._log_models(models)
        return models

    def fit(self, observed: dict[int, list[Observation]]) -> dict[int, NodeModel]:
        """Fit every node that answered, then pool variances over the fleet."""
        fitted: list[NodeModel] = []
        for node, observations in sorted(observed.items()):
            if not observations:
                log(WARNING, "ClusterSelection: node %s never answered; left out", node)
                continue
            try:
                fitted.append(fit_node(node, observations))
            except ValueError as err:
                log(WARNING, "ClusterSelection: %s; left out", err)
        return {m.node_id: m for m in pool_variances(fitted)}

    def _log_models(self, models: dict[int, NodeModel]) -> None:
        for m in models.values():
            log(
                INFO,
                "ClusterSelection: node %s: %d tasks, %.4g ± %.2g s/step, "
                "%.3g ± %.2g s overhead (task sd %.2g s at 1 step), busy %s W, "
                "idle %s W",
                m.node_id,
                m.tasks,
                m.step_s,
                m.step_se,
                m.overhead_s,
                m.overhead_se,
                float(m.task_mean_sd(1)[1]),
                "?" if m.busy_w is None else f"{m.busy_w:.3g}",
                "?" if m.idle_w is None else f"{m.idle_w:.3g}",
            )
        log(
            INFO,
            "ClusterSelection: profiling took %.3gs so far (%d tasks on %d nodes)",
            self.profile_s,
            sum(m.tasks for m in models.values()),
            len(models),
        )

    def refine(
        self,
        grid: Grid,
        arrays: ArrayRecord,
        train_config: ConfigRecord,
        workload: Workload,
        min_size: int,
        models: dict[int, NodeModel],
    ) -> dict[int, NodeModel]:
        """Rehearse the nodes the choice hinges on until it is sure enough.

        While the probability, from what more profiling can shrink (the fits'
        standard errors; the sensor calibration error is left out, no number of
        samples removes it), that the choice is within ``indifference`` of the
        best is below ``target_confidence``, and the
        profiling phase would still end within ``profile_budget`` x the
        choice's estimated job, the nodes behind most of the uncertainty of the
        choice against its rivals
        (:func:`~flowerbed.strategies.cluster_selection.informative_nodes`) each
        run one rehearsal: a training task of the length a member would run
        (:func:`~flowerbed.strategies.cluster_selection.rehearsal_steps`), in
        parallel, starting from ``models``. Returns the refitted models.
        """
        clock = clock_of(grid)
        started = clock.now() - self.profile_s
        batches = 0
        while len(models) >= min_size:
            candidates = [models[n] for n in sorted(models)]
            masks = search_masks(
                candidates,
                workload,
                min_size,
                self.goal.search,
                exhaustive_max_nodes=self.goal.exhaustive_max_nodes,
            )
            est = estimate_masks(candidates, masks, workload)
            row = int(np.argmin(est[self.goal.objective]))
            tta = self.goal.objective == "time-to-accuracy"
            job_s = float(est["time-to-accuracy" if tta else "time"][row])
            sure = settled_confidence(
                candidates,
                workload,
                self.goal.objective,
                masks,
                target=self.certainty.target_confidence,
                indifference=self.certainty.indifference,
                draws=self.certainty.confidence_draws,
                seed=batches,
                point=est,
            )
            if sure.near_probability >= self.certainty.target_confidence:
                log(
                    INFO,
                    "ClusterSelection: choice settled after %d rehearsal batch(es): "
                    "%.1f%% sure, from the fits' errors, that it is within %.2g%% "
                    "of the best (target %.0f%%)",
                    batches,
                    100 * sure.near_probability,
                    100 * self.certainty.indifference,
                    100 * self.certainty.target_confidence,
                )
                break
            chosen = int(masks[row].sum())
            targets = informative_nodes(candidates, workload, self.goal.objective, sure)
            plan = {n: rehearsal_steps(models[n], workload, chosen) for n in targets}
            expected = max(
                (
                    expected_round_trip(
                        [o for o in self.observations[n] if o.transfers == 2], steps
                    )
                    for n, steps in plan.items()
                ),
                default=0.0,
            )
            spent = clock.now() - started
            budget = self.certainty.profile_budget
            if not plan or spent + expected > budget * job_s:
                log(
                    INFO,
                    "ClusterSelection: refinement stopped at %.1f%% sure after %d "
                    "batch(es): %s",
                    100 * sure.near_probability,
                    batches,
                    "no node to measure"
                    if not plan
                    else f"another batch (~{expected:.3g}s) would take profiling "
                    f"past {100 * budget:.0f}% of the estimated job ({job_s:.4g}s)",
                )
                break
            log(
                INFO,
                "ClusterSelection: %.1f%% sure; rehearsing nodes %s (%s steps)",
                100 * sure.near_probability,
                list(plan),
                sorted(set(plan.values())),
            )
            replies = timed_exchange(
                grid,
                clock,
                [
                    self.message(n, False, steps, arrays, train_config)
                    for n, steps in plan.items()
                ],
                self.profiling.profile_timeout_s,
            )
            for node, steps in plan.items():
                answer = replies.get(node)
                obs = (
                    None
                    if answer is None
                    else observation_of(answer[0], answer[1], steps, 2)
                )
                if obs is None:
                    log(
                        WARNING,
                        "ClusterSelection: node %s failed its rehearsal; left out",
                        node,
                    )
                    self.observations[node] = []
                else:
                    self.observations[node].append(obs)
            batches += 1
            models = self.fit(self.observations)
        self.profile_s = clock.now() - started
        self.refine_batches = batches
        log(
            INFO,
            "ClusterSelection: profiling took %.3gs in all (%d tasks on %d nodes, "
            "%d rehearsal batch(es))",
            self.profile_s,
            sum(m.tasks for m in models.values()),
            len(models),
            batches,
        )
        return models
