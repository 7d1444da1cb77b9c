"""Messages in flight on a clock: pushing tasks, pulling replies as they arrive, and
what the round loop knows about each reply it hands to ``aggregate_train``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from logging import WARNING

import numpy as np
from flowerbed import keys
from flowerbed.clock import Clock
from flowerbed.replies import (
    records_of,
)
from flwr.app import (
    ConfigRecord,
    Message,
)
from flwr.serverapp import Grid
from flwr.supercore import log


@dataclass(frozen=True)
class Ticket:
    """What the strategy remembers about one message in flight."""

    node_id: int
    server_round: int
    sent_at: float
    kind: str
    assigned_steps: int | None = None
    deadline_s: float | None = None
    """The ``deadline-s`` this message gave its node; None if it gave none."""


def _configured(
    message: Message, key: str, kinds: tuple[type, ...]
) -> int | float | None:
    """The first ``key`` of the message's ConfigRecords that is of ``kinds``
    (never a bool); None if there is none."""
    for config in records_of(message.content, ConfigRecord):
        value = config.get(key)
        if isinstance(value, kinds) and not isinstance(value, bool):
            return value  # type: ignore[return-value]
    return None


def _assigned_steps(message: Message) -> int | None:
    steps = _configured(message, keys.LOCAL_STEPS, (int,))
    return None if steps is None else int(steps)


def _deadline_s(message: Message) -> float | None:
    seconds = _configured(message, keys.DEADLINE_S, (int, float))
    return None if seconds is None else float(seconds)


class InFlight:
    """Messages pushed and not yet consumed, pulled on the grid's clock.

    A reply pulled from the grid but not yet handed out (the consumer said it was
    done mid-batch) waits in a backlog and comes out first next time.
    """

    def __init__(self, grid: Grid, clock: Clock) -> None:
        self.grid = grid
        self.clock = clock
        self.tickets: dict[str, Ticket] = {}
        self._backlog: list[tuple[Message, Ticket, float]] = []

    def push(self, messages: Iterable[Message], server_round: int) -> list[str]:
        """Push ``messages``; remember each one's node, round and send time."""
        batch = list(messages)
        if not batch:
            return []
        sent_at = self.clock.now()
        ids = list(self.grid.push_messages(batch))
        pushed = []
        for message, message_id in zip(batch, ids, strict=False):
            if not message_id:
                log(WARNING, "push to node %d failed", message.metadata.dst_node_id)
                continue
            self.tickets[message_id] = Ticket(
                node_id=message.metadata.dst_node_id,
                server_round=server_round,
                sent_at=sent_at,
                kind=message.metadata.message_type,
                assigned_steps=_assigned_steps(message),
                deadline_s=_deadline_s(message),
            )
            pushed.append(message_id)
        return pushed

    def busy_nodes(self, kind: str | None = None) -> set[int]:
        """Nodes with a message of ``kind`` (any kind if None) not yet answered."""
        return {
            t.node_id for t in self.tickets.values() if kind is None or t.kind == kind
        }

    def forget(self, message_ids: Iterable[str]) -> None:
        """Stop waiting for these messages (their replies will be ignored)."""
        gone = set(message_ids)
        for message_id in gone:
            self.tickets.pop(message_id, None)
        self._backlog = [
            item
            for item in self._backlog
            if item[0].metadata.reply_to_message_id not in gone
        ]

    def ids(self, predicate: Callable[[Ticket], bool]) -> list[str]:
        """IDs of unanswered messages whose ticket satisfies ``predicate``."""
        return [i for i, t in self.tickets.items() if predicate(t)]

    def unconsumed(self) -> list[tuple[str, Ticket]]:
        """(message id, ticket) of every message not answered yet or whose reply
        waits in the backlog."""
        waiting = [(i, t) for i, t in self.tickets.items()]
        return waiting + [
            (m.metadata.reply_to_message_id, t) for m, t, _ in self._backlog
        ]

    def outstanding(self, predicate: Callable[[Ticket], bool]) -> bool:
        """True if a matching message is unanswered or its reply not yet consumed."""
        return any(predicate(t) for t in self.tickets.values()) or any(
            predicate(t) for _, t, _ in self._backlog
        )

    def _keep(self, replies: Iterable[Message]) -> None:
        """Put pulled replies nobody has taken yet into the backlog."""
        for reply in replies:
            ticket = self.tickets.pop(reply.metadata.reply_to_message_id, None)
            if ticket is not None:
                self._backlog.append((reply, ticket, self.clock.now()))

    def replies(
        self,
        until: float,
        *,
        kind: str | None = None,
        done: Callable[[], bool] | None = None,
    ) -> Iterator[tuple[Message, Ticket, float]]:
        """Yield ``(reply, ticket, arrival time)`` one at a time as replies arrive.

        Only messages of ``kind`` (all if None) are pulled. Stops when none of them
        is outstanding, when ``done()`` is true, or when the clock passes ``until``.
        Waiting goes through the clock, so on the virtual clock the loop jumps from
        one arrival to the next. Replies pulled but not handed out (``done()``
        turned true, or the consumer closed the iterator) wait in the backlog.
        """

        def matches(ticket: Ticket) -> bool:
            return kind is None or ticket.kind == kind

        def stop() -> bool:
            return done is not None and done()

        while not stop():
            backlog = [i for i, item in enumerate(self._backlog) if matches(item[1])]
            if backlog:
                yield self._backlog.pop(backlog[0])
                continue
            wanted = self.ids(matches)
            if not wanted:
                return
            arrived = False
            batch = list(self.grid.pull_messages(wanted))
            for index, reply in enumerate(batch):
                ticket = self.tickets.pop(reply.metadata.reply_to_message_id, None)
                if ticket is None:
                    continue
                arrived = True
                item = (reply, ticket, self.clock.now())
                if stop():
                    self._backlog.append(item)
                    continue
                try:
                    yield item
                except GeneratorExit:  # the consumer stopped early: keep the rest
                    self._keep(batch[index + 1 :])
                    raise
            if arrived:
                continue
            remaining = until - self.clock.now()
            if remaining <= 0:
                return
            self.clock.wait(remaining)


@dataclass
class Arrival:
    """What the round loop knows about a reply it hands to ``aggregate_train``.

    The loop files one under the reply's ``reply_to_message_id`` before handing
    the reply over; ``aggregate_train`` looks it up and, without one (a reply
    from a direct call, as in Flower's own tests), treats the reply as fresh work
    on the last global model. ``discount`` multiplies the reply's weight and
    ``update_scale`` its update (staleness); ``accepted`` is set once the reply
    has been validated (None: not looked at, e.g. by an overriding
    ``aggregate_train`` that does its own averaging). ``settle``, while set,
    folds the reply's group now (``aggregate_train`` folds replies a few at a
    time, so a reply validated but not yet folded is not yet known to be
    usable: its NaN/Inf check is in the fold); :attr:`usable` calls it.
    """

    ticket: Ticket
    arrived: float
    base: Mapping[str, np.ndarray]
    staleness: int = 0
    discount: float = 1.0
    update_scale: float = 1.0
    error_code: int | None = None
    accepted: bool | None = None
    fault: bool = False
    reason: str = ""
    settle: Callable[[], object] | None = None

    @property
    def usable(self) -> bool:
        """Accepted, or (when nobody validated it) at least not an error reply."""
        if self.settle is not None:
            self.settle()
        if self.accepted is None:
            return self.error_code is None
        return self.accepted


def enough_usable(arrivals: Iterable[Arrival], wanted: int) -> bool:
    """Whether at least ``wanted`` of ``arrivals`` are usable, folding replies
    that wait for their group (:attr:`Arrival.settle`) only when their outcome
    decides it."""
    settled = 0
    waiting: list[Arrival] = []
    for arrival in arrivals:
        if arrival.settle is not None:
            waiting.append(arrival)
        else:
            settled += arrival.usable
    if settled >= wanted or settled + len(waiting) < wanted:
        return settled >= wanted
    return settled + sum(a.usable for a in waiting) >= wanted


class ReplyStream:
    """Replies handed to ``aggregate_train``/``aggregate_evaluate`` as they arrive.

    Iterable once, so the strategy never holds more than one reply (streaming,
    O(model) memory); a second iteration yields nothing and says so, since
    an overriding method that needs two passes must keep them itself
    (``replies = list(replies)``).
    """

    def __init__(self, source: Iterator[Message]) -> None:
        self._source: Iterator[Message] | None = source

    def __iter__(self) -> Iterator[Message]:
        if self._source is None:
            log(
                WARNING,
                "the replies were iterated twice; they stream past once to keep "
                "memory at one model: take list(replies) first to read them twice",
            )
            return iter(())
        source, self._source = self._source, None
        return source
