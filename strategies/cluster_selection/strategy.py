"""ClusterSelection: profile briefly, pick the best set of nodes, train on it."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from logging import INFO, WARNING
from typing import Any, ClassVar

from flowerbed import keys
from flowerbed.clock import clock_of
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg, Result, Strategy
from flwr.serverapp.strategy.strategy_utils import log_strategy_start_info
from flwr.supercore import log

from ..fedbuff import FedBuff
from ..options import adopt_declared
from ..rounds import RoundLoop, flower_start_signature, start_arguments
from ..wrappers import _RunsTheWrappedLoop, wrapped_loop
from .model import Estimate, NodeModel, Observation, Workload
from .profiling import Profiler
from .search import Confidence
from .selection_options import Certainty, Profiling, SelectionGoal, Tracking
from .selector import (
    SELECTION_ESTIMATED_S,
    SELECTION_MEASURED_S,
    SELECTION_SIZE,
    NoCandidates,
    SelectedGrid,
    SelectionRecord,
    Selector,
)


def round_loop_of(strategy: Strategy) -> RoundLoop | None:
    """The flowerbed round loop whose ``start()`` runs ``strategy``'s rounds:
    the strategy itself, the one inside a flowerbed differential-privacy wrapper
    (:mod:`flowerbed.strategies.wrappers`), or None (Flower's own loop runs)."""
    if isinstance(strategy, RoundLoop):
        return strategy
    if isinstance(strategy, _RunsTheWrappedLoop):
        return wrapped_loop(strategy)
    return None


class ClusterSelection(Strategy):
    """Profile each node briefly, choose the best set of nodes, train on it.

    Gu, Kong, Munir, Kim (2019) pre-train a few steps on every device, estimate
    time, power, energy and EDP of every candidate cluster configuration and train
    on the best one for the provider's preference. ``start()`` is the wrapped
    strategy's start with this selection as its
    :class:`~flowerbed.strategies.rounds.RunScope`: before the rounds it

    1. **profiles** every connected node: a ``query`` message (flowerbed's board
       client answers with ``train-time-s``, ``num-steps`` and, where measurable,
       ``power-w``/``energy-j``); nodes that cannot answer it get two short
       training tasks of ``profile_steps`` steps instead, timed by their reply's
       ``train-time-s`` or, from plain Flower clients, by their round trip on
       :func:`flowerbed.clock.clock_of` (:class:`~.profiling.Profiler`);
    2. **fits** per node seconds per step, per-task overhead and busy and idle
       power (:func:`flowerbed.strategies.cluster_selection.fit_node`), and
       refines the fits of the nodes the choice hinges on (:meth:`refine`);
    3. **estimates** every candidate configuration and **selects** the best for
       ``objective`` (:mod:`flowerbed.strategies.cluster_selection.model`);

    then the rounds **train** on a :class:`SelectedGrid` that shows the wrapped
    strategy only the chosen nodes (synchronous mode splits the round's work:
    ``local-steps = ceil(round_steps / k)``), **log** estimated against measured
    round time, add them to the Result's train metrics
    (:data:`SELECTION_ESTIMATED_S`, :data:`SELECTION_MEASURED_S`,
    :data:`SELECTION_SIZE`), and **re-select** when a member disconnects, fails
    ``drop_after_failures`` times in a row, or drifts beyond ``drift_tolerance``.
    A wrapped strategy that is not a flowerbed round loop (Flower's ``FedAvg``)
    runs its rounds with its own ``start()`` on that grid, as logged.

    Parameters
    ----------
    *args, **kwargs
        Flower ``FedAvg``'s arguments (``fraction_train``, …,
        ``evaluate_metrics_aggr_fn``): they build the wrapped ``FedAvg`` when
        ``strategy`` is None and are unused otherwise.
    strategy : Strategy, optional (default: None)
        The strategy that trains on the chosen nodes (any Flower or flowerbed
        strategy); None means ``FedAvg`` with the arguments above.
    goal : SelectionGoal (default: SelectionGoal())
        What is optimised (``objective``, ``mode``, ``round_steps``, ``kappa``),
        over which configurations (``search``, ``exhaustive_max_nodes``,
        ``min_nodes``).
    profiling : Profiling (default: Profiling())
        The timed profiling tasks (``profile_steps``, ``use_query``,
        ``profile_timeout_s``, ``profile_max_tasks``).
    certainty : Certainty (default: Certainty())
        How sure the choice must be (``target_confidence``, ``profile_budget``,
        ``indifference``, ``race_share``, ``power_gain_error``,
        ``confidence_draws``).
    tracking : Tracking (default: Tracking())
        When training re-selects (``drift_tolerance``, ``drop_after_failures``).
    """

    OPTION_DEFAULTS: ClassVar[Mapping[str, Any]] = {
        "goal": SelectionGoal(),
        "profiling": Profiling(),
        "certainty": Certainty(),
        "tracking": Tracking(),
    }
    goal: SelectionGoal
    profiling: Profiling
    certainty: Certainty
    tracking: Tracking

    def __init__(
        self, *args: Any, strategy: Strategy | None = None, **kwargs: Any
    ) -> None:
        adopt_declared(self, kwargs)
        self.strategy = FedAvg(*args, **kwargs) if strategy is None else strategy
        self.profiler = Profiler(self.profiling, self.certainty, self.goal)
        """The profiling phase: observations, fits, rehearsals."""
        self.node_models: dict[int, NodeModel] = {}
        """Fitted per-node models (after ``start``)."""
        self._fallbacks: set[str] = set()
        self.selection_log: list[SelectionRecord] = []
        """Estimate against measurement, every round (after ``start``)."""
        self.choice: Estimate | None = None
        """The configuration in use at the end of ``start``."""
        self.confidence: Confidence | None = None
        """How sure the last selection was (after ``start``)."""
        self._selector: Selector | None = None

    @property
    def observations(self) -> dict[int, list[Observation]]:
        """Every node's profiling observations (after ``start``)."""
        return self.profiler.observations

    @property
    def refine_batches(self) -> int:
        """Rehearsal batches the refinement ran (after ``start``)."""
        return self.profiler.refine_batches

    @property
    def profile_s(self) -> float:
        """Clock seconds the profiling phase took."""
        return self.profiler.profile_s

    # --- Strategy API: the wrapped strategy decides ------------------------------
    def summary(self) -> None:
        """Log the configuration: this branch, then the wrapped strategy's."""
        log(INFO, "\t├──> ClusterSelection:")
        log(
            INFO,
            "\t│\t├── Objective %s, mode %s, profile steps %s",
            self.goal.objective,
            self.goal.mode or "auto",
            self.profiling.profile_steps,
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

    # --- profiling and selection ------------------------------------------------
    def profile(
        self, grid: Grid, arrays: ArrayRecord, train_config: ConfigRecord
    ) -> dict[int, NodeModel]:
        """Time every connected node and fit its model (:meth:`Profiler.profile`)."""
        return self.profiler.profile(grid, arrays, train_config)

    def refine(
        self,
        grid: Grid,
        arrays: ArrayRecord,
        train_config: ConfigRecord,
        workload: Workload,
        min_size: int,
    ) -> dict[int, NodeModel]:
        """Rehearse the nodes the choice hinges on until it is sure enough
        (:meth:`Profiler.refine`); returns the refitted models (also
        ``node_models``)."""
        self.node_models = self.profiler.refine(
            grid, arrays, train_config, workload, min_size, self.node_models
        )
        return self.node_models

    def workload(
        self, train_config: ConfigRecord, num_rounds: int, num_nodes: int
    ) -> Workload:
        """The job the configurations are estimated for (see ``round_steps``)."""
        mode = self.goal.mode or (
            "async" if isinstance(self.strategy, FedBuff) else "sync"
        )
        local = train_config.get(keys.LOCAL_STEPS)
        local_steps = int(local) if isinstance(local, int) else None
        if mode == "sync":
            steps = self.goal.round_steps or (
                local_steps * num_nodes if local_steps is not None else None
            )
        else:
            steps = local_steps
        split = steps is not None
        if steps is None:
            steps = max(self.profiling.profile_steps)
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
            kappa=self.goal.kappa,
            split=split,
        )

    def open(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int,
        train_config: ConfigRecord | None,
        evaluate_config: ConfigRecord | None,
    ) -> Grid:
        """The run's prologue: profile, refine, select; the grid the rounds use.

        A :class:`SelectedGrid` of the choice, or ``grid`` itself when no node
        answered profiling usably (then every connected node trains, as logged).
        """
        log(INFO, "Starting ClusterSelection strategy:")
        log_strategy_start_info(
            num_rounds, initial_arrays, train_config, evaluate_config
        )
        self.summary()
        log(INFO, "")
        train_config = ConfigRecord() if train_config is None else train_config
        self.node_models = self.profile(grid, initial_arrays, train_config)
        workload = self.workload(train_config, num_rounds, len(self.node_models))
        min_size = self.goal.min_nodes or max(
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
            return grid
        self._selector = selector
        self.selection_log = selector.records
        return SelectedGrid(grid, selector)

    def close(self, result: Result) -> Result:
        """The run's epilogue: the last choice, and in synchronous mode each
        round's estimate, measurement and size in its train metrics."""
        selector, self._selector = self._selector, None
        if selector is None:
            return result
        selector.close_batch()
        self.choice = selector.choice
        self.confidence = selector.confidence
        if selector.workload.mode == "sync":
            for record in selector.records:
                metrics = result.train_metrics_clientapp.get(record.round)
                if metrics is None:
                    continue
                metrics[SELECTION_ESTIMATED_S] = record.estimated_s
                metrics[SELECTION_SIZE] = len(record.members)
                if record.measured_s is not None:
                    metrics[SELECTION_MEASURED_S] = record.measured_s
        return result

    @flower_start_signature
    def start(self, *args: Any, **kwargs: Any) -> Result:
        """The wrapped strategy's start with this selection around the run.

        A flowerbed round loop (:class:`~flowerbed.strategies.rounds.RoundLoop`,
        also inside a flowerbed wrapper, :func:`round_loop_of`) opens this
        selection as its ``run_scope``; any other strategy's own
        ``start()`` runs the rounds on the selected grid, between :meth:`open`
        and :meth:`close`, and the log says so.
        """
        run = start_arguments(*args, **kwargs)
        if run["train_config"] is None:
            run["train_config"] = ConfigRecord()
        inner = self.strategy
        looped = round_loop_of(inner)
        if looped is not None:
            looped.run_scope = self
        else:
            log(
                WARNING,
                "ClusterSelection: %s is not a flowerbed round loop: its own "
                "start() runs the rounds on the selected nodes (no flowerbed round "
                "hooks, clock or checkpoints); selection profiles before and adds "
                "its metrics after, as for a flowerbed strategy",
                type(inner).__name__,
            )
            run["grid"] = self.open(
                run["grid"],
                run["initial_arrays"],
                run["num_rounds"],
                run["train_config"],
                run["evaluate_config"],
            )
        try:
            result = inner.start(**run)
        finally:
            if looped is not None:
                looped.run_scope = None
        return result if looped is not None else self.close(result)
