"""Finding a span job's members: discovery and the profiling query.

:func:`discover` waits until enough nodes are connected; :func:`profile_members`
asks them, with a span query, for their advertised address and profile, and
says why each node that cannot take part is left out.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from logging import INFO, WARNING
from typing import Any

from flowerbed import keys
from flowerbed.parallel.plan import check_address
from flowerbed.replies import ReplyRejected
from flowerbed.strategies.inflight import InFlight
from flowerbed.strategies.sampling import WAIT_FOR_NODES_S
from flowerbed.strategies.span_replies import check_segment_reply
from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid
from flwr.supercore import log


@dataclass
class SpanMember:
    """A node that can take part: its id, advertised address and profile."""

    node_id: int
    address: str
    label: str = ""
    metrics: dict[str, Any] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)


def discover(
    inflight: InFlight, grid: Grid, needed: int, count: int, timeout: float
) -> list[int]:
    """Node ids once ``needed`` are connected or ``timeout`` passed (at most
    ``count``)."""
    clock = inflight.clock
    give_up = clock.now() + timeout
    nodes = sorted(grid.get_node_ids())
    while len(nodes) < needed and clock.now() < give_up:
        log(INFO, "waiting for nodes: %d connected, %d needed", len(nodes), needed)
        clock.wait(WAIT_FOR_NODES_S)
        nodes = sorted(grid.get_node_ids())
    return nodes[:count]


def profile_members(
    inflight: InFlight,
    node_ids: Iterable[int],
    request: Mapping[str, Any],
    timeout: float,
) -> tuple[dict[int, SpanMember], dict[int, str]]:
    """Query ``node_ids`` with ``request`` (a span query); return members, errors.

    A node whose reply is an error (no or a foreign ``address``, no data ...)
    or malformed, or that does not answer within ``timeout``, is left out
    and its reason logged and returned.
    """
    config = ConfigRecord({keys.SPAN_QUERY: json.dumps(dict(request))})
    ids = list(node_ids)
    messages = [
        Message(
            RecordDict({keys.CONFIG: config}),
            dst_node_id=node_id,
            message_type=MessageType.QUERY,
            ttl=timeout,
        )
        for node_id in ids
    ]
    sent = inflight.push(messages, 0)
    members: dict[int, SpanMember] = {}
    errors: dict[int, str] = {}
    for reply, ticket, _ in inflight.replies(
        inflight.clock.now() + timeout, kind=MessageType.QUERY
    ):
        node_id = ticket.node_id
        try:
            if reply.has_error():
                raise ReplyRejected(reply.error.reason or "error reply")
            checked = check_segment_reply(reply)
            address = check_address(checked.info.get("address"), "reply address")
        except (ReplyRejected, ValueError) as err:
            errors[node_id] = str(err)
            log(WARNING, "node %d cannot take part: %s", node_id, err)
            continue
        members[node_id] = SpanMember(
            node_id=node_id,
            address=address,
            label=str(checked.info.get("device", "")),
            metrics=checked.metrics,
            info=checked.info,
        )
    missing = [n for n in ids if n not in members and n not in errors]
    for node_id in missing:
        errors[node_id] = f"no answer to the profiling query within {timeout:g} s"
        log(WARNING, "node %d: %s", node_id, errors[node_id])
    inflight.forget(sent)
    return members, errors
