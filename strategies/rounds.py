"""The round loop the flowerbed strategies share: Flower's template method on a clock.

:meth:`RoundLoop.start` does what Flower's ``Strategy.start`` does -- every round it
calls ``configure_train``, ``aggregate_train``, ``configure_evaluate``,
``aggregate_evaluate`` and ``evaluate_fn``, and logs Flower's lines and summary --
but pushes messages and hands ``aggregate_train`` the replies as they arrive, on the
grid's clock (:func:`flowerbed.clock.clock_of`). Around those calls it keeps what a
subclass needs to decide when a round closes (:class:`~.inflight.Arrival` per reply),
warns when no update has been applied for :data:`STALL_ROUNDS` rounds, and writes and
resumes checkpoints. Subclasses fill in the hooks: ``_check_initial``,
``_prepare_run``, ``_prepare_round``, ``_train_stage`` (a round's work: the
asynchronous FedBuff fills a buffer here, the jobs that span devices run a
segment round, :class:`~flowerbed.strategies.span.SpanJobStrategy`),
``_train_replies``, ``_close_train``, ``_evaluate_stage``, ``_evaluate_wait``,
``_central_evaluation``, ``_after_round``, ``_write_checkpoint``, ``_finish_run``,
``_resume``, ``_stall_cause``, ``state``/``load_state``; a round that sets
``_stop`` ends the run. Around the whole run, a :class:`RunScope` set as
``run_scope`` opens first (it may exchange messages of its own and returns the
grid the rounds use: ClusterSelection profiles and selects there) and closes last
(it may add to the Result).
"""

from __future__ import annotations

import inspect
import io
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from logging import ERROR, INFO, WARNING
from pathlib import Path
from typing import Any, Protocol, TypeVar

import numpy as np
from flowerbed.clock import Clock, WallClock, clock_of
from flowerbed.strategies.accumulation import to_arrayrecord, to_numpy
from flowerbed.strategies.checkpoints import check_writable
from flowerbed.strategies.inflight import Arrival, InFlight, ReplyStream, Ticket
from flowerbed.strategies.round_checkpoint import RoundCheckpoint
from flowerbed.strategies.round_metrics import ROUND_CLOCK_S
from flowerbed.strategies.stalls import (
    STALL_ROUNDS,
    RoundTally,
    stall_cause,
    warn_never_trained,
    warn_stalled,
)
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg, Result, Strategy
from flwr.serverapp.strategy.strategy_utils import log_strategy_start_info
from flwr.supercore import log

__all__ = [  # the names this module held before the stall tally moved out
    "MIN_MESSAGE_TTL_S",
    "STALL_ROUNDS",
    "EvaluateFn",
    "RoundLoop",
    "RoundTally",
    "RunScope",
    "TrainAggregate",
    "flower_start_signature",
    "start_arguments",
]

MIN_MESSAGE_TTL_S = 1.0
"""Shortest message time-to-live the strategies set (Flower refuses TTL <= 0)."""
TrainAggregate = tuple[ArrayRecord | None, MetricRecord | None]
"""What ``aggregate_train`` returns: the new model and the round's metrics (None
when the round gives no update)."""
EvaluateFn = Callable[[int, ArrayRecord], MetricRecord | None]
"""``start()``'s ``evaluate_fn``: the round and the global model to its metrics."""


_Method = TypeVar("_Method", bound=Callable[..., Any])


def start_arguments(*args: Any, **kwargs: Any) -> dict[str, Any]:
    """The arguments of one call of Flower's ``Strategy.start``, by name, with its
    defaults applied (a strategy whose ``start()`` hands the run on reads them
    here); arguments that ``Strategy.start`` would refuse raise its TypeError."""
    bound = inspect.signature(Strategy.start).bind(None, *args, **kwargs)
    bound.apply_defaults()
    named = dict(bound.arguments)
    del named["self"]
    return named


def flower_start_signature(method: _Method) -> _Method:
    """Shows a ``start(self, *args, **kwargs)`` that hands the run on with Flower's
    ``Strategy.start`` signature (``help()``, ``inspect.signature``)."""
    method.__signature__ = inspect.signature(Strategy.start)  # type: ignore[attr-defined]
    return method


class RunScope(Protocol):
    """What runs around one whole :meth:`RoundLoop.start` (``run_scope``)."""

    def open(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int,
        train_config: ConfigRecord | None,
        evaluate_config: ConfigRecord | None,
    ) -> Grid:
        """Run first, before anything is logged or sent; return the rounds' grid."""
        ...

    def close(self, result: Result) -> Result:
        """Run last, after Flower's closing lines; return the run's Result."""
        ...


class RoundLoop(FedAvg):
    """FedAvg's template method on the grid's clock (see the module docstring)."""

    run_scope: RunScope | None = None
    """Opened before and closed after the run (None: nothing around it)."""

    def _init_loop(self, checkpoint_path: str | Path | None) -> None:
        """The loop's state; a subclass's ``__init__`` calls this once."""
        self.checkpoint_path = (
            None if checkpoint_path is None else Path(checkpoint_path)
        )
        self._global: ArrayRecord = ArrayRecord()
        self._global_np: dict[str, np.ndarray] = {}
        self._timeout = 3600.0
        self._inflight: InFlight | None = None
        self._clock: Clock = WallClock()
        self._t0 = self._wall_t0 = 0.0
        self._arrivals: dict[str, Arrival] = {}
        """Replies handed to aggregate_train this round, by reply_to_message_id."""
        self._handed: list[Arrival] = []
        self._sent = 0
        self._tally = RoundTally(0, 0, Counter(), 0, 0)
        self._stalled = 0
        self._updates_applied = 0
        self._num_rounds = 0
        self._stop = False
        """Set by a round's hook to end the run: after ``_train_stage``, before
        the round's evaluation; after ``_after_round``, once the round is done."""
        self._driver: Strategy = self
        """Whose ``configure_*``/``aggregate_*`` the loop calls: this strategy,
        or a Flower wrapper around it (:meth:`start_wrapped`)."""
        self._running = False
        self._driven_elsewhere_said = False

    def state(self) -> dict[str, Any]:
        """JSON-able strategy state (what a checkpoint holds besides arrays)."""
        return {}

    def load_state(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state` returned."""

    def _set_global(self, arrays: ArrayRecord) -> None:
        if arrays is not self._global:
            self._global = arrays
            self._global_np = to_numpy(arrays)

    # -------------------------------------------------------------------- rounds
    def _elapsed(self) -> float:
        """Clock seconds since this run started (virtual seconds in simulation)."""
        return self._clock.now() - self._t0

    def _hand_over(
        self,
        reply: Message,
        ticket: Ticket,
        arrived: float,
        base: Mapping[str, np.ndarray],
        staleness: int = 0,
        discount: float = 1.0,
        update_scale: float = 1.0,
    ) -> Message:
        """File the reply's :class:`Arrival` for ``aggregate_train``; return it."""
        arrival = Arrival(
            ticket,
            arrived,
            base,
            staleness,
            discount,
            update_scale,
            error_code=reply.error.code if reply.has_error() else None,
        )
        self._arrivals[reply.metadata.reply_to_message_id] = arrival
        self._handed.append(arrival)
        return reply

    def _aggregate_train(
        self, server_round: int, replies: Iterator[Message]
    ) -> TrainAggregate:
        """``aggregate_train`` of the driver over the replies as they arrive.

        A Flower wrapper (:meth:`start_wrapped`) gets a list of the replies with
        content: Flower's differential-privacy wrappers read the replies more
        than once and skip a whole round's aggregation when any reply is an
        error, while here a node that dropped out or missed its deadline is
        routine (the loop has filed every reply's :class:`~.inflight.Arrival`,
        errors included, before this filter). Whatever the wrapper raises ends
        the round without an update, logged, never the run.
        """
        if self._driver is self:
            return self.aggregate_train(server_round, ReplyStream(replies))
        kept = [reply for reply in replies if not reply.has_error()]
        try:
            return self._driver.aggregate_train(server_round, kept)
        except Exception as err:  # a wrapper's fault must not end the run
            log(
                ERROR,
                "round %d: %s.aggregate_train failed (%s: %s): the model is "
                "unchanged this round",
                server_round,
                type(self._driver).__name__,
                type(err).__name__,
                err,
            )
            return None, None

    def _say_if_driven_elsewhere(self) -> None:
        """Warn once when another loop calls the Flower methods (e.g. Flower's
        ``Strategy.start`` of a wrapper): this strategy's own round behaviour
        then does not run."""
        if self._running or self._driven_elsewhere_said:
            return
        self._driven_elsewhere_said = True
        log(
            WARNING,
            "%s is being run by another strategy's start() (for example a Flower "
            "wrapper such as DifferentialPrivacyServerSideFixedClipping): its "
            "rounds are then plain FedAvg rounds that wait for every sampled node "
            "or the timeout; its deadlines, late updates, asynchrony and work "
            "balancing do not run. Use the wrapper of the same name from "
            "flowerbed.strategies (or %s.start_wrapped(wrapper, ...)) to keep them.",
            type(self).__name__,
            type(self).__name__,
        )

    def start_wrapped(self, wrapper: Strategy, *args: Any, **kwargs: Any) -> Result:
        """:meth:`start` (same arguments), with ``wrapper``'s four Flower methods in
        the loop.

        ``wrapper`` is a Flower strategy wrapper around this strategy (it calls
        this strategy's methods from its own, as Flower's differential-privacy
        wrappers do): this strategy's round loop runs (deadlines, late updates,
        asynchrony, work balancing, checkpoints) and calls ``wrapper``'s
        ``configure_train``, ``aggregate_train``, ``configure_evaluate`` and
        ``aggregate_evaluate`` where it would call its own, so the wrapper's
        clipping and noise apply to every aggregate.
        """
        self._driver = wrapper
        try:
            return self.start(*args, **kwargs)
        finally:
            self._driver = self

    def _prepare_round(self, server_round: int, grid: Grid) -> None:
        """Hook run before ``configure_train`` (subclasses fix the deadline)."""

    def _train_replies(self, server_round: int) -> Iterator[Message]:
        """This round's replies as they arrive, until all replied or ``timeout``."""
        assert self._inflight is not None
        until = self._clock.now() + self._timeout
        for reply, ticket, arrived in self._inflight.replies(
            until, kind=MessageType.TRAIN
        ):
            yield self._hand_over(reply, ticket, arrived, self._global_np)

    def _close_train(
        self,
        server_round: int,
        arrays: ArrayRecord | None,
        metrics: MetricRecord | None,
    ) -> TrainAggregate:
        """After ``aggregate_train``: forget the round's unanswered messages."""
        assert self._inflight is not None
        missing = self._inflight.ids(lambda t: t.server_round == server_round)
        self._tally = RoundTally.of(self._sent, self._handed, len(missing))
        if missing:
            log(
                INFO,
                "round %d: %d nodes did not reply within timeout=%g s",
                server_round,
                len(missing),
                self._timeout,
            )
        self._inflight.forget(missing)
        return arrays, metrics

    def _train_stage(
        self, server_round: int, config: ConfigRecord, grid: Grid, result: Result
    ) -> None:
        """configure_train, push, aggregate_train over the arriving replies."""
        assert self._inflight is not None
        self._prepare_round(server_round, grid)
        messages = self._driver.configure_train(
            server_round, self._global, config, grid
        )
        self._sent = len(self._inflight.push(messages, server_round))
        self._handed = []
        arrays, metrics = self._aggregate_train(
            server_round, self._train_replies(server_round)
        )
        arrays, metrics = self._close_train(server_round, arrays, metrics)
        self._arrivals.clear()
        if arrays is not None:
            self._set_global(arrays)
            result.arrays = arrays
            self._stalled = 0
            self._updates_applied += 1
        elif self._sent or self.fraction_train > 0:
            self._stalled += 1
            if self._stalled % STALL_ROUNDS == 0:
                self._warn_stalled(server_round, self._stalled)
        log(
            INFO,
            "round %d: %s at t=%.2fs",
            server_round,
            "model updated" if arrays is not None else "model unchanged",
            self._elapsed(),
        )
        if metrics is not None:
            metrics[ROUND_CLOCK_S] = self._elapsed()
            log(INFO, "\t└──> Aggregated MetricRecord: %s", metrics)
            result.train_metrics_clientapp[server_round] = metrics

    def _stall_cause(self, tally: RoundTally) -> str:
        """Likely cause of a round without an update, and the setting to change."""
        return stall_cause(tally, self.min_available_nodes, self._timeout)

    def _warn_stalled(self, server_round: int, rounds: int) -> None:
        warn_stalled(server_round, rounds, self._stall_cause(self._tally))

    def _evaluate_wait(self) -> float:
        """Clock seconds to wait for evaluation replies."""
        return self._timeout

    def _evaluate_stage(
        self, server_round: int, config: ConfigRecord, grid: Grid, result: Result
    ) -> None:
        """configure_evaluate, push, aggregate_evaluate over the arriving replies."""
        assert self._inflight is not None
        inflight = self._inflight
        messages = self._driver.configure_evaluate(
            server_round, self._global, config, grid
        )
        sent = inflight.push(messages, server_round)
        until = self._clock.now() + self._evaluate_wait()
        replies = (
            reply for reply, _, _ in inflight.replies(until, kind=MessageType.EVALUATE)
        )
        metrics = self._driver.aggregate_evaluate(server_round, ReplyStream(replies))
        inflight.forget(sent)
        if metrics is not None:
            log(INFO, "\t└──> Aggregated MetricRecord: %s", metrics)
            result.evaluate_metrics_clientapp[server_round] = metrics

    def _central_evaluation(
        self, server_round: int, result: Result, evaluate_fn: EvaluateFn | None
    ) -> None:
        if evaluate_fn is None:
            return
        log(INFO, "Global evaluation")
        res = evaluate_fn(server_round, self._global)
        log(INFO, "\t└──> MetricRecord: %s", res)
        if res is not None:
            result.evaluate_metrics_serverapp[server_round] = res

    def _after_round(self, server_round: int, result: Result) -> None:
        """Hook run after each round's evaluation (subclasses adapt here)."""

    def _write_checkpoint(self, server_round: int, result: Result) -> None:
        """Save the model and state (:meth:`RoundCheckpoint.save
        <flowerbed.strategies.round_checkpoint.RoundCheckpoint.save>`)."""
        if self.checkpoint_path is None:
            return
        checkpoint = RoundCheckpoint(self.checkpoint_path, type(self).__name__)
        checkpoint.save(server_round, self._global_np, self.state(), result)

    def _resume(self, initial_arrays: ArrayRecord, result: Result) -> int:
        """Load the checkpoint if there is one; return the last completed round
        (:meth:`RoundCheckpoint.resume
        <flowerbed.strategies.round_checkpoint.RoundCheckpoint.resume>`)."""
        if self.checkpoint_path is None:
            return 0
        checkpoint = RoundCheckpoint(self.checkpoint_path, type(self).__name__)
        resumed = checkpoint.resume(initial_arrays, result, self.state, self.load_state)
        if resumed is None:
            return 0
        last_round, arrays = resumed
        self._set_global(to_arrayrecord(arrays))
        log(INFO, "resumed from %s after round %d", self.checkpoint_path, last_round)
        return last_round

    # --------------------------------------------------------------------- start
    def _begin(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int,
        timeout: float,
        train_config: ConfigRecord | None,
        evaluate_config: ConfigRecord | None,
        evaluate_fn: EvaluateFn | None,
    ) -> tuple[Result, int]:
        """The check of ``initial_arrays``, Flower's start-up lines, clocks,
        resume, the check that the checkpoint can be written (when rounds
        remain), the initial evaluation."""
        self._check_initial(initial_arrays)
        log(INFO, "Starting %s strategy:", type(self).__name__)
        log_strategy_start_info(
            num_rounds, initial_arrays, train_config, evaluate_config
        )
        self._driver.summary()
        log(INFO, "")
        self._running = True
        self._clock = clock_of(grid)
        self._t0 = self._clock.now()
        self._wall_t0 = time.time()
        self._timeout = float(timeout)
        self._inflight = InFlight(grid, self._clock)
        self._stalled = self._updates_applied = 0
        result = Result()
        self._set_global(initial_arrays)
        result.arrays = initial_arrays
        done = self._resume(initial_arrays, result)
        if self.checkpoint_path is not None and done < num_rounds:
            check_writable(self.checkpoint_path)  # fail now, not after training
        result.arrays = self._global
        if done == 0 and evaluate_fn is not None:
            res = evaluate_fn(0, initial_arrays)
            log(INFO, "Initial global evaluation results: %s", res)
            if res is not None:
                result.evaluate_metrics_serverapp[0] = res
        return result, done

    def _end(self, result: Result, rounds_run: int) -> Result:
        """Flower's closing lines and summary; say so if nothing was ever applied."""
        self._running = False
        result.arrays = self._global
        if rounds_run and self._updates_applied == 0 and self.fraction_train > 0:
            warn_never_trained(rounds_run, self._stall_cause(self._tally))
        log(INFO, "")
        log(INFO, "Strategy execution finished in %.2fs", time.time() - self._wall_t0)
        if not isinstance(self._clock, WallClock):
            log(INFO, "Virtual time of the run: %.2fs", self._elapsed())
        log(INFO, "")
        log(INFO, "Final results:")
        log(INFO, "")
        for line in io.StringIO(str(result)):
            log(INFO, "\t%s", line.strip("\n"))
        log(INFO, "")
        return result

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
        """Run ``num_rounds`` rounds on the grid's clock; same contract as FedAvg.

        Each round calls ``configure_train``, ``aggregate_train`` (over the
        replies as they arrive), ``configure_evaluate``, ``aggregate_evaluate``
        and ``evaluate_fn``, as Flower's ``Strategy.start`` does, so a subclass
        overriding any of them changes the run.
        """
        scope = self.run_scope
        if scope is not None:
            grid = scope.open(
                grid, initial_arrays, num_rounds, train_config, evaluate_config
            )
        self._num_rounds = num_rounds
        result, done = self._begin(
            grid,
            initial_arrays,
            num_rounds,
            timeout,
            train_config,
            evaluate_config,
            evaluate_fn,
        )
        train_config = ConfigRecord() if train_config is None else train_config
        evaluate_config = ConfigRecord() if evaluate_config is None else evaluate_config
        self._stop = False
        self._prepare_run(grid, done)
        ran = 0
        for server_round in range(done + 1, num_rounds + 1):
            log(INFO, "")
            log(INFO, "[ROUND %s/%s]", server_round, num_rounds)
            self._train_stage(server_round, train_config, grid, result)
            if self._stop:
                break
            self._evaluate_stage(server_round, evaluate_config, grid, result)
            self._central_evaluation(server_round, result, evaluate_fn)
            self._after_round(server_round, result)
            self._write_checkpoint(server_round, result)
            ran += 1
            if self._stop:
                break
        self._finish_run(result)
        result = self._end(result, ran)
        return result if scope is None else scope.close(result)

    def _check_initial(self, initial_arrays: ArrayRecord) -> None:
        """Hook run first, before anything is logged or sent: a subclass raises
        ValueError when ``initial_arrays`` do not fit its model."""

    def _prepare_run(self, grid: Grid, done: int) -> None:
        """Hook run once before the first round (``done``: rounds a resumed run
        had completed); a subclass sets up what its rounds share."""

    def _finish_run(self, result: Result) -> None:
        """Hook run once after the last round, before Flower's closing lines
        (a subclass collects what is still outstanding)."""
