"""FedBuff: asynchronous federated learning with buffered aggregation."""

from __future__ import annotations

from collections.abc import Callable
from logging import INFO, WARNING
from pathlib import Path

import numpy as np
from flowerbed import keys
from flowerbed.clock import clock_of
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result
from flwr.supercore import log

from .runtime_weighted import (
    DEFAULT_QUARANTINE_AFTER,
    DEFAULT_QUARANTINE_ROUNDS,
    DEFAULT_SPEED_SMOOTHING,
    RuntimeWeightedFedAvg,
)
from .utils import (
    ROUND_CLOCK_S,
    ROUND_PARTICIPANTS,
    ROUND_STALENESS,
    InFlight,
    MetricsAccumulator,
    StalenessFn,
    Ticket,
    UpdateAccumulator,
    polynomial_staleness,
    resolve_staleness_fn,
)


class FedBuff(RuntimeWeightedFedAvg):
    """Asynchronous buffered aggregation (Nguyen et al., AISTATS 2022, Alg. 1).

    ``concurrency`` nodes train at all times. Each reply is folded, as it arrives,
    into a buffer; its update ``delta_k = x_k - x_(v_k)`` is taken against the
    model version ``v_k`` the node started from and scaled by
    ``s(tau_k)``, ``tau_k = v - v_k`` being its staleness (default
    ``s(tau) = 1/sqrt(1 + tau)``, FedBuff Sec. 3). Every ``buffer_size`` (K)
    accepted replies make a new model version::

        x_(v+1) = x_v + eta_g * sum_k p_k s(tau_k) delta_k,   p_k = w_k / sum_j w_j

    which with equal weights is FedBuff's ``x + eta_g / K * sum_k s(tau_k)
    delta_k``. ``w_k`` follows ``weighting`` (default ``"examples"``, i.e.
    ``num-examples``); with ``"fednova"`` each delta is also divided by its steps.
    Updates more than ``max_staleness`` versions old are dropped. A node that
    replies gets new work at once (on the newest version), so ``concurrency``
    stays busy. ``num_rounds`` counts model versions; evaluation (federated and
    ``evaluate_fn``) runs every ``evaluate_every`` versions and after the last.

    Quarantine counts versions in place of rounds. A resumed run restarts from
    the checkpointed version with fresh work (work in flight when the server
    stopped is not recoverable).

    Parameters
    ----------
    (FedAvg's and RuntimeWeightedFedAvg's parameters, same defaults except
    ``weighting="examples"``), and:
    concurrency : int, optional (default: None)
        Nodes training at once; None means FedAvg's sample size
        (``fraction_train`` of connected nodes, at least ``min_train_nodes``).
    buffer_size : int, optional (default: None)
        K, replies per model version; None means ``max(1, concurrency // 2)``.
    server_learning_rate : float (default: 1.0)
        ``eta_g``.
    max_staleness : int (default: 10)
        Oldest update (in versions) still used.
    staleness_fn : str or callable (default: "polynomial", 1/sqrt(1+s))
        ``s(tau)``; a name from ``flowerbed.strategies.utils.STALENESS_FUNCTIONS``
        or a function of the staleness.
    evaluate_every : int (default: 1)
        Evaluate every this many versions.
    """

    # pylint: disable=too-many-arguments,too-many-locals
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
        concurrency: int | None = None,
        buffer_size: int | None = None,
        server_learning_rate: float = 1.0,
        max_staleness: int = 10,
        staleness_fn: str | StalenessFn = polynomial_staleness,
        evaluate_every: int = 1,
        weighting: str = "examples",
        balance_work: bool = False,
        local_steps: int | None = None,
        speed_smoothing: float = DEFAULT_SPEED_SMOOTHING,
        min_local_steps: int = 1,
        max_local_steps: int | None = None,
        quarantine_after: int = DEFAULT_QUARANTINE_AFTER,
        quarantine_rounds: int = DEFAULT_QUARANTINE_ROUNDS,
        message_ttl_s: float | None = None,
        checkpoint_path: str | Path | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__(
            fraction_train,
            fraction_evaluate,
            min_train_nodes,
            min_evaluate_nodes,
            min_available_nodes,
            weighted_by_key,
            arrayrecord_key,
            configrecord_key,
            train_metrics_aggr_fn,
            evaluate_metrics_aggr_fn,
            weighting=weighting,
            balance_work=balance_work,
            local_steps=local_steps,
            speed_smoothing=speed_smoothing,
            min_local_steps=min_local_steps,
            max_local_steps=max_local_steps,
            quarantine_after=quarantine_after,
            quarantine_rounds=quarantine_rounds,
            message_ttl_s=message_ttl_s,
            checkpoint_path=checkpoint_path,
            seed=seed,
        )
        checks = [
            (concurrency is None or concurrency >= 1, "concurrency must be >= 1"),
            (buffer_size is None or buffer_size >= 1, "buffer_size must be >= 1"),
            (server_learning_rate > 0, "server_learning_rate must be > 0"),
            (max_staleness >= 0, "max_staleness must be >= 0"),
            (evaluate_every >= 1, "evaluate_every must be >= 1"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        self.concurrency = concurrency
        self.buffer_size = buffer_size
        self.server_learning_rate = server_learning_rate
        self.max_staleness = max_staleness
        self.staleness_fn = resolve_staleness_fn(staleness_fn)
        self.evaluate_every = evaluate_every
        self.version = 0
        self._versions: dict[int, dict[str, np.ndarray]] = {}
        self._evaluations: dict[int, tuple[set[str], MetricsAccumulator]] = {}

    def summary(self) -> None:
        """Log the configuration."""
        super().summary()
        log(
            INFO,
            "\t\t└── FedBuff: concurrency %s, buffer %s, eta_g %.3g, max staleness %d",
            self.concurrency or "(sample size)",
            self.buffer_size or "(concurrency // 2)",
            self.server_learning_rate,
            self.max_staleness,
        )

    def _dispatch(
        self, inflight: InFlight, grid: Grid, config: ConfigRecord, concurrency: int
    ) -> None:
        """Give work on the newest version to idle nodes until ``concurrency``."""
        missing = concurrency - len(inflight.busy_nodes(MessageType.TRAIN))
        if missing <= 0:
            return
        messages = self._train_messages(
            self.version, self._global, config, grid, missing
        )
        inflight.push(messages, self.version)

    def _evaluate(
        self,
        inflight: InFlight,
        grid: Grid,
        config: ConfigRecord,
        result: Result,
        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None,
    ) -> None:
        if evaluate_fn is not None:
            res = evaluate_fn(self.version, self._global)
            if res is not None:
                result.evaluate_metrics_serverapp[self.version] = res
        messages = self.configure_evaluate(self.version, self._global, config, grid)
        ids = inflight.push(messages, self.version)
        if ids:
            self._evaluations[self.version] = (
                set(ids),
                MetricsAccumulator(self.weighted_by_key),
            )

    def _fold_evaluation(self, reply: Message, ticket: Ticket, result: Result) -> None:
        pending = self._evaluations.get(ticket.server_round)
        if pending is None:
            return
        ids, metrics_acc = pending
        ids.discard(reply.metadata.reply_to_message_id)
        self.fold_evaluate_reply(reply, ticket.server_round, metrics_acc)
        if not ids:
            self._close_evaluation(ticket.server_round, result)

    def _close_evaluation(self, version: int, result: Result) -> None:
        _, metrics_acc = self._evaluations.pop(version)
        metrics = metrics_acc.result(self.evaluate_metrics_aggr_fn)
        if metrics is not None:
            result.evaluate_metrics_clientapp[version] = metrics

    def _new_version(
        self,
        updates: UpdateAccumulator,
        metrics_acc: MetricsAccumulator,
        staleness_sum: int,
        now: float,
        result: Result,
    ) -> None:
        arrays, metrics = self._finish(
            updates, metrics_acc, step_size=self.server_learning_rate
        )
        self.version += 1
        self._set_global(arrays)
        self._versions[self.version] = self._global_np
        metrics = MetricRecord() if metrics is None else metrics
        metrics[ROUND_PARTICIPANTS] = updates.count
        metrics[ROUND_STALENESS] = staleness_sum / updates.count
        metrics[ROUND_CLOCK_S] = now
        result.train_metrics_clientapp[self.version] = metrics
        log(
            INFO,
            "version %d at t=%.1fs from %d updates (mean staleness %.2f)",
            self.version,
            now,
            updates.count,
            staleness_sum / updates.count,
        )

    def _prune_versions(self, inflight: InFlight) -> None:
        needed = {t.server_round for t in inflight.tickets.values()}
        oldest = self.version - self.max_staleness
        self._versions = {
            v: x
            for v, x in self._versions.items()
            if v == self.version or (v in needed and v >= oldest)
        }

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
        """Run until ``num_rounds`` model versions exist; FedAvg's contract.

        ``timeout`` bounds the clock seconds without any reply before giving up.
        """
        log(INFO, "Starting %s strategy:", type(self).__name__)
        self.summary()
        clock = clock_of(grid)
        self._timeout = float(timeout)
        inflight = self._inflight = InFlight(grid, clock)
        train_config = ConfigRecord() if train_config is None else train_config
        evaluate_config = ConfigRecord() if evaluate_config is None else evaluate_config
        result = Result()
        self._set_global(initial_arrays)
        self.version = self._resume(initial_arrays, result)
        if self.version == 0 and evaluate_fn is not None:
            res = evaluate_fn(0, initial_arrays)
            if res is not None:
                result.evaluate_metrics_serverapp[0] = res
        self._versions = {self.version: self._global_np}
        self._evaluations = {}
        concurrency = self.concurrency or self._sample_size(
            grid, self.fraction_train, self.min_train_nodes
        )
        buffer_size = self.buffer_size or max(1, concurrency // 2)
        updates = UpdateAccumulator()
        metrics_acc = MetricsAccumulator(self.weighted_by_key)
        staleness_sum = 0
        if self.version < num_rounds:
            self._dispatch(inflight, grid, train_config, concurrency)

        def finished() -> bool:
            return self.version >= num_rounds

        while not finished():
            got_any = False
            for reply, ticket, arrived in inflight.replies(
                clock.now() + self._timeout, done=finished
            ):
                got_any = True
                if ticket.kind == MessageType.EVALUATE:
                    self._fold_evaluation(reply, ticket, result)
                    continue
                staleness = self.version - ticket.server_round
                if staleness > self.max_staleness:
                    log(
                        INFO,
                        "version %d: dropped an update from node %d, %d versions old",
                        self.version,
                        ticket.node_id,
                        staleness,
                    )
                elif self.fold_train_reply(
                    reply,
                    self.version,
                    updates,
                    metrics_acc,
                    ticket=ticket,
                    arrived=arrived,
                    base=self._versions[ticket.server_round],
                    update_scale=self.staleness_fn(staleness),
                ):
                    staleness_sum += staleness
                if updates.count >= buffer_size:
                    self._new_version(
                        updates, metrics_acc, staleness_sum, clock.now(), result
                    )
                    updates = UpdateAccumulator()
                    metrics_acc = MetricsAccumulator(self.weighted_by_key)
                    staleness_sum = 0
                    if self.version % self.evaluate_every == 0 or finished():
                        self._evaluate(
                            inflight, grid, evaluate_config, result, evaluate_fn
                        )
                    self._write_checkpoint(self.version, result)
                if not finished():
                    self._dispatch(inflight, grid, train_config, concurrency)
                self._prune_versions(inflight)
            if not got_any and not finished():
                log(
                    WARNING,
                    "no reply within %.0f s (or nothing in flight): stopping at "
                    "version %d of %d",
                    self._timeout,
                    self.version,
                    num_rounds,
                )
                break
        self._finish_evaluations(inflight, clock.now() + self._timeout, result)
        inflight.forget(list(inflight.tickets))
        result.arrays = self._global
        log(INFO, "FedBuff finished at t=%.1fs", clock.now())
        return result

    def _finish_evaluations(
        self, inflight: InFlight, until: float, result: Result
    ) -> None:
        """Collect outstanding evaluation replies, then close what remains."""
        for reply, ticket, _ in inflight.replies(
            until, kind=MessageType.EVALUATE, done=lambda: not self._evaluations
        ):
            self._fold_evaluation(reply, ticket, result)
        for version in sorted(self._evaluations):
            self._close_evaluation(version, result)
