"""Sending a span job's segment and gathering what becomes of its members.

:func:`segment_messages` builds one train message per member (its plan, its
arrays, its optimiser state); :class:`SegmentGather` pushes them and tells apart
the ways a segment can end (a lost peer, an error reply, a malformed reply), as
the module docstring of :mod:`flowerbed.strategies.span` describes, waiting for
the silent members at most as long as that describes (:data:`LOST_CONFIRM_S`,
:data:`LIVENESS_CHECK_S`, the grace period).
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping
from logging import INFO, WARNING
from typing import cast

import numpy as np
from flowerbed import keys
from flowerbed.parallel.plan import PLAN_KEY, MemberPlan
from flowerbed.replies import ReplyRejected
from flowerbed.strategies.inflight import InFlight, Ticket
from flowerbed.strategies.span_replies import (
    SegmentOutcome,
    SegmentReply,
    check_segment_reply,
    port_in_use,
)
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, RecordDict
from flwr.common.constant import ErrorCode
from flwr.supercore import log

GONE_CODES = (
    ErrorCode.MESSAGE_UNAVAILABLE,
    ErrorCode.REPLY_MESSAGE_UNAVAILABLE,
    ErrorCode.NODE_UNAVAILABLE,
    ErrorCode.CLIENT_APP_CRASHED,
)
"""Flower error codes that mean the member's node or process is gone (lost), as
opposed to an error its ClientApp reported (alive, plan or board problem)."""

LOST_CONFIRM_S = 1.0
"""Seconds the server still waits for members that survivors named gone, once
everyone else has answered: a SuperNode pushes a finished ClientApp's reply
within half a second (flwr's SuperNode loop), so a member that left just before
it was probed is heard from in time, while a dead one costs only this."""
LIVENESS_CHECK_S = 1.0
"""Seconds between the server's own liveness checks of members not heard from,
once a member reported a loss (:meth:`SegmentGather.run`)."""


def arrayrecord(arrays: Mapping[str, np.ndarray]) -> ArrayRecord:
    return ArrayRecord({k: Array(np.asarray(v)) for k, v in arrays.items()})


def segment_messages(
    plans: Mapping[int, MemberPlan],
    arrays: Mapping[int, Mapping[str, np.ndarray]],
    optimizer: Mapping[int, Mapping[str, np.ndarray]],
    config: ConfigRecord,
    ttl: float,
    keys_of: tuple[str, str],
) -> list[Message]:
    """One train message per member: ``config`` plus its plan, and its arrays
    (``keys_of``: the ConfigRecord's and the ArrayRecord's keys)."""
    config_key, arrays_key = keys_of
    messages = []
    for node_id, plan in plans.items():
        record = ConfigRecord(dict(config))
        record.update(plan.to_config())
        content = RecordDict({config_key: record})
        if arrays.get(node_id):
            content[arrays_key] = arrayrecord(arrays[node_id])
        if optimizer.get(node_id):
            content[keys.SPAN_OPTIMIZER] = arrayrecord(optimizer[node_id])
        messages.append(
            Message(
                content, dst_node_id=node_id, message_type=MessageType.TRAIN, ttl=ttl
            )
        )
    return messages


class SegmentGather:
    """Pushes one segment's messages and gathers what becomes of every member.

    Parameters
    ----------
    inflight : InFlight
        The strategy's in-flight bookkeeping (its grid and clock).
    config_key : str
        Where the messages carry their plans (each member's rank).
    grace : callable
        ``grace(join)``: seconds the others are waited for once a member reported
        a loss or erred (``join``: while joining).
    bad_ports : set of int
        Rendezvous ports reported in use; a port an error reply names is added.
    check : callable, optional
        Rejects a reply (raises :class:`ReplyRejected`) on mode-specific grounds.
    """

    def __init__(
        self,
        inflight: InFlight,
        config_key: str,
        grace: Callable[[bool], float],
        bad_ports: set[int],
        check: Callable[[SegmentReply], object] | None,
    ) -> None:
        self.inflight, self.config_key = inflight, config_key
        self.grace, self.bad_ports, self.check = grace, bad_ports, check
        self.clock = inflight.clock

    def run(
        self, messages: Iterable[Message], server_round: int, timeout: float
    ) -> SegmentOutcome:
        """Push ``messages`` and gather what becomes of every member (see
        :meth:`flowerbed.strategies.span.SpanJobStrategy.run_segment`)."""
        start = self.clock.now()
        messages = list(messages)
        ranks = _ranks(messages, self.config_key)
        sent = self.inflight.push(messages, server_round)
        members = {self.inflight.tickets[i].node_id for i in sent}
        outcome = SegmentOutcome()
        until = [start + timeout]  # a grace period or a naming brings it forward
        # node -> why it is gone: named by survivors (reporter -> their failure
        # text) or by Flower's error code (reporter 0, the SuperLink)
        gone: dict[int, dict[int, str]] = {}

        check_at = [math.inf]  # the server's next liveness check (after a loss)

        def settle(now: float) -> None:
            silent = members - outcome.answered
            if silent and silent <= set(gone):
                until[0] = min(until[0], now + LOST_CONFIRM_S)

        def bound() -> float:
            return min(until[0], check_at[0])

        while True:
            for reply, ticket in self._replies(bound):
                join = self._file_reply(reply, ticket.node_id, outcome, ranks, gone)
                now = self.clock.now()
                if join is not None:
                    until[0] = min(until[0], now + self.grace(join))
                    check_at[0] = min(check_at[0], now + LIVENESS_CHECK_S)
                settle(now)
            now = self.clock.now()
            silent = members - outcome.answered
            if not silent or now >= until[0]:
                break
            self._check_liveness(silent - set(gone), gone)
            check_at[0] = now + LIVENESS_CHECK_S
            settle(now)
        outcome.lost = members - outcome.answered
        for node_id in sorted(outcome.lost):
            _log_lost(node_id, ranks.get(node_id, -1), gone.get(node_id))
        self.inflight.forget(sent)
        outcome.seconds = self.clock.now() - start
        return outcome

    def _check_liveness(
        self, silent: set[int], gone: dict[int, dict[int, str]]
    ) -> None:
        """The server's own liveness check of members not heard from: a node the
        SuperLink no longer lists (it deregistered, or missed its heartbeats)
        is gone (reporter 0, the SuperLink)."""
        if not silent:
            return
        listed = set(self.inflight.grid.get_node_ids())
        for node_id in sorted(silent - listed):
            gone.setdefault(node_id, {})[0] = (
                "the SuperLink no longer lists its node (it left, or missed its "
                "heartbeats)"
            )

    def _file_reply(
        self,
        reply: Message,
        node_id: int,
        outcome: SegmentOutcome,
        ranks: Mapping[int, int],
        gone: dict[int, dict[int, str]],
    ) -> bool | None:
        """File one segment reply into ``outcome`` (and ``gone``); return whether
        it starts a grace period for the others (True: a join-phase one), or None."""
        if reply.has_error():
            reason = reply.error.reason or f"error code {reply.error.code}"
            if reply.error.code in GONE_CODES:
                log(WARNING, "segment: node %d is gone: %s", node_id, reason)
                gone.setdefault(node_id, {})[0] = reason
                return None  # counted as lost
            outcome.errors[node_id] = reason
            log(WARNING, "segment: node %d answered with an error: %s", node_id, reason)
            port = port_in_use(reason)
            if port is not None:
                self.bad_ports.add(port)
            return True
        try:
            checked = check_segment_reply(reply)
            if self.check is not None:
                self.check(checked)
        except ReplyRejected as err:
            outcome.rejected[node_id] = err.reason
            log(
                WARNING, "segment: rejected reply from node %d: %s", node_id, err.reason
            )
            return False
        outcome.replies[node_id] = checked
        if checked.ok:
            return None
        log(INFO, "segment: node %d lost a peer: %s", node_id, checked.failure)
        for lost in _named_nodes(checked, ranks, node_id):
            gone.setdefault(lost, {})[node_id] = checked.failure
        return checked.failure.startswith("join")

    def _replies(self, until: Callable[[], float]) -> Iterator[tuple[Message, Ticket]]:
        """Train replies as they arrive until ``until()`` (which a grace period
        may bring forward while this runs). Each wait is bounded by the current
        ``until()``, so on the virtual clock a grace period ends the wait when it
        expires instead of at the next arrival (a lost member's TTL expiry)."""
        while True:
            bound = until()
            pulled = cast(
                Generator[tuple[Message, Ticket, float], None, None],
                self.inflight.replies(
                    bound,
                    kind=MessageType.TRAIN,
                    done=lambda: self.clock.now() >= until(),
                ),
            )
            # closing it hands replies pulled but not yet taken back to the backlog
            with contextlib.closing(pulled) as replies:
                for reply, ticket, _ in replies:
                    yield reply, ticket
                    if until() < bound:
                        break  # a grace period began: wait at most until then
                else:
                    return


def _log_lost(node_id: int, rank: int, gone: Mapping[int, str] | None) -> None:
    """Log why a member counts as lost: who found it gone, or its silence."""
    if gone:
        log(
            WARNING,
            "segment: node %d (rank %d) is lost: %s found it gone (%s)",
            node_id,
            rank,
            ", ".join("the SuperLink" if n == 0 else f"node {n}" for n in sorted(gone)),
            next(iter(gone.values())),
        )
    else:
        log(
            WARNING,
            "segment: no reply from node %d (rank %d) within the grace "
            "period: counted as lost",
            node_id,
            rank,
        )


def _ranks(messages: Iterable[Message], config_key: str) -> dict[int, int]:
    """Node -> rank, from the plans the segment's messages carry."""
    out: dict[int, int] = {}
    for message in messages:
        config = message.content.config_records.get(config_key)
        raw = config.get(PLAN_KEY) if config is not None else None
        if isinstance(raw, str):
            with contextlib.suppress(ValueError, TypeError, AttributeError):
                out[message.metadata.dst_node_id] = int(json.loads(raw)["rank"])
    return out


def _named_nodes(
    reply: SegmentReply, ranks: Mapping[int, int], reporter: int
) -> list[int]:
    """The members a failed reply names gone (``span-lost-ranks``); ranks that are
    not in the segment, or the reporter's own, are ignored and logged."""
    value = reply.metrics.get(keys.SPAN_LOST_RANKS, [])
    values = value if isinstance(value, list) else [value]
    by_rank = {rank: node for node, rank in ranks.items()}
    out = []
    for rank in values:
        node = by_rank.get(int(rank)) if float(rank).is_integer() else None
        if node is None or node == reporter:
            log(
                WARNING,
                "segment: node %d names rank %r gone, which is not a peer of its "
                "segment (ranks %s): ignored",
                reporter,
                rank,
                sorted(by_rank),
            )
            continue
        out.append(node)
    return out
