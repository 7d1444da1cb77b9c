"""DeadlineFedAvg: synchronous rounds that do not wait for stragglers."""

from __future__ import annotations

import math
from collections.abc import Callable
from logging import INFO, WARNING
from pathlib import Path
from typing import Any

import numpy as np
from flowerbed import keys
from flowerbed.clock import Clock
from flwr.app import ArrayRecord, ConfigRecord, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result
from flwr.supercore import log

from .runtime_weighted import (
    DEFAULT_QUARANTINE_AFTER,
    DEFAULT_QUARANTINE_ROUNDS,
    DEFAULT_SPEED_SMOOTHING,
    DEFAULT_WEIGHTING,
    RuntimeWeightedFedAvg,
)
from .utils import (
    ROUND_DEADLINE_S,
    ROUND_LATE_UPDATES,
    ROUND_PARTICIPANTS,
    ROUND_STRAGGLERS,
    MetricsAccumulator,
    StalenessFn,
    UpdateAccumulator,
    polynomial_staleness,
    resolve_staleness_fn,
)

PROGRESS_METRICS = ("accuracy", keys.EVAL_ACC)
"""Metrics the pacer looks for (server-side evaluation first, then federated)."""


class DeadlineFedAvg(RuntimeWeightedFedAvg):
    """Rounds with a deadline, over-selection, partial work and late updates.

    Every mechanism is optional and composes with any ``weighting`` of
    :class:`RuntimeWeightedFedAvg` (FedNova's suits partial work best).

    - **Fixed deadline** ``D = deadline_s``: the round closes ``D`` clock seconds
      after the push; replies after that are stragglers.
    - **Adaptive deadline**: ``D_r = f * P_p(durations of the last W rounds)``,
      the ``p``-th percentile of measured node durations (push to reply), times a
      pacing factor ``f``. The pacer follows Oort (Lai et al., OSDI 2021, Sec. 4.3):
      every ``pacer_window`` rounds it compares the accuracy gained over the last
      window with the window before; when progress slows, ``f *= 1 + pacer_step``
      (more patience, more participants), otherwise ``f *= 1 - pacer_step``;
      ``f`` stays within ``pacing_bounds``. Without history (round 1, no
      ``deadline_s``) the round closes when ``floor(p% of sampled)`` nodes (at
      least one) replied, that round's ``p``-th percentile.
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
      multiplied by ``staleness_fn(s)`` (default ``1/sqrt(1+s)``).
    - **Minimum completion**: a round with fewer than ``min_completion`` usable
      replies keeps the previous model and logs it.
    - **TTLs**: messages expire after ``message_ttl_s``; by default
      ``D * (max_staleness + 2)`` with late updates (the last round that may use
      the reply, plus one deadline of slack), ``2 D`` without (the reply is
      dropped, the expiry error lands after the round), ``timeout`` while ``D``
      is unknown. An expiry error counts towards quarantine, so dead nodes stop
      being sampled.

    Each round's train MetricRecord also carries ``participants``,
    ``late-updates``, ``stragglers`` and ``deadline-s`` (-1 when none).

    Parameters
    ----------
    (FedAvg's and RuntimeWeightedFedAvg's parameters, same defaults), and:
    deadline_s : float, optional (default: None)
        Fixed deadline in clock seconds; with ``adaptive_deadline`` the first
        round's deadline. None: wait for all (FedAvg behaviour) unless adaptive.
    adaptive_deadline : bool (default: False)
        Derive each round's deadline from recent durations (see above).
    deadline_percentile : float (default: 80.0)
        ``p``, in (0, 100].
    deadline_window : int (default: 3)
        ``W``: rounds of durations the percentile looks at.
    pacer_step : float (default: 0.1)
        Relative change of the pacing factor per adjustment (0 disables pacing).
    pacer_window : int (default: 2)
        Rounds per pacing decision.
    pacing_bounds : tuple[float, float] (default: (0.5, 4.0))
        Smallest and largest pacing factor.
    progress_metric : str, optional (default: None)
        Accuracy metric the pacer follows; None looks for ``accuracy`` then
        ``eval-acc``.
    over_selection : float (default: 1.0)
        Sampling factor, >= 1 (1.3 is the customary value).
    partial_work : bool (default: False)
        Send ``deadline-s`` so nodes stop in time and report partial work.
    work_fraction : float (default: 0.8)
        Share of the deadline nodes may train for (the rest is for upload).
    late_updates : bool (default: True)
        Fold replies that miss their round into later rounds.
    max_staleness : int (default: 2)
        Oldest late update (in rounds) still used.
    staleness_fn : str or callable (default: "polynomial", i.e. 1/sqrt(1+s))
        Discount of a late update's weight; a name from
        ``flowerbed.strategies.utils.STALENESS_FUNCTIONS`` or ``s -> factor``.
    min_completion : int, optional (default: None)
        Fewest usable replies to update the model; None means ``min_train_nodes``
        (at least 1).
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
        deadline_s: float | None = None,
        adaptive_deadline: bool = False,
        deadline_percentile: float = 80.0,
        deadline_window: int = 3,
        pacer_step: float = 0.1,
        pacer_window: int = 2,
        pacing_bounds: tuple[float, float] = (0.5, 4.0),
        progress_metric: str | None = None,
        over_selection: float = 1.0,
        partial_work: bool = False,
        work_fraction: float = 0.8,
        late_updates: bool = True,
        max_staleness: int = 2,
        staleness_fn: str | StalenessFn = polynomial_staleness,
        min_completion: int | None = None,
        weighting: str = DEFAULT_WEIGHTING,
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
            (deadline_s is None or deadline_s > 0, "deadline_s must be > 0"),
            (0 < deadline_percentile <= 100, "deadline_percentile must be in (0, 100]"),
            (deadline_window >= 1, "deadline_window must be >= 1"),
            (0 <= pacer_step < 1, "pacer_step must be in [0, 1)"),
            (pacer_window >= 1, "pacer_window must be >= 1"),
            (0 < pacing_bounds[0] <= 1 <= pacing_bounds[1], "pacing_bounds: lo<=1<=hi"),
            (over_selection >= 1, "over_selection must be >= 1"),
            (0 < work_fraction <= 1, "work_fraction must be in (0, 1]"),
            (max_staleness >= 0, "max_staleness must be >= 0"),
            (min_completion is None or min_completion >= 1, "min_completion >= 1"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        self.deadline_s = deadline_s
        self.adaptive_deadline = adaptive_deadline
        self.deadline_percentile = deadline_percentile
        self.deadline_window = deadline_window
        self.pacer_step = pacer_step
        self.pacer_window = pacer_window
        self.pacing_bounds = pacing_bounds
        self.progress_metric = progress_metric
        self.over_selection = over_selection
        self.partial_work = partial_work
        self.work_fraction = work_fraction
        self.late_updates = late_updates
        self.max_staleness = max_staleness
        self.staleness_fn = resolve_staleness_fn(staleness_fn)
        self.min_completion = min_completion or max(1, min_train_nodes)
        self.pacing = 1.0
        self.durations: list[tuple[int, float]] = []
        """``(round, seconds from push to reply)`` of recent replies."""
        self.progress: list[float] = []
        self._deadline: float | None = None
        self._bases: dict[int, dict[str, np.ndarray]] = {}

    def summary(self) -> None:
        """Log the configuration."""
        super().summary()
        log(
            INFO,
            "\t\t├── Deadline: %s (adaptive %s, p%.0f of %d rounds)",
            self.deadline_s,
            self.adaptive_deadline,
            self.deadline_percentile,
            self.deadline_window,
        )
        log(
            INFO,
            "\t\t├── Over-selection %.2f, partial work %s, min completion %d",
            self.over_selection,
            self.partial_work,
            self.min_completion,
        )
        log(
            INFO,
            "\t\t└── Late updates %s (max staleness %d)",
            self.late_updates,
            self.max_staleness,
        )

    # ----------------------------------------------------------------- deadline
    def current_deadline(self, server_round: int) -> float | None:
        """The deadline (clock seconds) for ``server_round``; None if unknown."""
        if not self.adaptive_deadline:
            return self.deadline_s
        recent = [
            d for r, d in self.durations if r > server_round - 1 - self.deadline_window
        ]
        if not recent:
            return self.deadline_s
        return self.pacing * float(np.percentile(recent, self.deadline_percentile))

    def _message_ttl(self) -> float:
        if self.message_ttl_s is not None or self._deadline is None:
            return super()._message_ttl()
        rounds = self.max_staleness + 2 if self.late_updates else 2
        return self._deadline * rounds

    def _node_config(self, node_id: int, config: ConfigRecord) -> ConfigRecord:
        if self.partial_work and self._deadline is not None:
            config[keys.DEADLINE_S] = self.work_fraction * self._deadline
        return config

    def _evaluate_wait(self) -> float:
        return self._deadline if self._deadline is not None else self._timeout

    # -------------------------------------------------------------------- round
    def _train_round(
        self,
        server_round: int,
        config: ConfigRecord,
        grid: Grid,
        clock: Clock,
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        assert self._inflight is not None
        inflight = self._inflight
        self._deadline = self.current_deadline(server_round)
        wanted = self._sample_size(grid, self.fraction_train, self.min_train_nodes)
        if wanted == 0:
            return None, None
        count = math.ceil(wanted * self.over_selection)
        messages = self._train_messages(server_round, self._global, config, grid, count)
        log(
            INFO,
            "configure_train: sampled %d nodes (keeping the first %d), deadline %s",
            len(messages),
            wanted,
            "none" if self._deadline is None else f"{self._deadline:.2f} s",
        )
        self._bases[server_round] = self._global_np
        sent = inflight.push(messages, server_round)
        start = clock.now()
        until = start + (
            self._deadline if self._deadline is not None else self._timeout
        )
        quota = (
            max(1, math.floor(len(sent) * self.deadline_percentile / 100))
            if self.adaptive_deadline and self._deadline is None
            else None
        )
        updates = UpdateAccumulator()
        metrics_acc = MetricsAccumulator(self.weighted_by_key)
        fresh = arrivals = late = 0

        def current_in_flight() -> bool:
            return inflight.outstanding(lambda t: t.server_round == server_round)

        def done() -> bool:
            return (
                fresh >= wanted
                or not current_in_flight()
                or (quota is not None and arrivals >= quota)
            )

        for reply, ticket, arrived in inflight.replies(
            until, kind=MessageType.TRAIN, done=done
        ):
            if not reply.has_error():
                self.durations.append((server_round, arrived - ticket.sent_at))
            staleness = server_round - ticket.server_round
            if staleness == 0:
                arrivals += 1
                fresh += self.fold_train_reply(
                    reply,
                    server_round,
                    updates,
                    metrics_acc,
                    ticket=ticket,
                    arrived=arrived,
                )
            elif not self.late_updates or staleness > self.max_staleness:
                log(
                    INFO,
                    "round %d: dropped a reply from node %d, %d rounds late",
                    server_round,
                    ticket.node_id,
                    staleness,
                )
            else:
                late += self.fold_train_reply(
                    reply,
                    server_round,
                    updates,
                    metrics_acc,
                    ticket=ticket,
                    arrived=arrived,
                    base=self._bases[ticket.server_round],
                    discount=self.staleness_fn(staleness),
                )
        stragglers = sorted(
            t.node_id
            for t in inflight.tickets.values()
            if t.server_round == server_round
        )
        if stragglers:
            log(
                INFO,
                "round %d: %d stragglers missed the %s: nodes %s",
                server_round,
                len(stragglers),
                "round"
                if self._deadline is None
                else f"{self._deadline:.1f} s deadline",
                stragglers,
            )
        self._expire(server_round)
        self.durations = [
            (r, d) for r, d in self.durations if r > server_round - self.deadline_window
        ]
        usable = updates.count
        if usable < self.min_completion:
            log(
                WARNING,
                "round %d: only %d usable replies (< min_completion %d): "
                "keeping the previous model",
                server_round,
                usable,
                self.min_completion,
            )
            return None, None
        arrays, metrics = self._finish(updates, metrics_acc)
        metrics = MetricRecord() if metrics is None else metrics
        metrics[ROUND_PARTICIPANTS] = fresh
        metrics[ROUND_LATE_UPDATES] = late
        metrics[ROUND_STRAGGLERS] = len(stragglers)
        metrics[ROUND_DEADLINE_S] = -1.0 if self._deadline is None else self._deadline
        return arrays, metrics

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
        value = self._progress_value(server_round, result)
        if value is None or not self.adaptive_deadline or self.pacer_step == 0:
            return
        self.progress.append(value)
        w = self.pacer_window
        if len(self.progress) < 2 * w + 1 or server_round % w != 0:
            return
        recent = self.progress[-1] - self.progress[-1 - w]
        before = self.progress[-1 - w] - self.progress[-1 - 2 * w]
        lo, hi = self.pacing_bounds
        if recent < before:
            self.pacing = min(hi, self.pacing * (1 + self.pacer_step))
            change = "slowed: relaxing"
        else:
            self.pacing = max(lo, self.pacing * (1 - self.pacer_step))
            change = "held: tightening"
        log(
            INFO,
            "round %d: accuracy progress %s the deadline (pacing factor %.2f)",
            server_round,
            change,
            self.pacing,
        )

    def _progress_value(self, server_round: int, result: Result) -> float | None:
        names = (self.progress_metric,) if self.progress_metric else PROGRESS_METRICS
        for history in (
            result.evaluate_metrics_serverapp,
            result.evaluate_metrics_clientapp,
        ):
            record = history.get(server_round)
            if record is None:
                continue
            for name in names:
                value = record.get(name)
                if isinstance(value, int | float):
                    return float(value)
        return None

    # --------------------------------------------------------------- checkpoint
    def state(self) -> dict[str, Any]:
        """Strategy state plus the deadline's history and pacing."""
        state = super().state()
        state["deadline"] = {
            "pacing": self.pacing,
            "durations": self.durations,
            "progress": self.progress,
        }
        return state

    def load_state(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state` returned."""
        super().load_state(state)
        saved = state["deadline"]
        self.pacing = float(saved["pacing"])
        self.durations = [(int(r), float(d)) for r, d in saved["durations"]]
        self.progress = [float(v) for v in saved["progress"]]
