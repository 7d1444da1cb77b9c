"""FedBuff: asynchronous federated learning with buffered aggregation."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from logging import DEBUG, INFO, WARNING
from typing import Any, ClassVar

import numpy as np
from flowerbed import keys
from flowerbed.strategies.round_metrics import (
    ROUND_CLOCK_S,
    ROUND_PARTICIPANTS,
    ROUND_STALENESS,
)
from flowerbed.strategies.staleness import StalenessFn, resolve_staleness_fn
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Message,
    MessageType,
    MetricRecord,
)
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result
from flwr.supercore import log

from .options import Buffering, Staleness, WorkBalance
from .rounds import EvaluateFn
from .runtime_weighted import RuntimeWeightedFedAvg
from .server_momentum import ServerMomentum
from .stalls import STALL_ROUNDS, RoundTally
from .versions import VersionEvaluations, buffer_full

CONCURRENCY_PER_SAMPLE = 2
"""Default ``concurrency``: this many times FedAvg's sample size. A node holds its
slot for its whole task, so slow devices hold most slots (their share of
slot-time is their share of the summed task times); a synchronous round with a
timeout keeps its cohort busy while its cut-off stragglers run on. Measured
against 1x and 3x on the benchmark's phone populations (docs/strategies/fedbuff.md):
1x folded a third of a timed-out FedAvg's updates, 3x spent about 1.4x its energy."""
ABANDON_SAMPLE = 100
"""Completed round trips the abandonment limit looks at (the newest)."""
ABANDON_MIN_SAMPLES = 10
"""Round trips to know before any task is given up."""
MEAN_STALENESS = 4
"""Default ``buffer_size`` is ``concurrency // MEAN_STALENESS``: with nodes drawn
uniformly, versions are made at ``rate / K`` while ``concurrency`` tasks are in
flight, so by Little's law (Little, Operations Research 9(3), 1961) an update
is on average ``concurrency / K`` versions old, whatever the fleet."""


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
    Alg. 1 hands the buffered update to a server optimiser; this one is SGD with
    momentum ``beta = server_momentum`` (FedAvgM, Hsu et al., 2019, Sec. 3; 0 by
    default, the update above)::

        u_v = eta_g * sum_k p_k s(tau_k) delta_k,   m_(v+1) = beta m_v + u_v,
        x_(v+1) = x_v + m_(v+1)                     (m_0 = 0; beta = 0: as above)

    on float arrays (others take ``x_v + u_v``). Updates more than
    ``max_staleness`` versions old are dropped. A node that replies gets new
    work at once (on the newest version), each dispatch drawing its nodes
    afresh among the idle ones, so ``concurrency`` stays busy. ``num_rounds``
    counts model versions; evaluation (federated and ``evaluate_fn``) runs
    every ``evaluate_every`` versions and after the last.

    Quarantine counts versions in place of rounds. A resumed run restarts from
    the checkpointed version with fresh work (work in flight when the server
    stopped is not recoverable) and with the momentum at zero.

    Parameters
    ----------
    (FedAvg's and RuntimeWeightedFedAvg's parameters, same defaults except
    ``weighting="examples"``), and:
    buffering : Buffering, optional (default: Buffering())
        ``concurrency``, ``buffer_size`` (K), ``server_learning_rate`` (eta_g) and
        ``evaluate_every`` (:class:`~flowerbed.strategies.options.Buffering`).
    staleness : Staleness, optional (default: Staleness(max_staleness=10))
        ``max_staleness`` and ``s(tau)``
        (:class:`~flowerbed.strategies.options.Staleness`).
    """

    # The option objects' fields, read as attributes (copied by copy_fields)
    concurrency: int | None
    buffer_size: int | None
    server_learning_rate: float
    server_momentum: float
    evaluate_every: int
    abandon_after: float | None
    max_staleness: int
    staleness_fn: StalenessFn  # resolved from a name

    OPTION_DEFAULTS: ClassVar[Mapping[str, Any]] = {
        "work": WorkBalance(weighting="examples"),
        "buffering": Buffering(),
        "staleness": Staleness(max_staleness=10),
    }
    """FedBuff's paper weights by examples (Nguyen et al., AISTATS 2022, Alg. 1)
    and uses updates up to 10 versions old."""
    buffering: Buffering
    """The asynchrony settings this strategy runs with."""
    staleness: Staleness
    """How stale updates count."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.staleness_fn = resolve_staleness_fn(self.staleness.staleness_fn)
        self.server_optimiser = ServerMomentum(self.server_momentum)
        """SGD with momentum ``server_momentum`` on the buffered update."""
        self.version = 0
        self._versions: dict[int, dict[str, np.ndarray]] = {}
        self._evaluations = VersionEvaluations()
        self._start_version()
        self.round_trips: deque[float] = deque(maxlen=ABANDON_SAMPLE)
        """Seconds from dispatch to reply of the newest completed train tasks
        (at most :data:`ABANDON_SAMPLE`)."""
        self.abandoned = 0
        """Tasks given up so far (:meth:`abandon_overdue`)."""

    def _start_version(self) -> None:
        """Sampling state of a version that has had no ``configure_train`` yet."""
        self._version_config: ConfigRecord | None = None
        """The train config as it was before the current version's first
        configure_train call (None: that call has not happened yet)."""
        self._topped_up = False
        self._draws = 0
        """Train samplings of the current version so far."""

    def summary(self) -> None:
        """Log the configuration: the FedBuff branch, then the base strategy's."""
        log(INFO, "\t├──> FedBuff:")
        log(
            INFO,
            "\t│\t└── Concurrency %s, buffer %s, eta_g %.3g, momentum %.3g, max "
            "staleness %d, abandon after %s",
            self.concurrency or f"({CONCURRENCY_PER_SAMPLE} x sample size)",
            self.buffer_size or f"(concurrency // {MEAN_STALENESS})",
            self.server_learning_rate,
            self.server_momentum,
            self.max_staleness,
            "never"
            if self.abandon_after is None
            else f"{self.abandon_after:g} x the slowest recent round trip",
        )
        super().summary()

    def _server_step_size(self) -> float:
        return self.server_learning_rate

    def _concurrency(self, grid: Grid) -> int:
        return self.concurrency or CONCURRENCY_PER_SAMPLE * self._sample_size(
            grid, self.fraction_train, self.min_train_nodes
        )

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Work for idle nodes, up to ``concurrency``, on ``arrays``.

        ``server_round`` is the model version the work will count towards (the
        newest version plus one, as Flower's round ``r`` trains on model
        ``r - 1``). Called whenever nodes become idle, so several times per
        version; each call of a version gets the train config as it was before
        the version's first call.
        """
        self._say_if_driven_elsewhere()
        if self.fraction_train == 0.0:
            return []
        config[keys.SERVER_ROUND] = server_round
        inflight = self._inflight
        busy = 0 if inflight is None else len(inflight.busy_nodes(MessageType.TRAIN))
        missing = self._concurrency(grid) - busy
        if missing <= 0:
            return []
        return self._train_messages(server_round, arrays, config, grid, missing)

    def _draw_name(self, purpose: str) -> str:
        """Each train sampling of a version draws afresh among the idle nodes.

        The base strategy seeds its draw by (seed, round, purpose), which a
        synchronous round draws once. A version tops up many times, and the same
        seed each time picks the same position among the idle nodes: the node
        that has just replied, or its neighbour, again and again. Numbering the
        draws of a version keeps runs reproducible and each draw uniform.
        """
        if purpose != "train":
            return purpose
        self._draws += 1
        return purpose if self._draws == 1 else f"train-{self._draws}"

    def _sampling_log_level(self) -> int:
        # Top-ups within a version are routine: one INFO line per version is enough.
        return DEBUG if self._topped_up else INFO

    def abandon_overdue(self) -> int:
        """Give up on train tasks outstanding for over ``abandon_after`` times
        the slowest recent round trip; how many were given up.

        A node that vanished without an error (a phone switched off, a board
        unplugged) holds its slot until its message expires, by default after
        ``start()``'s ``timeout`` (Flower's 3,600 s), while the other slots
        carry the run. Measured on the suite's phone populations (seeds 1-3,
        docs/strategies/fedbuff.md), giving up at twice the slowest of the
        last 100 completed round trips raised FedBuff's accuracy at the budget
        by 6-10 points (mnist1d IID, Synthetic) and reached 95% of the
        converged accuracy 1.0-1.24x as fast as Flower's best timeout, where it
        had been 0.96-1.0x; on the small fleets it changed nothing measurable.
        """
        if self.abandon_after is None or len(self.round_trips) < ABANDON_MIN_SAMPLES:
            return 0
        assert self._inflight is not None
        limit = self.abandon_after * max(self.round_trips)
        now = self._clock.now()
        overdue = self._inflight.ids(
            lambda t: t.kind == MessageType.TRAIN and now - t.sent_at > limit
        )
        if overdue:
            self._inflight.forget(overdue)
            self.abandoned += len(overdue)
            log(
                INFO,
                "version %d: gave up on %d task(s) outstanding for over %.3g s "
                "(%g x the slowest recent round trip); their nodes count as idle",
                self.version,
                len(overdue),
                limit,
                self.abandon_after,
            )
        return len(overdue)

    def _dispatch(self, grid: Grid, config: ConfigRecord) -> None:
        """Give work on the newest version to idle nodes (``configure_train``),
        after giving up on overdue tasks (:meth:`abandon_overdue`).

        Every call for one version sees the train config as it was before that
        version's first call, so an override that edits it in place (Flower's
        learning-rate decay recipe) acts once per version, not once per call.
        """
        assert self._inflight is not None
        self.abandon_overdue()
        if self._version_config is None:
            self._version_config = ConfigRecord(dict(config))
            given = config
        else:
            given = ConfigRecord(dict(self._version_config))
        messages = self._driver.configure_train(
            self.version + 1, self._global, given, grid
        )
        self._topped_up = True
        self._inflight.push(messages, self.version)

    def _prune_versions(self) -> None:
        assert self._inflight is not None
        oldest = self.version - self.max_staleness
        # versions of unanswered messages and of replies waiting in the backlog
        needed = {ticket.server_round for _, ticket in self._inflight.unconsumed()}
        self._versions = {
            v: x
            for v, x in self._versions.items()
            if v == self.version or (v in needed and v >= oldest)
        }

    def _buffer_replies(
        self, grid: Grid, config: ConfigRecord, result: Result, buffer_size: int
    ) -> Iterator[Message]:
        """Train replies as they arrive until ``buffer_size`` usable ones.

        Evaluation replies arriving meanwhile go to their version's evaluation;
        each train reply frees its node, which gets new work at once (on the new
        version when its reply is the one that fills the buffer). Sets
        ``self._starved`` when no usable reply came within ``timeout``.
        """
        assert self._inflight is not None
        inflight = self._inflight
        progress_at = self._clock.now()

        def full() -> bool:
            return buffer_full(self._handed, buffer_size)

        while not full():
            # the last usable reply (replies are folded, and known usable, a
            # few at a time: see RuntimeWeightedFedAvg.aggregate_train)
            progress_at = max(
                [progress_at] + [a.arrived for a in self._handed if a.usable]
            )
            for reply, ticket, arrived in inflight.replies(
                progress_at + self._timeout, done=full
            ):
                if ticket.kind == MessageType.EVALUATE:
                    self._evaluations.add(
                        reply, ticket, result, self._driver.aggregate_evaluate
                    )
                    continue
                staleness = self.version - ticket.server_round
                if staleness > self.max_staleness:
                    log(
                        INFO,
                        "version %d: dropped an update from node %s, %d versions old",
                        self.version,
                        ticket.node_id,
                        staleness,
                    )
                else:
                    if not reply.has_error():
                        self.round_trips.append(arrived - ticket.sent_at)
                    yield self._hand_over(
                        reply,
                        ticket,
                        arrived,
                        self._versions[ticket.server_round],
                        staleness=staleness,
                        update_scale=self.staleness_fn(staleness),
                    )
                if not full():  # else: new work waits for the new version
                    self._dispatch(grid, config)
                self._prune_versions()
            if full():
                return
            if self._clock.now() >= progress_at + self._timeout or not (
                inflight.outstanding(lambda t: True)
            ):
                self._starved = True
                return

    # ------------------------------------------------------------ the round
    # RoundLoop.start runs FedBuff: one round is one model version. With
    # fraction_train=0.0 the hooks are RoundLoop's (evaluation-only rounds, as
    # Flower's FedAvg does).
    def _prepare_run(self, grid: Grid, done: int) -> None:
        super()._prepare_run(grid, done)
        self.version = done
        self._versions = {self.version: self._global_np}
        self._evaluations = VersionEvaluations()
        self._start_version()
        self.server_optimiser.reset()
        self._starved = False
        self._buffer_size = self.buffer_size or max(
            1, self._concurrency(grid) // MEAN_STALENESS
        )

    def _train_stage(
        self, server_round: int, config: ConfigRecord, grid: Grid, result: Result
    ) -> None:
        """Version ``server_round``: ``aggregate_train`` over the replies that
        fill the buffer; ``configure_train`` hands out work as nodes become idle.
        No usable reply within ``timeout`` ends the run."""
        if self.fraction_train == 0.0:
            return super()._train_stage(server_round, config, grid, result)
        assert self._inflight is not None
        self._dispatch(grid, config)
        self._handed = []
        replies = self._buffer_replies(grid, config, result, self._buffer_size)
        arrays, metrics = self._aggregate_train(self.version + 1, replies)
        self._arrivals.clear()
        if self._starved:
            log(
                WARNING,
                "no usable reply within %.0f s (or nothing in flight): stopping "
                "at version %d of %d",
                self._timeout,
                self.version,
                self._num_rounds,
            )
            self._stop = True
            return None
        self._new_version(arrays, metrics, result)
        return None

    def _evaluation_due(self) -> bool:
        """Every ``evaluate_every`` versions, and after the last."""
        return (
            self.version % self.evaluate_every == 0 or self.version >= self._num_rounds
        )

    def _evaluate_stage(
        self, server_round: int, config: ConfigRecord, grid: Grid, result: Result
    ) -> None:
        """Send the version's evaluation when due; its replies are collected as
        they arrive, while training goes on."""
        if self.fraction_train == 0.0:
            return super()._evaluate_stage(server_round, config, grid, result)
        if not self._evaluation_due():
            return None
        assert self._inflight is not None
        messages = self._driver.configure_evaluate(
            self.version, self._global, config, grid
        )
        ids = self._inflight.push(messages, self.version)
        self._evaluations.expect(self.version, ids)
        return None

    def _central_evaluation(
        self, server_round: int, result: Result, evaluate_fn: EvaluateFn | None
    ) -> None:
        if self.fraction_train == 0.0 or self._evaluation_due():
            super()._central_evaluation(server_round, result, evaluate_fn)

    def _finish_run(self, result: Result) -> None:
        """Collect outstanding evaluation replies; forget work still in flight."""
        super()._finish_run(result)
        if self.fraction_train == 0.0:
            return
        assert self._inflight is not None
        evaluations = self._evaluations
        replies = self._inflight.replies(
            self._clock.now() + self._timeout,
            kind=MessageType.EVALUATE,
            done=lambda: not evaluations.pending,
        )
        evaluations.finish(replies, result, self._driver.aggregate_evaluate)
        self._inflight.forget(list(self._inflight.tickets))

    def _new_version(
        self,
        arrays: ArrayRecord | None,
        metrics: MetricRecord | None,
        result: Result,
    ) -> None:
        """Version ``v + 1`` from the buffer (the model is unchanged if aggregation
        returned nothing, as a Flower round whose aggregation fails)."""
        used = [a for a in self._handed if a.usable]
        self.version += 1
        self._start_version()
        if arrays is not None:
            self._set_global(arrays)
            self._updates_applied += 1
            self._stalled = 0
        else:
            self._stalled += 1
            if self._stalled % STALL_ROUNDS == 0:
                self._tally = RoundTally.of(len(self._handed), self._handed, 0)
                self._warn_stalled(self.version, self._stalled)
        self._versions[self.version] = self._global_np
        result.arrays = self._global
        staleness = sum(a.staleness for a in used) / max(1, len(used))
        if metrics is not None:
            metrics[ROUND_PARTICIPANTS] = len(used)
            metrics[ROUND_STALENESS] = staleness
            metrics[ROUND_CLOCK_S] = self._elapsed()
            log(INFO, "\t└──> Aggregated MetricRecord: %s", metrics)
            result.train_metrics_clientapp[self.version] = metrics
        log(
            INFO,
            "version %d at t=%.2fs from %d updates (mean staleness %.2f)",
            self.version,
            self._elapsed(),
            len(used),
            staleness,
        )

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """The buffer's update ``x_v + u_v`` (the base strategy's fold), taken
        through the server momentum (the class docstring's ``m_(v+1)``).

        As Flower's ``FedAvgM``, the momentum is kept between calls; with no
        global model (a direct call before any round) there is nothing to move
        from and the fold's result is returned as it is.
        """
        arrays, metrics = super().aggregate_train(server_round, replies)
        if arrays is None:
            return arrays, metrics
        return self.server_optimiser.step(arrays, self._global_np), metrics
