"""DeadlineFedAvg: synchronous rounds that do not wait for stragglers."""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from logging import INFO, WARNING
from typing import Any, ClassVar, Self

import numpy as np
from flowerbed import keys
from flowerbed.strategies.checkpoints import (
    StateReader,
)
from flowerbed.strategies.inflight import Arrival, Ticket, enough_usable
from flowerbed.strategies.round_metrics import (
    ROUND_DEADLINE_PERCENTILE,
    ROUND_DEADLINE_S,
    ROUND_LATE_UPDATES,
    ROUND_PARTICIPANTS,
    ROUND_STRAGGLERS,
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

from .adaptive_deadline import (
    DEFAULT_PACER_STEP,
    PROGRESS_METRICS,
    TWO_SPEED_PACER_STEP,
    WHOLE_WORK_PERCENTILE,
    AdaptiveDeadline,
)
from .durations import (
    Observation,
    censored_percentile,
    deadline_seconds,
    full_work_seconds,
    metric_number,
    reply_seconds,
    two_speed_percentile,
)
from .options import (
    RECOMMENDED_DEADLINES,
    Deadlines,
    Staleness,
)
from .rounds import MIN_MESSAGE_TTL_S, TrainAggregate
from .runtime_weighted import RuntimeWeightedFedAvg
from .stalls import RoundTally, deadline_stall_cause

__all__ = [  # the names this module held before the durations moved out
    "DEFAULT_PACER_STEP",
    "PROGRESS_METRICS",
    "TWO_SPEED_PACER_STEP",
    "WHOLE_WORK_PERCENTILE",
    "DeadlineFedAvg",
    "Observation",
    "censored_percentile",
    "deadline_seconds",
    "full_work_seconds",
    "reply_seconds",
    "two_speed_percentile",
]

EVALUATE_SHARE = 0.25
"""Default evaluation wait as a share of the round's deadline."""


class DeadlineFedAvg(RuntimeWeightedFedAvg):
    """Rounds with a deadline, over-selection, partial work and late updates.

    Every mechanism is optional and composes with any ``weighting`` of
    :class:`RuntimeWeightedFedAvg` (FedNova's suits partial work best).

    - **Fixed deadline** ``D = deadline_s``: the round closes ``D`` clock seconds
      after the push; replies after that are stragglers.
    - **Adaptive deadline**: ``D_r = f * P_p(full-work durations of the last W
      rounds)``, times Oort's pacing factor ``f``, at a fixed percentile or
      with two speeds
      (:class:`~flowerbed.strategies.adaptive_deadline.AdaptiveDeadline` gives
      the formulas). Without history (round 1, no ``deadline_s``) the round
      closes when ``floor(p% of sampled)`` nodes (at least one) replied with a
      usable update, that round's ``p``-th percentile.
    - **Over-selection** (Bonawitz et al., "Towards Federated Learning at Scale",
      MLSys 2019, Sec. 2.3; FedScale's default 1.3): sample
      ``ceil(K * over_selection)`` nodes and close the round at the first ``K``
      usable replies, ``K`` being the number FedAvg would sample.
    - **Partial work** (FedProx, Li et al., MLSys 2020, Sec. 3: variable local
      work): nodes receive ``deadline-s = work_fraction * D`` and report the
      ``num-steps`` they managed before it.
    - **Late updates** (REFL, Abdelmoniem et al., EuroSys 2023; SAFA, Wu et al.,
      IEEE TC 2021): a reply that misses round ``r`` and arrives in round
      ``r + s`` with ``s <= max_staleness`` is folded into that round as the
      update ``x_i - x_r`` (relative to the model it trained from), its weight
      multiplied by ``staleness_fn(s)`` (default ``1/sqrt(1+s)``). With
      partial work, a task sent before any deadline was known (the first
      round of an adaptive deadline) is not folded late (:meth:`folds_late`).
    - **Minimum completion**: a round with fewer than ``min_completion`` usable
      replies keeps the previous model and logs it (default 1: as Flower's
      FedAvg, a round uses whatever usable replies it got).
    - **TTLs**: messages expire after ``message_ttl_s``; by default
      ``D * (max_staleness + 2)`` with late updates (the last round that may use
      the reply, plus one deadline of slack), ``2 D`` without (the reply is
      dropped, the expiry error lands after the round), ``timeout`` while ``D``
      is unknown; never below one second. An expired message is not the node's
      fault (it was slow, or gone): it does not count towards quarantine.
    - **Evaluation** waits ``evaluate_timeout_s`` (default ``D / 4``), so with
      federated evaluation on a round lasts at most ``D + evaluate_timeout_s``.

    Each round's train MetricRecord also carries ``participants``,
    ``late-updates``, ``stragglers``, ``deadline-s`` (-1 when none) and
    ``deadline-percentile`` (-1 when the deadline is not adaptive).

    Parameters
    ----------
    (FedAvg's and RuntimeWeightedFedAvg's parameters, same defaults), and:
    deadlines : Deadlines, optional (default: Deadlines())
        When a round closes and what nodes do about it: fixed or adaptive
        deadline, percentiles, pacer, over-selection, partial work, late updates,
        ``min_completion``, evaluation wait
        (:class:`~flowerbed.strategies.options.Deadlines` lists its fields).
    staleness : Staleness, optional (default: Staleness(max_staleness=2))
        How late updates count (:class:`~flowerbed.strategies.options.Staleness`).
    """

    # The option objects' fields, read as attributes (copied by copy_fields)
    deadline_s: float | None
    adaptive_deadline: bool
    deadline_percentile: float | None
    fast_percentile: float
    wait_ratio: float
    deadline_window: int
    deadline_growth: float
    pacer_step: float  # None resolved
    pacer_window: int
    pacing_bounds: tuple[float, float]
    progress_metric: str | None
    over_selection: float
    partial_work: bool
    work_fraction: float
    learn_margin: bool
    min_batch_size: int
    late_updates: bool
    min_completion: int  # None resolved
    evaluate_timeout_s: float | None
    max_staleness: int
    staleness_fn: StalenessFn  # resolved from a name

    OPTION_DEFAULTS: ClassVar[Mapping[str, Any]] = {
        "deadlines": Deadlines(),
        "staleness": Staleness(),
    }
    deadlines: Deadlines
    """The deadline settings this strategy runs with."""
    staleness: Staleness
    """How late updates count."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.adaptive = AdaptiveDeadline(self.deadlines)
        """The adaptive deadline's history, pacer and learnt lateness."""
        self.deadline_percentile = self.adaptive.fixed_percentile
        self.pacer_step = self.adaptive.pacer_step
        self.fast_percentile = float(self.fast_percentile)
        self.wait_ratio = float(self.wait_ratio)
        self.min_batch_size = int(self.min_batch_size)
        self.staleness_fn = resolve_staleness_fn(self.staleness.staleness_fn)
        if self.min_completion is None:
            self.min_completion = max(1, self.min_train_nodes)
        self.pacer = self.adaptive.pacer
        self.history = self.adaptive.history
        self.node_lateness = self.adaptive.lateness
        self._deadline: float | None = None
        self._wanted = 0
        self._bases: dict[int, dict[str, np.ndarray]] = {}
        self._batch: float | None = None
        """The round's assigned batch size (``batch-size`` of its config)."""

    @property
    def percentile(self) -> float:
        """The percentile of the current round's deadline."""
        return self.adaptive.percentile

    @property
    def pacing(self) -> float:
        """The pacer's factor on the deadline (:attr:`Pacer.factor`)."""
        return self.pacer.factor

    @property
    def durations(self) -> list[Observation]:
        """Recent full-work durations (:attr:`DurationHistory.durations`)."""
        return self.history.durations

    @durations.setter
    def durations(self, durations: list[Observation]) -> None:
        self.history.durations = durations

    @property
    def least(self) -> list[tuple[int, float]]:
        """Recent least-useful seconds (:attr:`DurationHistory.least`)."""
        return self.history.least

    @property
    def lateness(self) -> dict[int, list[float]]:
        """Per node, its last lateness values (:attr:`NodeLateness.seen`)."""
        return self.node_lateness.seen

    @lateness.setter
    def lateness(self, seen: dict[int, list[float]]) -> None:
        self.node_lateness.seen = seen

    @classmethod
    def recommended(cls, *args: Any, **kwargs: Any) -> Self:
        """The strategy with flowerbed's one recommended default.

        ``DeadlineFedAvg.recommended(fraction_train=0.5)`` takes FedAvg's
        arguments (and this class's, ``deadlines`` excepted) and sets
        ``deadlines=RECOMMENDED_DEADLINES``: the configuration of ``strategy =
        "deadline"`` that docs/BENCHMARKS.md compares with Flower's best-tuned
        timeout on every workload. Plain ``DeadlineFedAvg()`` keeps its
        documented defaults (no deadline: Flower's wait for all).
        """
        if "deadlines" in kwargs:
            raise TypeError(
                "recommended() sets deadlines itself: to choose them, use "
                "DeadlineFedAvg(deadlines=Deadlines(...))"
            )
        return cls(*args, deadlines=RECOMMENDED_DEADLINES, **kwargs)

    def summary(self) -> None:
        """Log the configuration: the deadline branch, then the base strategy's."""
        log(INFO, "\t├──> Deadline:")
        self.adaptive.summary()
        log(
            INFO,
            "\t│\t├── Over-selection %.2f, partial work %s, min completion %d",
            self.over_selection,
            self.partial_work,
            self.min_completion,
        )
        log(
            INFO,
            "\t│\t└── Late updates %s (max staleness %d)",
            self.late_updates,
            self.max_staleness,
        )
        super().summary()

    # ----------------------------------------------------------------- deadline
    def current_deadline(self, server_round: int) -> float | None:
        """The deadline (clock seconds) for ``server_round``; None if unknown
        (:meth:`AdaptiveDeadline.deadline
        <flowerbed.strategies.adaptive_deadline.AdaptiveDeadline.deadline>`)."""
        return self.adaptive.deadline(server_round, self._timeout)

    def _message_ttl(self) -> float:
        if self.message_ttl_s is not None or self._deadline is None:
            return super()._message_ttl()
        rounds = self.max_staleness + 2 if self.late_updates else 2
        return max(self._deadline * rounds, MIN_MESSAGE_TTL_S)

    def node_deadline(self, node_id: int, deadline: float) -> float:
        """The ``deadline-s`` node ``node_id`` gets in a round of ``deadline`` s.

        Without ``learn_margin``: ``work_fraction * D``. With it, ``D`` less
        the time the node's replies need after its ``deadline-s``, learnt from
        its replies that stopped at the deadline (partial work) or came after
        it (:meth:`NodeLateness.deadline_s
        <flowerbed.strategies.lateness.NodeLateness.deadline_s>`).
        """
        if not self.learn_margin:
            return self.work_fraction * deadline
        return self.node_lateness.deadline_s(node_id, deadline, self.work_fraction)

    def _note_lateness(self, reply: Message, ticket: Ticket, arrived: float) -> None:
        """Record the reply's lateness (:meth:`NodeLateness.note_reply`)."""
        self.node_lateness.note_reply(reply, ticket, arrived)

    def _node_config(self, node_id: int, config: ConfigRecord) -> ConfigRecord:
        if self.partial_work and self._deadline is not None:
            config[keys.DEADLINE_S] = self.node_deadline(node_id, self._deadline)
            if self.min_batch_size:
                config[keys.MIN_BATCH_SIZE] = self.min_batch_size
        return config

    def _evaluate_wait(self) -> float:
        if self.evaluate_timeout_s is not None:
            return self.evaluate_timeout_s
        if self._deadline is not None:
            return EVALUATE_SHARE * self._deadline
        return self._timeout

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Over-sample nodes and build train messages with this round's deadline."""
        self._say_if_driven_elsewhere()
        if self.fraction_train == 0.0:
            return []
        config[keys.SERVER_ROUND] = server_round
        self._deadline = self.current_deadline(server_round)
        self._batch = metric_number(config, keys.BATCH_SIZE)
        wanted = self._sample_size(grid, self.fraction_train, self.min_train_nodes)
        count = math.ceil(wanted * self.over_selection)
        messages = self._train_messages(server_round, arrays, config, grid, count)
        log(
            INFO,
            "configure_train: keeping the first %d usable replies, deadline %s",
            min(wanted, len(messages)),
            "none" if self._deadline is None else f"{self._deadline:.3g} s",
        )
        return messages

    # -------------------------------------------------------------------- round
    def _prepare_round(self, server_round: int, grid: Grid) -> None:
        self._deadline = self.current_deadline(server_round)
        self._wanted = self._sample_size(
            grid, self.fraction_train, self.min_train_nodes
        )
        self._bases[server_round] = self._global_np
        self.history.open_round()

    def _train_replies(self, server_round: int) -> Iterator[Message]:
        """Fresh and late replies as they arrive, until the round's rule closes it."""
        assert self._inflight is not None
        inflight = self._inflight
        start = self._clock.now()
        until = start + (
            self._deadline if self._deadline is not None else self._timeout
        )
        quota = (
            max(1, math.floor(self._sent * self.percentile / 100))
            if self.adaptive_deadline and self._deadline is None
            else None
        )

        def fresh() -> list[Arrival]:
            return [a for a in self._handed if a.staleness == 0]

        def done() -> bool:
            arrivals = fresh()
            return (
                enough_usable(arrivals, self._wanted)
                or not inflight.outstanding(lambda t: t.server_round == server_round)
                or (quota is not None and enough_usable(arrivals, quota))
            )

        for reply, ticket, arrived in inflight.replies(
            until, kind=MessageType.TRAIN, done=done
        ):
            staleness = server_round - ticket.server_round
            self._note_lateness(reply, ticket, arrived)
            if staleness == 0:
                handed = self._hand_over(
                    reply, ticket, arrived, self._bases[server_round]
                )
                full, least = reply_seconds(
                    reply, ticket, arrived, self.min_batch_size, self._batch
                )
                self.history.note(self._handed[-1], full, least)
                yield handed
            elif not self.folds_late(ticket, staleness):
                log(
                    INFO,
                    "round %d: dropped a reply from node %s, %d rounds late%s",
                    server_round,
                    ticket.node_id,
                    staleness,
                    " (sent before any deadline was known)"
                    if ticket.deadline_s is None and self.partial_work
                    else "",
                )
            else:
                yield self._hand_over(
                    reply,
                    ticket,
                    arrived,
                    self._bases[ticket.server_round],
                    staleness=staleness,
                    discount=self.staleness_fn(staleness),
                )

    def folds_late(self, ticket: Ticket, staleness: int) -> bool:
        """Whether a reply ``staleness`` rounds late is folded (late updates).

        With ``late_updates``, up to ``max_staleness`` rounds late, and, with
        partial work, only from a task sent with a ``deadline-s``. The first
        round of an adaptive deadline has none: it closes at the ``p``-th
        percentile's reply, so most of the cohort keeps training its whole
        work on the initial model and replies during the next round, where
        those updates outnumbered the fresh ones and diluted them (digits, 50
        phones all sampled, seed 1: accuracy after round 2 of 45% with them,
        64% without; later rounds' late updates, from tasks sized to a round,
        are few). Measured on the suite: docs/strategies/deadline.md.
        """
        if not self.late_updates or staleness > self.max_staleness:
            return False
        return ticket.deadline_s is not None or not self.partial_work

    def _close_train(
        self,
        server_round: int,
        arrays: ArrayRecord | None,
        metrics: MetricRecord | None,
    ) -> TrainAggregate:
        """Stragglers, durations, expiry, minimum completion, round bookkeeping."""
        assert self._inflight is not None
        unfinished = [
            t
            for t in self._inflight.tickets.values()
            if t.server_round == server_round and t.kind == MessageType.TRAIN
        ]
        stragglers = sorted(t.node_id for t in unfinished)
        self._tally = RoundTally.of(self._sent, self._handed, len(stragglers))
        if stragglers:
            log(
                INFO,
                "round %d: %d stragglers missed the %s: nodes %s",
                server_round,
                len(stragglers),
                "round"
                if self._deadline is None
                else f"{self._deadline:.3g} s deadline",
                stragglers,
            )
        self.history.close_round(
            server_round,
            self._clock.now(),
            self._deadline,
            unfinished,
            self.deadline_window,
        )
        self._expire(server_round)
        fresh = sum(a.usable for a in self._handed if a.staleness == 0)
        late = sum(a.usable for a in self._handed if a.staleness > 0)
        if arrays is not None and fresh + late < self.min_completion:
            log(
                WARNING,
                "round %d: only %d usable replies (< min_completion %d): "
                "keeping the previous model",
                server_round,
                fresh + late,
                self.min_completion,
            )
            return None, None
        if metrics is not None:
            metrics[ROUND_PARTICIPANTS] = fresh
            metrics[ROUND_LATE_UPDATES] = late
            metrics[ROUND_STRAGGLERS] = len(stragglers)
            metrics[ROUND_DEADLINE_S] = (
                -1.0 if self._deadline is None else self._deadline
            )
            metrics[ROUND_DEADLINE_PERCENTILE] = (
                self.percentile if self.adaptive_deadline else -1.0
            )
        return arrays, metrics

    def _stall_cause(self, tally: RoundTally) -> str:
        adaptive = (
            (self.deadline_growth, self._timeout) if self.adaptive_deadline else None
        )
        cause = deadline_stall_cause(
            tally, self.min_completion, self._deadline, adaptive, self.deadline_s
        )
        return super()._stall_cause(tally) if cause is None else cause

    def _expire(self, server_round: int) -> None:
        """Forget work too old to use, and the base models nobody needs any more."""
        assert self._inflight is not None
        oldest = (
            server_round - self.max_staleness if self.late_updates else server_round + 1
        )
        self._inflight.forget(
            self._inflight.ids(
                lambda t: t.kind == MessageType.TRAIN and t.server_round < oldest
            )
        )
        # Keep every base a late reply may still need: replies already pulled into
        # the backlog have no ticket any more but are folded against their base.
        self._bases = {r: b for r, b in self._bases.items() if r >= oldest}

    # -------------------------------------------------------------------- pacer
    def _after_round(self, server_round: int, result: Result) -> None:
        self.adaptive.pace(server_round, result)

    # --------------------------------------------------------------- checkpoint
    def state(self) -> dict[str, Any]:
        """Strategy state plus the deadline's history and pacing."""
        state = super().state()
        state["deadline"] = self.adaptive.state()
        return state

    def load_state(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state` returned; a field out of range raises one
        CheckpointError naming it, and nothing is loaded."""
        load = self.adaptive.reader(StateReader.of(state).section("deadline"))
        super().load_state(state)
        load()
