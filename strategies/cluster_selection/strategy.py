"""ClusterSelection: profile briefly, pick the best set of nodes, train on it."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from logging import INFO, WARNING

import numpy as np
from flowerbed import keys
from flowerbed.clock import Clock, clock_of
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg, Result, Strategy
from flwr.serverapp.strategy.strategy_utils import log_strategy_start_info
from flwr.supercore import log

from ..fedbuff import FedBuff
from .model import (
    MODES,
    Estimate,
    NodeModel,
    Observation,
    Workload,
    check_objective,
    estimate_masks,
    fit_node,
    pool_variances,
)
from .observe import observation_of, timed_exchange
from .refine import (
    DEFAULT_INDIFFERENCE,
    DEFAULT_PROFILE_BUDGET,
    DEFAULT_RACE_SHARE,
    DEFAULT_TARGET_CONFIDENCE,
    expected_round_trip,
    informative_nodes,
    profiling_end,
    rehearsal_steps,
    settled_confidence,
)
from .search import CONFIDENCE_DRAWS, EXHAUSTIVE_MAX_NODES, Confidence, search_masks
from .selector import (
    SELECTION_ESTIMATED_S,
    SELECTION_MEASURED_S,
    SELECTION_SIZE,
    NoCandidates,
    SelectedGrid,
    SelectionRecord,
    Selector,
)

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


class ClusterSelection(Strategy):
    """Profile each node briefly, choose the best set of nodes, train on it.

    Gu, Kong, Munir, Kim (2019) pre-train a few steps on every device, estimate
    time, power, energy and EDP of every candidate cluster configuration and train
    on the best one for the provider's preference. ``start()``:

    1. **Profiles** every connected node: a ``query`` message (flowerbed's board
       client answers with ``train-time-s``, ``num-steps`` and, where measurable,
       ``power-w``/``energy-j``); nodes that cannot answer it get two short
       training tasks of ``profile_steps`` steps instead, timed by their reply's
       ``train-time-s`` or, from plain Flower clients, by their round trip on
       :func:`flowerbed.clock.clock_of` (two lengths separate per-step time from
       per-task overhead).
    2. **Fits** per node seconds per step, per-task overhead (communication:
       ``comm-time-s`` where reported, else round trip minus train time) and busy
       and idle power (:func:`flowerbed.strategies.cluster_selection.fit_node`).
    3. **Estimates** every candidate configuration and **selects** the best for
       ``objective`` (formulas, search and what is exact:
       :mod:`flowerbed.strategies.cluster_selection.model`).
    4. **Trains** with the wrapped strategy on a :class:`SelectedGrid` that shows it
       only the chosen nodes. In synchronous mode the round's work
       (``round_steps``) is split evenly: each member's train message carries
       ``local-steps = ceil(round_steps / k)``.
    5. **Logs** estimated against measured round time every round (``sync``) or
       every ``k`` replies (``async``), adds them to the Result's train metrics
       (:data:`SELECTION_ESTIMATED_S`, :data:`SELECTION_MEASURED_S`,
       :data:`SELECTION_SIZE`), and **re-selects** when a member disconnects,
       fails ``drop_after_failures`` times in a row, or the measurement drifts
       beyond ``drift_tolerance`` (then s_i and c_i are refitted from the
       members' latest training replies first).

    Parameters
    ----------
    fraction_train, fraction_evaluate, min_train_nodes, min_evaluate_nodes, \
min_available_nodes, weighted_by_key, arrayrecord_key, configrecord_key, \
train_metrics_aggr_fn, evaluate_metrics_aggr_fn
        Flower ``FedAvg``'s arguments: they build the wrapped ``FedAvg`` when
        ``strategy`` is None and are unused otherwise.
    strategy : Strategy, optional (default: None)
        The strategy that trains on the chosen nodes (any Flower or flowerbed
        strategy); None means ``FedAvg`` with the arguments above.
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
    profile_steps : Sequence[int] (default: (1, 3))
        Steps of the timed profiling tasks; the query asks for the largest.
    use_query : bool (default: True)
        Try the board clients' profiling query before training tasks.
    profile_timeout_s : float (default: 600.0)
        Clock seconds the profiling phase may take; silent nodes are left out.
    profile_max_tasks : int (default: 32)
        Most profiling tasks one node runs: nodes that finish ``profile_steps``
        early repeat them, up to this many, until the slowest node is done.
    target_confidence : float (default: 0.99)
        Refinement (:meth:`refine`) stops once the choice is this likely to
        beat its rivals, by the fits' standard errors.
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
    drift_tolerance : float (default: 0.25)
        Relative gap between measured and estimated round time that triggers
        re-selection.
    drop_after_failures : int (default: 2)
        Consecutive failed or missing replies after which a member counts as gone.
    search : str (default: "auto")
        ``"exhaustive"``, ``"polynomial"`` or ``"auto"``.
    exhaustive_max_nodes : int (default: 12)
        ``"auto"`` searches exhaustively up to this many nodes.
    min_nodes : int, optional (default: None)
        Smallest configuration; None means the wrapped strategy's
        ``max(min_train_nodes, min_available_nodes)`` (it would wait forever for
        more nodes than it is shown).
    """

    def __init__(
        self,
        fraction_train: float = 1.0,
        fraction_evaluate: float = 1.0,
        min_train_nodes: int = 2,
        min_evaluate_nodes: int = 2,
        min_available_nodes: int = 2,
        weighted_by_key: str = keys.NUM_EXAMPLES,
        arrayrecord_key: str = keys.ARRAYS,
        configrecord_key: str = keys.CONFIG,
        train_metrics_aggr_fn: Callable[[list[RecordDict], str], MetricRecord]
        | None = None,
        evaluate_metrics_aggr_fn: Callable[[list[RecordDict], str], MetricRecord]
        | None = None,
        *,
        strategy: Strategy | None = None,
        objective: str = "time",
        mode: str | None = None,
        round_steps: int | None = None,
        kappa: float = 1.0,
        profile_steps: Sequence[int] = DEFAULT_PROFILE_STEPS,
        use_query: bool = True,
        profile_timeout_s: float = DEFAULT_PROFILE_TIMEOUT_S,
        profile_max_tasks: int = DEFAULT_PROFILE_MAX_TASKS,
        target_confidence: float = DEFAULT_TARGET_CONFIDENCE,
        profile_budget: float = DEFAULT_PROFILE_BUDGET,
        indifference: float = DEFAULT_INDIFFERENCE,
        race_share: float = DEFAULT_RACE_SHARE,
        power_gain_error: float = DEFAULT_POWER_GAIN_ERROR,
        confidence_draws: int = CONFIDENCE_DRAWS,
        drift_tolerance: float = DEFAULT_DRIFT_TOLERANCE,
        drop_after_failures: int = DEFAULT_DROP_AFTER_FAILURES,
        search: str = "auto",
        exhaustive_max_nodes: int = EXHAUSTIVE_MAX_NODES,
        min_nodes: int | None = None,
    ) -> None:
        check_objective(objective)
        if mode is not None and mode not in MODES:
            raise ValueError(
                f"unknown mode {mode!r}; valid choices: {', '.join(MODES)}"
            )
        checks = [
            (round_steps is None or round_steps >= 1, "round_steps must be >= 1"),
            (kappa >= 0, "kappa must be >= 0"),
            (
                len(profile_steps) >= 1 and min(profile_steps) >= 1,
                "profile_steps must be one or more step counts >= 1",
            ),
            (profile_timeout_s > 0, "profile_timeout_s must be > 0"),
            (
                profile_max_tasks >= len(profile_steps),
                "profile_max_tasks must be >= len(profile_steps)",
            ),
            (
                0 <= target_confidence <= 1,
                "target_confidence must be between 0 and 1",
            ),
            (profile_budget >= 0, "profile_budget must be >= 0"),
            (indifference >= 0, "indifference must be >= 0"),
            (0 <= race_share <= 1, "race_share must be between 0 and 1"),
            (power_gain_error >= 0, "power_gain_error must be >= 0"),
            (confidence_draws >= 2, "confidence_draws must be >= 2"),
            (drift_tolerance > 0, "drift_tolerance must be > 0"),
            (drop_after_failures >= 1, "drop_after_failures must be >= 1"),
            (min_nodes is None or min_nodes >= 1, "min_nodes must be >= 1"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        self.strategy = (
            strategy
            if strategy is not None
            else FedAvg(
                fraction_train=fraction_train,
                fraction_evaluate=fraction_evaluate,
                min_train_nodes=min_train_nodes,
                min_evaluate_nodes=min_evaluate_nodes,
                min_available_nodes=min_available_nodes,
                weighted_by_key=weighted_by_key,
                arrayrecord_key=arrayrecord_key,
                configrecord_key=configrecord_key,
                train_metrics_aggr_fn=train_metrics_aggr_fn,
                evaluate_metrics_aggr_fn=evaluate_metrics_aggr_fn,
            )
        )
        self.objective = objective
        self.mode = mode
        self.round_steps = round_steps
        self.kappa = kappa
        self.profile_steps = tuple(int(s) for s in profile_steps)
        self.use_query = use_query
        self.profile_timeout_s = profile_timeout_s
        self.profile_max_tasks = profile_max_tasks
        self.target_confidence = target_confidence
        self.indifference = indifference
        self.race_share = race_share
        self.profile_budget = profile_budget
        self.power_gain_error = power_gain_error
        self.confidence_draws = confidence_draws
        self.drift_tolerance = drift_tolerance
        self.drop_after_failures = drop_after_failures
        self.search = search
        self.exhaustive_max_nodes = exhaustive_max_nodes
        self.min_nodes = min_nodes
        self.node_models: dict[int, NodeModel] = {}
        """Fitted per-node models (after ``start``)."""
        self.observations: dict[int, list[Observation]] = {}
        """Every node's profiling observations (after ``start``)."""
        self._fallbacks: set[str] = set()
        self.refine_batches = 0
        """Rehearsal batches the refinement ran (after ``start``)."""
        self.profile_s = 0.0
        """Clock seconds the profiling phase took."""
        self.selection_log: list[SelectionRecord] = []
        """Estimate against measurement, every round (after ``start``)."""
        self.choice: Estimate | None = None
        """The configuration in use at the end of ``start``."""
        self.confidence: Confidence | None = None
        """How sure the last selection was (after ``start``)."""

    # --- Strategy API: the wrapped strategy decides ------------------------------
    def summary(self) -> None:
        """Log the configuration: this branch, then the wrapped strategy's."""
        log(INFO, "\t├──> ClusterSelection:")
        log(
            INFO,
            "\t│\t├── Objective %s, mode %s, profile steps %s",
            self.objective,
            self.mode or "auto",
            self.profile_steps,
        )
        log(INFO, "\t│\t└── Wrapping %s", type(self.strategy).__name__)
        self.strategy.summary()

    def fallback_once(self, what: str, message: str) -> None:
        """Log ``message`` the first time ``what`` falls back in this run."""
        if what not in self._fallbacks:
            self._fallbacks.add(what)
            log(WARNING, message)

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        return self.strategy.configure_train(server_round, arrays, config, grid)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        return self.strategy.aggregate_train(server_round, replies)

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        return self.strategy.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        return self.strategy.aggregate_evaluate(server_round, replies)

    # --- profiling -------------------------------------------------------------
    def _profile_message(
        self,
        node: int,
        query: bool,
        steps: int,
        arrays: ArrayRecord,
        train_config: ConfigRecord,
    ) -> Message:
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

    def _profile_adaptively(
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
        required = len(self.profile_steps)
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
                        self.profile_steps[done[m] : required],
                        trained(m),
                    )
                    for m in owing
                ]
            )
            steps = self.profile_steps[done[n] % required]
            return now + expected_round_trip(trained(n), steps) <= projected

        def send(targets: list[int]) -> None:
            plan = [(n, self.profile_steps[done[n] % required]) for n in targets]
            messages = [
                self._profile_message(n, False, steps, arrays, train_config)
                for n, steps in plan
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
                    done[n] < self.profile_max_tasks and fits(n, busy)
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
        adaptive training phase (:meth:`_profile_adaptively`) times every node,
        the slowest running ``profile_steps`` once while faster nodes repeat
        them.
        """
        clock = clock_of(grid)
        started = clock.now()
        deadline = started + self.profile_timeout_s
        nodes = sorted(grid.get_node_ids())
        observed: dict[int, list[Observation]] = {n: [] for n in nodes}
        if self.use_query:
            steps = max(self.profile_steps)
            replies = timed_exchange(
                grid,
                clock,
                [
                    self._profile_message(n, True, steps, arrays, train_config)
                    for n in nodes
                ],
                self.profile_timeout_s,
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
            list(self.profile_steps),
        )
        self._profile_adaptively(
            grid, clock, nodes, observed, arrays, train_config, deadline
        )
        self.observations = observed
        models = self._fit(observed)
        self.profile_s = clock.now() - started
        self._log_models(models)
        return models

    def _fit(self, observed: dict[int, list[Observation]]) -> dict[int, NodeModel]:
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
        parallel. Returns the refitted models (also ``node_models``).
        """
        clock = clock_of(grid)
        started = clock.now() - self.profile_s
        models = self.node_models
        batches = 0
        while len(models) >= min_size:
            candidates = [models[n] for n in sorted(models)]
            masks = search_masks(
                candidates,
                workload,
                min_size,
                self.search,
                exhaustive_max_nodes=self.exhaustive_max_nodes,
            )
            est = estimate_masks(candidates, masks, workload)
            row = int(np.argmin(est[self.objective]))
            tta = self.objective == "time-to-accuracy"
            job_s = float(est["time-to-accuracy" if tta else "time"][row])
            sure = settled_confidence(
                candidates,
                workload,
                self.objective,
                masks,
                target=self.target_confidence,
                indifference=self.indifference,
                draws=self.confidence_draws,
                seed=batches,
                point=est,
            )
            if sure.near_probability >= self.target_confidence:
                log(
                    INFO,
                    "ClusterSelection: choice settled after %d rehearsal batch(es): "
                    "%.1f%% sure, from the fits' errors, that it is within %.2g%% "
                    "of the best (target %.0f%%)",
                    batches,
                    100 * sure.near_probability,
                    100 * self.indifference,
                    100 * self.target_confidence,
                )
                break
            chosen = int(masks[row].sum())
            targets = informative_nodes(candidates, workload, self.objective, sure)
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
            if not plan or spent + expected > self.profile_budget * job_s:
                log(
                    INFO,
                    "ClusterSelection: refinement stopped at %.1f%% sure after %d "
                    "batch(es): %s",
                    100 * sure.near_probability,
                    batches,
                    "no node to measure"
                    if not plan
                    else f"another batch (~{expected:.3g}s) would take profiling "
                    f"past {100 * self.profile_budget:.0f}% of the estimated job "
                    f"({job_s:.4g}s)",
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
                    self._profile_message(n, False, steps, arrays, train_config)
                    for n, steps in plan.items()
                ],
                self.profile_timeout_s,
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
            models = self._fit(self.observations)
        self.node_models = models
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

    def workload(
        self, train_config: ConfigRecord, num_rounds: int, num_nodes: int
    ) -> Workload:
        """The job the configurations are estimated for (see ``round_steps``)."""
        mode = self.mode or ("async" if isinstance(self.strategy, FedBuff) else "sync")
        local = train_config.get(keys.LOCAL_STEPS)
        local_steps = int(local) if isinstance(local, int) else None
        if mode == "sync":
            steps = self.round_steps or (
                local_steps * num_nodes if local_steps is not None else None
            )
        else:
            steps = local_steps
        split = steps is not None
        if steps is None:
            steps = max(self.profile_steps)
            self.fallback_once(
                "workload",
                "ClusterSelection: no 'local-steps' in train_config"
                + (" and no round_steps" if mode == "sync" else "")
                + f": estimating each task as {steps} steps (the longest profiling "
                "task) and leaving each node's work to its ClientApp; set "
                "'local-steps' for estimates of the work you assign",
            )
        buffer = getattr(self.strategy, "buffer_size", None)
        return Workload(
            mode=mode,
            steps=steps,
            num_rounds=num_rounds,
            buffer_size=buffer if isinstance(buffer, int) else None,
            kappa=self.kappa,
            split=split,
        )

    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int = 3,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
    ) -> Result:
        """Profile, select, train with the wrapped strategy; FedAvg's contract."""
        log(INFO, "Starting ClusterSelection strategy:")
        log_strategy_start_info(
            num_rounds, initial_arrays, train_config, evaluate_config
        )
        self.summary()
        log(INFO, "")
        train_config = ConfigRecord() if train_config is None else train_config
        self.node_models = self.profile(grid, initial_arrays, train_config)
        workload = self.workload(train_config, num_rounds, len(self.node_models))
        min_size = self.min_nodes or max(
            int(getattr(self.strategy, "min_train_nodes", 1)),
            int(getattr(self.strategy, "min_available_nodes", 1)),
        )
        self.refine(grid, initial_arrays, train_config, workload, min_size)
        try:
            selector = Selector(
                self, self.node_models, workload, min_size, clock_of(grid)
            )
        except NoCandidates as err:
            log(
                WARNING,
                "ClusterSelection: %s: training on every connected node, without "
                "a selection",
                err,
            )
            return self.strategy.start(
                grid=grid,
                initial_arrays=initial_arrays,
                num_rounds=num_rounds,
                timeout=timeout,
                train_config=train_config,
                evaluate_config=evaluate_config,
                evaluate_fn=evaluate_fn,
            )
        self.selection_log = selector.records
        result = self.strategy.start(
            grid=SelectedGrid(grid, selector),
            initial_arrays=initial_arrays,
            num_rounds=num_rounds,
            timeout=timeout,
            train_config=train_config,
            evaluate_config=evaluate_config,
            evaluate_fn=evaluate_fn,
        )
        selector.close_batch()
        self.choice = selector.choice
        self.confidence = selector.confidence
        if workload.mode == "sync":
            for record in selector.records:
                metrics = result.train_metrics_clientapp.get(record.round)
                if metrics is None:
                    continue
                metrics[SELECTION_ESTIMATED_S] = record.estimated_s
                metrics[SELECTION_SIZE] = len(record.members)
                if record.measured_s is not None:
                    metrics[SELECTION_MEASURED_S] = record.measured_s
        return result
