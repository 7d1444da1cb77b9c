"""An asynchronous run's bookkeeping by model version (FedBuff).

When a version's buffer is full (:func:`buffer_full`), and its evaluation:
FedBuff sends a version's evaluation and goes on training; each evaluation reply
joins its version's (:class:`VersionEvaluations`), and once all of a version's
replies are in (or the run ends) they are aggregated by the strategy's
``aggregate_evaluate``, a user's override included.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from logging import INFO

from flowerbed.strategies.inflight import Arrival, Ticket, enough_usable
from flwr.app import Message, MetricRecord
from flwr.serverapp.strategy import Result
from flwr.supercore import log

Aggregate = Callable[[int, list[Message]], MetricRecord | None]
"""``aggregate_evaluate(version, replies)``."""


def buffer_full(handed: list[Arrival], buffer_size: int) -> bool:
    """``buffer_size`` usable replies among those ``handed`` over, or as many
    refused ones (replies with content that cannot be used; error replies are
    waited out): a version then closes with what is usable (the model unchanged
    if nothing is), as a synchronous round does, instead of dispatching for ever
    to nodes whose replies cannot be used."""
    if enough_usable(handed, buffer_size):
        return True
    if len(handed) < buffer_size:
        return False
    refused = sum(a.error_code is None and not a.usable for a in handed)
    return refused >= buffer_size


class VersionEvaluations:
    """Each version's evaluation still open: the ids of the replies it waits
    for, and the replies that came (module docstring)."""

    def __init__(self) -> None:
        self.pending: dict[int, tuple[set[str], list[Message]]] = {}

    def expect(self, version: int, ids: list[str]) -> None:
        """Open ``version``'s evaluation, waiting for the replies to ``ids``."""
        if ids:
            self.pending[version] = (set(ids), [])

    def add(
        self, reply: Message, ticket: Ticket, result: Result, aggregate: Aggregate
    ) -> None:
        """Keep an evaluation reply; close its version's when it was the last."""
        pending = self.pending.get(ticket.server_round)
        if pending is None:
            return
        ids, replies = pending
        ids.discard(reply.metadata.reply_to_message_id)
        replies.append(reply)
        if not ids:
            self.close(ticket.server_round, result, aggregate)

    def close(self, version: int, result: Result, aggregate: Aggregate) -> None:
        """``aggregate`` over the version's evaluation replies, into ``result``."""
        _, replies = self.pending.pop(version)
        metrics = aggregate(version, replies)
        if metrics is not None:
            log(INFO, "\t└──> Aggregated MetricRecord: %s", metrics)
            result.evaluate_metrics_clientapp[version] = metrics

    def finish(
        self,
        replies: Iterable[tuple[Message, Ticket, float]],
        result: Result,
        aggregate: Aggregate,
    ) -> None:
        """Take the last ``replies``, then close every evaluation still open."""
        for reply, ticket, _ in replies:
            self.add(reply, ticket, result, aggregate)
        for version in sorted(self.pending):
            self.close(version, result, aggregate)
