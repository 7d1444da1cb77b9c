"""How ``aggregate_train`` folds train replies: validated, weighted, folded in groups.

A reply is staged (checked against the model it trained from, weighted by the
strategy's :meth:`~flowerbed.strategies.RuntimeWeightedFedAvg.reply_weight`),
folded with up to :data:`FOLD_GROUP` - 1 others in one pass of the sum
(:meth:`~flowerbed.strategies.accumulation.UpdateAccumulator.add_many`), then
settled: accepted (its node's speed and quarantine record updated, its metrics
kept) or rejected with its reason (logged, counted towards quarantine when it is
the node's fault).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from logging import WARNING
from typing import Protocol

import numpy as np
from flowerbed import keys
from flowerbed.replies import ArraySpec, ReplyRejected, check_train_reply, spec_of
from flowerbed.strategies.accumulation import (
    MetricsAccumulator,
    Update,
    UpdateAccumulator,
    check_positive,
)
from flowerbed.strategies.inflight import Arrival, Ticket
from flowerbed.strategies.sampling import Quarantine
from flwr.app import Message, MetricRecord
from flwr.supercore import log

from . import fold_kernel
from .rejections import RejectionLog
from .reply_weights import ReplyWeights
from .robust import Reference, UpdateSum

FOLD_GROUP = fold_kernel.MOST
"""Replies ``aggregate_train`` folds per pass (:meth:`UpdateAccumulator.add_many`:
the model they trained from and the sum are read once for the group); at most
this many replies are held at a time."""


@dataclass
class TrainFold:
    """The running sums of one ``aggregate_train`` call, and its counts."""

    metrics: MetricsAccumulator
    updates: UpdateSum = field(default_factory=UpdateAccumulator)
    reference: dict[str, ArraySpec] | None = None
    """Names, shapes, dtypes replies must have when no global model is known."""
    zeros: dict[str, np.ndarray] | None = None
    """Base of replies averaged as they are (no global model known)."""
    results: int = 0
    failures: int = 0

    def zeros_like(self, arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The base of replies averaged as they are; the first one fixes the spec."""
        if self.zeros is None:
            self.reference = spec_of(arrays)
            self.zeros = {k: np.zeros(v.shape, v.dtype) for k, v in arrays.items()}
        return self.zeros

    def base(self, global_np: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """What the updates were taken against: the global model ``global_np``,
        or zeros when the replies are averaged as they are."""
        return self.zeros if self.zeros is not None else global_np

    def model(
        self,
        global_np: dict[str, np.ndarray],
        *,
        fednova: bool,
        step_size: float,
        warn: Callable[[str, str], None],
    ) -> dict[str, np.ndarray]:
        """The new model from the sums, steps normalised with ``fednova`` and the
        step scaled by ``step_size``; replies averaged as they are (no global
        model) take neither, which ``warn`` says once."""
        absolute = self.zeros is not None
        if absolute and (fednova or step_size != 1.0):
            warn(
                "absolute",
                "aggregate_train without a global model: averaging the replies' "
                "arrays as FedAvg does (step normalisation and the server "
                "learning rate need the model the nodes trained from)",
            )
        return self.updates.result(
            self.base(global_np),
            normalise_steps=fednova and not absolute,
            step_size=1.0 if absolute else step_size,
        )


@dataclass
class Staged:
    """A validated train reply waiting for its group's pass."""

    reply: Message
    node: int
    arrival: Arrival | None
    metrics: MetricRecord
    n: float
    update: Update


WeighReply = Callable[
    [MetricRecord, float, Ticket | None, float | None], tuple[float, float, float]
]
"""``reply_weight(metrics, num_examples, ticket, arrived)``."""
UpdateSpeed = Callable[[int, MetricRecord, Ticket | None, float | None], None]
"""``_update_speed(node_id, metrics, ticket, arrived)``."""


class FoldingStrategy(Protocol):
    """What a :class:`ReplyFolder` reads from its strategy: the reply limits,
    the replies' arrivals, the weighting and the hooks a subclass may override."""

    weighted_by_key: str
    max_num_examples: float
    weight_cap: float | None
    recent_weights: Reference
    quarantine: Quarantine
    rejections: RejectionLog
    reply_weights: ReplyWeights
    _arrivals: dict[str, Arrival]
    _global_np: dict[str, np.ndarray]

    @property
    def reply_weight(self) -> WeighReply:
        """``(w_i, c_i, tau_i)`` of a reply (an override included)."""

    @property
    def _update_speed(self) -> UpdateSpeed:
        """What a reply tells of its node's speed (an override included)."""


class ReplyFolder:
    """Stages, folds and settles one strategy's train replies (module docstring)."""

    def __init__(self, strategy: FoldingStrategy) -> None:
        self.strategy = strategy

    def stage(
        self, reply: Message, server_round: int, fold: TrainFold
    ) -> Staged | None:
        """Validate one train reply and work out its weight: what folding it
        needs, or None when it was rejected (logged, counted)."""
        strategy = self.strategy
        arrival = strategy._arrivals.get(reply.metadata.reply_to_message_id)
        ticket = arrival.ticket if arrival is not None else None
        arrived = arrival.arrived if arrival is not None else None
        node = reply.metadata.src_node_id if ticket is None else ticket.node_id
        base: Mapping[str, np.ndarray] | None = (
            arrival.base if arrival is not None else strategy._global_np
        )
        if reply.has_error():
            fold.failures += 1
        else:
            fold.results += 1
        discount = arrival.discount if arrival is not None else 1.0
        update_scale = arrival.update_scale if arrival is not None else 1.0
        try:
            arrays, metrics, n = check_train_reply(
                reply,
                spec_of(base) if base else fold.reference,
                strategy.weighted_by_key,
                max_weight=strategy.max_num_examples,
            )
            weight, scale, steps = strategy.reply_weight(metrics, n, ticket, arrived)
            if not base:  # no model known: average the arrays as they are
                base, scale = fold.zeros_like(arrays), 1.0
            update = Update(
                arrays, base, weight * discount, scale * update_scale, steps
            )
            # as the sum would refuse it: an unusable reply, before its group
            check_positive("weight", update.weight)
            strategy.rejections.weight_capped(
                node,
                update.weight,
                n,
                strategy.weight_cap,
                strategy.recent_weights.median(),
            )
        except ReplyRejected as rejection:
            self.settle_rejected(reply, server_round, node, arrival, rejection)
            return None
        except Exception as err:  # whatever a reply holds, the run goes on
            self.reject_unusable(reply, server_round, node, err, arrival)
            return None
        return Staged(reply, node, arrival, metrics, n, update)

    def fold_all(
        self, replies: Iterable[Message], server_round: int, fold: TrainFold
    ) -> None:
        """Stage each reply as it comes; fold them :data:`FOLD_GROUP` at a time."""
        group = FoldGroup(self, server_round, fold)
        for reply in replies:
            item = self.stage(reply, server_round, fold)
            if item is not None:
                group.add(item)
        group.fold()

    def fold(
        self, group: list[Staged], server_round: int, fold: TrainFold
    ) -> list[bool]:
        """Fold staged replies in one pass (the sum decides each one's bounds in
        order); settle each: accepted, or rejected with its reason."""
        try:
            outcomes = fold.updates.add_many([s.update for s in group])
        except Exception as err:  # a fault of the sum: find which reply broke it
            if len(group) == 1:
                staged = group[0]
                return [
                    self.reject_unusable(
                        staged.reply, server_round, staged.node, err, staged.arrival
                    )
                ]
            log(
                WARNING,
                "round %d: folding %d replies together failed (%s: %s); folding "
                "them one at a time",
                server_round,
                len(group),
                type(err).__name__,
                err,
            )
            return [
                ok for staged in group for ok in self.fold([staged], server_round, fold)
            ]
        return [
            self.settle(staged, outcome, server_round, fold)
            for staged, outcome in zip(group, outcomes, strict=True)
        ]

    def settle(
        self,
        staged: Staged,
        outcome: float | ReplyRejected,
        server_round: int,
        fold: TrainFold,
    ) -> bool:
        """After the fold: count a staged reply as accepted, or reject it."""
        if isinstance(outcome, ReplyRejected):
            self.settle_rejected(
                staged.reply, server_round, staged.node, staged.arrival, outcome
            )
            return False
        strategy = self.strategy
        arrival = staged.arrival
        if arrival is not None:
            arrival.accepted = True
        strategy.quarantine.record_success(staged.node)
        if keys.NUM_STEPS in staged.metrics:
            strategy.reply_weights.recent_steps.add(staged.update.steps)
        strategy._update_speed(
            staged.node,
            staged.metrics,
            arrival.ticket if arrival is not None else None,
            arrival.arrived if arrival is not None else None,
        )
        fold.metrics.add(staged.metrics, staged.n)
        return True

    def settle_rejected(
        self,
        reply: Message,
        server_round: int,
        node: int,
        arrival: Arrival | None,
        rejection: ReplyRejected,
    ) -> None:
        """A rejected reply: logged, counted towards quarantine when it is the
        node's fault, and marked on its arrival."""
        self.strategy.rejections.train(reply, server_round, node, rejection)
        if rejection.fault:
            self.strategy.quarantine.record_failure(node, server_round)
        if arrival is not None:
            arrival.accepted, arrival.reason = False, rejection.reason
            arrival.fault = rejection.fault

    def reject_unusable(
        self,
        reply: Message,
        server_round: int,
        node: int,
        err: Exception,
        arrival: Arrival | None,
    ) -> bool:
        """A reply that broke validation itself: rejected like any bad reply."""
        rejection = ReplyRejected(f"unusable reply ({type(err).__name__}: {err})")
        self.settle_rejected(reply, server_round, node, arrival, rejection)
        return False


class FoldGroup:
    """Train replies staged for one pass: folded when :data:`FOLD_GROUP` are
    staged, at the end of ``aggregate_train``, or when the round loop asks
    whether one of them is usable (``Arrival.settle``)."""

    def __init__(self, folder: ReplyFolder, server_round: int, fold: TrainFold) -> None:
        self.folder = folder
        self.server_round = server_round
        self.train_fold = fold
        self.staged: list[Staged] = []

    def add(self, item: Staged) -> None:
        """Stage ``item``; fold the group once it holds :data:`FOLD_GROUP`."""
        self.staged.append(item)
        if item.arrival is not None:
            item.arrival.settle = self.fold
        if len(self.staged) >= FOLD_GROUP:
            self.fold()

    def fold(self) -> None:
        """Fold what is staged in one pass."""
        staged, self.staged = self.staged, []
        for item in staged:
            if item.arrival is not None:
                item.arrival.settle = None
        if staged:
            self.folder.fold(staged, self.server_round, self.train_fold)
