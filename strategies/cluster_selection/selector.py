"""Training on the chosen configuration: the selector and the grid it shows.

:class:`Selector` holds the chosen configuration, its estimate and the per-round
bookkeeping (failures, drift, re-selection, racing); :class:`SelectedGrid` shows
the wrapped strategy only the chosen nodes and times their replies.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from logging import INFO, WARNING
from typing import TYPE_CHECKING

import numpy as np
from flowerbed import keys
from flowerbed.clock import Clock
from flowerbed.grid import GridWrapper
from flwr.app import (
    ConfigRecord,
    Message,
    MessageType,
)
from flwr.serverapp import Grid
from flwr.supercore import log

from .model import Estimate, NodeModel, Observation, Workload, estimate, fit_node
from .observe import observation_of
from .refine import RaceState, race_next
from .search import Confidence, confidence, search_masks, select

if TYPE_CHECKING:
    from .strategy import ClusterSelection

# Keys ClusterSelection adds to each round's train MetricRecord in the Result.
SELECTION_ESTIMATED_S = "selection-estimated-s"
"""Estimated round time of the configuration that trained the round."""
SELECTION_MEASURED_S = "selection-measured-s"
"""Measured round time: dispatch to the last successful reply, on the grid's clock."""
SELECTION_SIZE = "selection-size"
"""Nodes in the configuration."""


@dataclass
class SelectionRecord:
    """Estimate against measurement for one round (sync) or window of replies (async).

    ``measured_s`` is None when no member replied; ``event`` says why the
    configuration changed after this round, if it did.
    """

    round: int
    members: tuple[int, ...]
    estimated_s: float
    measured_s: float | None
    event: str = ""

    @property
    def drift(self) -> float | None:
        """(measured - estimated) / estimated."""
        if self.measured_s is None:
            return None
        return (self.measured_s - self.estimated_s) / self.estimated_s


@dataclass
class _Batch:
    """Train messages of one round in flight (sync) or one window of replies."""

    round: int
    started: float
    sent: dict[str, tuple[int, float]] = field(default_factory=dict)
    replies: dict[int, tuple[Message | None, float]] = field(default_factory=dict)


class NoCandidates(RuntimeError):
    """Not one node to choose from (ClusterSelection then trains on all)."""


class Selector:
    """The chosen configuration, its estimate, and the per-round bookkeeping."""

    def __init__(
        self,
        owner: ClusterSelection,
        models: dict[int, NodeModel],
        workload: Workload,
        min_size: int,
        clock: Clock,
    ) -> None:
        self.owner = owner
        self.models = models
        self.workload = workload
        self.min_size = min_size
        self.clock = clock
        self.failures: dict[int, int] = {}
        self.gone: set[int] = set()
        self.records: list[SelectionRecord] = []
        self.batch: _Batch | None = None
        self.windows = 0
        self.latest: dict[int, Observation] = {}
        self.confidence: Confidence | None = None
        self.choice = self.choose("initial selection")
        self.explore: Estimate | None = None
        """A rival the next round runs on instead of the choice (racing)."""
        self.race = RaceState(
            budget=math.floor(owner.certainty.race_share * workload.num_rounds),
            settled=workload.mode != "sync" or owner.certainty.race_share <= 0,
        )

    @property
    def current(self) -> Estimate:
        """The configuration the round in progress runs on."""
        return self.explore if self.explore is not None else self.choice

    # --- choosing --------------------------------------------------------------
    def choose(self, reason: str) -> Estimate:
        candidates = [m for n, m in sorted(self.models.items()) if n not in self.gone]
        o = self.owner
        min_size = self.min_size
        if len(candidates) < min_size:
            if not candidates and self.records:
                log(
                    WARNING,
                    "ClusterSelection (%s): no usable node left to choose from; "
                    "keeping %s",
                    reason,
                    list(self.choice.members),
                )
                return self.choice
            if not candidates:
                raise NoCandidates("no node answered profiling usably")
            log(
                WARNING,
                "ClusterSelection (%s): only %d usable node(s), fewer than the "
                "%d the wrapped strategy wants: choosing among them",
                reason,
                len(candidates),
                min_size,
            )
            min_size = len(candidates)
        choice = select(
            candidates,
            self.workload,
            o.goal.objective,
            min_size=min_size,
            search=o.goal.search,
            exhaustive_max_nodes=o.goal.exhaustive_max_nodes,
        )
        masks = self._masks(candidates)
        sure = confidence(
            candidates,
            self.workload,
            o.goal.objective,
            masks,
            power_gain_error=o.certainty.power_gain_error,
            draws=o.certainty.confidence_draws,
        )[o.goal.objective]
        self.confidence = sure
        log(
            INFO,
            "ClusterSelection (%s): %d of %d nodes %s; estimated round %.3gs, "
            "time %.4gs, energy %.4gJ, time-to-accuracy %.4gs",
            reason,
            len(choice.members),
            len(candidates),
            list(choice.members),
            choice.round_s,
            choice.time_s,
            choice.energy_j,
            choice.time_to_accuracy_s,
        )
        if sure.runner_up is None:
            log(INFO, "ClusterSelection: the only candidate configuration")
        else:
            log(
                INFO if not sure.within_uncertainty else WARNING,
                "ClusterSelection: confidence %.0f%% that it beats the other %d "
                "leading configurations (%d draws, power gain error %.0f%%); "
                "runner-up %s is %.2f%% ± %.2f%% behind%s",
                100 * sure.probability,
                sure.candidates - 1,
                o.certainty.confidence_draws,
                100 * o.certainty.power_gain_error,
                list(sure.runner_up),
                100 * sure.gap,
                100 * sure.gap_sd,
                "; within the estimate's uncertainty: "
                f"{len(sure.rivals)} rival(s) {[list(r) for r in sure.rivals]}"
                if sure.within_uncertainty
                else "",
            )
        return choice

    def _masks(self, candidates: Sequence[NodeModel]) -> np.ndarray:
        """The configurations the owner's search considers among ``candidates``."""
        return search_masks(
            candidates,
            self.workload,
            min(self.min_size, len(candidates)),
            self.owner.goal.search,
            exhaustive_max_nodes=self.owner.goal.exhaustive_max_nodes,
        )

    def reselect(self, reason: str) -> None:
        if self.records:
            self.records[-1].event = reason
        self.choice = self.choose(reason)

    def members(self, connected: set[int]) -> list[int]:
        vanished = [n for n in self.current.members if n not in connected]
        if vanished:
            self.gone.update(vanished)
            self.explore = None
            if any(n in self.choice.members for n in vanished):
                self.reselect(f"nodes {vanished} disconnected")
        if self.workload.mode == "sync" and self.batch is not None:
            self.close_batch()
        return sorted(n for n in self.current.members if n in connected)

    # --- watching train messages -----------------------------------------------
    def sent(self, message_id: str, message: Message) -> None:
        now = self.clock.now()
        config = message.content.config_records.get(keys.CONFIG, ConfigRecord())
        server_round = config.get(keys.SERVER_ROUND, 0)
        server_round = int(server_round) if isinstance(server_round, int) else 0
        if self.batch is None:
            index = server_round if self.workload.mode == "sync" else self.windows + 1
            self.batch = _Batch(index, now)
        self.batch.sent[message_id] = (message.metadata.dst_node_id, now)

    def received(self, reply: Message) -> None:
        batch = self.batch
        key = reply.metadata.reply_to_message_id
        if batch is None or key not in batch.sent:
            return
        node, dispatched = batch.sent[key]
        arrived = self.clock.now()
        batch.replies[node] = (None if reply.has_error() else reply, arrived)
        self._observe(node, reply, arrived - dispatched)
        if self.workload.mode == "sync":
            if len(batch.replies) == len(batch.sent):
                self.close_batch()
        elif len(batch.replies) >= len(self.choice.members):
            self.close_batch()

    def _observe(self, node: int, reply: Message, round_trip_s: float) -> None:
        steps = self.workload.member_steps(len(self.current.members))
        obs = observation_of(reply, round_trip_s, steps, 2)
        if obs is None:
            self.failures[node] = self.failures.get(node, 0) + 1
            return
        self.failures[node] = 0
        self.latest[node] = obs
        if not self.race.settled:
            self.owner.observations.setdefault(node, []).append(obs)

    def close_batch(self) -> None:
        batch, self.batch = self.batch, None
        if batch is None:
            return
        answered = set(batch.replies)
        for node, _ in batch.sent.values():
            if node not in answered:
                self.failures[node] = self.failures.get(node, 0) + 1
        ok = [t for r, t in batch.replies.values() if r is not None]
        current = self.current
        estimated = current.round_s
        if self.workload.mode == "sync":
            measured = max(ok) - batch.started if ok else None
        else:
            self.windows += 1
            measured = (max(ok) - batch.started) / len(ok) if ok else None
        record = SelectionRecord(batch.round, current.members, estimated, measured)
        self.records.append(record)
        log(
            INFO,
            "ClusterSelection %s %d: estimated %.3gs, measured %s (%s)",
            "round" if self.workload.mode == "sync" else "window",
            batch.round,
            estimated,
            "none" if measured is None else f"{measured:.3g}s",
            "no reply"
            if record.drift is None
            else f"{100 * record.drift:+.1f}% off the estimate",
        )
        tracking = self.owner.tracking
        lost = [
            n
            for n in current.members
            if self.failures.get(n, 0) >= tracking.drop_after_failures
        ]
        if self.explore is not None:
            record.event = "racing: a round on a rival"
            self.explore = None
        if lost:
            self.gone.update(lost)
            self.reselect(
                f"nodes {lost} failed {tracking.drop_after_failures} times in a row"
            )
        elif record.drift is not None and abs(record.drift) > tracking.drift_tolerance:
            self._refit()
            self.reselect(
                f"measurement {100 * record.drift:+.1f}% off the estimate (tolerance "
                f"{100 * tracking.drift_tolerance:.0f}%): models refitted"
            )
        if self.race.tick():
            self._race_step()

    def _race_step(self) -> None:
        """Refit from every reply so far; pick the choice and the next round's set.

        See :func:`~flowerbed.strategies.cluster_selection.race_next`.
        """
        o = self.owner
        usable = {
            n: obs for n, obs in o.observations.items() if obs and n not in self.gone
        }
        self.models = o.profiler.fit(usable)
        o.node_models = self.models
        candidates = [m for _, m in sorted(self.models.items())]
        if len(candidates) < self.min_size:
            return
        masks = self._masks(candidates)
        choice, run = race_next(
            candidates,
            self.workload,
            o.goal.objective,
            masks,
            self.race,
            target=o.certainty.target_confidence,
            indifference=o.certainty.indifference,
            draws=o.certainty.confidence_draws,
        )
        if choice != self.choice.members:
            log(
                INFO,
                "ClusterSelection racing: with the rounds' replies, %s now leads "
                "(was %s)",
                list(choice),
                list(self.choice.members),
            )
            self.choice = estimate(candidates, choice, self.workload)
        if run != choice:
            self.explore = estimate(candidates, run, self.workload)
            log(
                INFO,
                "ClusterSelection racing: the next round runs on rival %s "
                "(%d of at most %d rounds on rivals)",
                list(run),
                self.race.explored,
                self.race.budget,
            )
        if self.race.settled:
            log(
                INFO,
                "ClusterSelection racing: settled on %s after %d round(s) on rivals",
                list(self.choice.members),
                self.race.explored,
            )

    def _refit(self) -> None:
        """Replace s_i and c_i by the members' latest training tasks.

        A task without ``train-time-s`` (a plain Flower client) gives one
        equation for two unknowns: then both are scaled by measured over
        estimated round trip, ``r / (c_i + s_i n)``, keeping their ratio from
        profiling.
        """
        for node, obs in self.latest.items():
            model = self.models[node]
            try:
                fitted = fit_node(node, [obs])
                step_s, overhead_s = fitted.step_s, fitted.overhead_s
            except ValueError:
                predicted = model.overhead_s + model.step_s * obs.steps
                if not (predicted > 0 and obs.round_trip_s > 0):
                    continue
                factor = obs.round_trip_s / predicted
                step_s, overhead_s = model.step_s * factor, model.overhead_s * factor
                self.owner.fallback_once(
                    "refit",
                    "ClusterSelection: replies carry no train-time-s; refitting a "
                    "drifted node scales its step time and overhead by measured "
                    "over estimated round trip",
                )
            self.models[node] = replace(model, step_s=step_s, overhead_s=overhead_s)


class SelectedGrid(GridWrapper):
    """A Grid that shows the wrapped strategy only the chosen nodes.

    It passes everything to the inner grid; ``get_node_ids`` returns the chosen
    configuration (re-selecting first if a member disconnected), synchronous train
    messages get the configuration's ``local-steps`` (the round's work split over
    the members), and train replies are timed against the estimate.
    """

    def __init__(self, inner: Grid, selector: Selector) -> None:
        super().__init__(inner)
        self.selector = selector

    def get_node_ids(self) -> Iterable[int]:
        return self.selector.members(set(self.inner.get_node_ids()))

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        messages = list(messages)
        selector = self.selector
        train = [m for m in messages if m.metadata.message_type == MessageType.TRAIN]
        if selector.workload.mode == "sync" and selector.workload.split:
            steps = selector.workload.member_steps(len(selector.current.members))
            for message in train:
                config = message.content.config_records.get(keys.CONFIG)
                if config is not None:
                    config[keys.LOCAL_STEPS] = steps
        ids = list(self.inner.push_messages(messages))
        for message, message_id in zip(messages, ids, strict=True):
            if message.metadata.message_type == MessageType.TRAIN:
                selector.sent(message_id, message)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        replies = list(self.inner.pull_messages(message_ids))
        for reply in replies:
            self.selector.received(reply)
        return replies
