"""The in-process fleet engine: a Flower ``Grid`` that runs nodes on a virtual clock.

``FleetGrid`` runs each node's ClientApp in this process the moment a message is
pushed, and schedules the reply at the virtual time the node's device would have
delivered it: dispatch time plus the durations the node reports
(``train-time-s`` + ``comm-time-s`` + ``eval-time-s``). ``pull_messages`` returns only
replies that have arrived by the virtual now, so any ServerApp and strategy written
against Flower's ``Grid`` runs unchanged, deterministically, and much faster than
real time. A node that vanishes never replies; like Flower's SuperLink, the engine
then answers with an error once the message's TTL has expired.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from flowerbed import keys
from flowerbed.clock import collect_replies
from flowerbed.sims.vclock import NodeDropout
from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import SUPERLINK_NODE_ID, ErrorCode
from flwr.serverapp import Grid
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

log = logging.getLogger(__name__)

DURATION_KEYS = (keys.TRAIN_TIME_S, keys.COMM_TIME_S, keys.EVAL_TIME_S)
"""Reply metrics whose sum is the virtual time from dispatch to arrival."""


class VirtualClock:
    """Virtual seconds since the run started; only the engine's events move it."""

    def __init__(self, engine: FleetGrid) -> None:
        self._engine = engine
        self._now = 0.0

    def now(self) -> float:
        return self._now

    def wait(self, seconds: float) -> None:
        """Advance to the next reply arrival or by ``seconds``, whichever is first."""
        target = self._now + max(0.0, seconds)
        upcoming = self._engine.next_arrival_after(self._now)
        if upcoming is not None:
            target = min(target, upcoming)
        if math.isinf(target):
            raise RuntimeError(
                "waiting forever on the virtual clock with no reply in flight"
            )
        self._now = target


@dataclass(frozen=True)
class SimNode:
    """One simulated node: Flower node id and the node_config its ClientApp sees."""

    node_id: int
    node_config: Mapping[str, bool | float | int | str]


@dataclass(order=True)
class _Pending:
    arrival: float
    seq: int
    message_id: str = field(compare=False)
    reply: Message = field(compare=False)


class FleetGrid(Grid):
    """Flower ``Grid`` over simulated nodes, releasing replies in virtual-time order.

    Parameters
    ----------
    client_app : ClientApp
        The ClientApp every node runs.
    nodes : Sequence[SimNode]
        The fleet's nodes.
    run_config : Mapping
        Flower run config handed to every node's ``Context``.
    run_id : int (default: 1)
        Run id stamped on messages.
    """

    def __init__(
        self,
        client_app: ClientApp,
        nodes: Sequence[SimNode],
        run_config: Mapping[str, bool | float | int | str],
        run_id: int = 1,
    ) -> None:
        self.client_app = client_app
        self.clock = VirtualClock(self)
        self._nodes = {n.node_id: n for n in nodes}
        if len(self._nodes) != len(nodes):
            raise ValueError("node ids must be unique")
        self._contexts = {
            n.node_id: Context(
                run_id=run_id,
                node_id=n.node_id,
                node_config=dict(n.node_config),
                state=RecordDict(),
                run_config=dict(run_config),
            )
            for n in nodes
        }
        self._run = Run.create_empty(run_id)
        self._seq = itertools.count()
        self._in_flight: list[_Pending] = []
        self._arrived: dict[str, Message] = {}
        self.messages_run = 0
        # Messages built by strategies need a task identity, as inside a ServerApp.
        if TaskIdentity._run_id is None:
            TaskIdentity.run_id = run_id
        if TaskIdentity._node_id is None:
            TaskIdentity.node_id = SUPERLINK_NODE_ID
        if TaskIdentity._task_id is None:
            TaskIdentity.task_id = 0

    # --- Grid API -----------------------------------------------------------------
    def set_run(self, run: Run) -> None:
        self._run = run

    @property
    def run(self) -> Run:
        return self._run

    def create_message(
        self,
        content: RecordDict,
        message_type: str,
        dst_node_id: int,
        group_id: str,
        ttl: float | None = None,
    ) -> Message:
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        return sorted(self._nodes)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids = []
        for message in messages:
            if message.metadata.dst_node_id not in self._nodes:
                raise ValueError(
                    f"message for unknown node {message.metadata.dst_node_id}"
                )
            seq = next(self._seq)
            message_id = f"sim-{seq:09d}"
            message.metadata.__dict__["_message_id"] = message_id
            reply, after_s = self._execute(message)
            ttl = message.metadata.ttl
            if after_s > ttl:  # too late: the reply is dropped, the TTL expires
                reply = Message(
                    Error(
                        ErrorCode.REPLY_MESSAGE_UNAVAILABLE,
                        f"no reply within the message's TTL of {ttl:g} s",
                    ),
                    reply_to=message,
                )
                after_s = ttl
            heapq.heappush(
                self._in_flight,
                _Pending(self.clock.now() + after_s, seq, message_id, reply),
            )
            ids.append(message_id)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        now = self.clock.now()
        while self._in_flight and self._in_flight[0].arrival <= now:
            item = heapq.heappop(self._in_flight)
            self._arrived[item.message_id] = item.reply
        wanted = set(message_ids)
        found = [mid for mid in self._arrived if mid in wanted]
        return [self._arrived.pop(mid) for mid in found]

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        return collect_replies(self, self.push_messages(messages), timeout)

    # --- engine -------------------------------------------------------------------
    def next_arrival_after(self, t: float) -> float | None:
        """Virtual time of the first in-flight reply arriving strictly after ``t``."""
        later = [p.arrival for p in self._in_flight if p.arrival > t]
        return min(later) if later else None

    def _execute(self, message: Message) -> tuple[Message, float]:
        """Run the node's ClientApp; return its reply and virtual seconds to arrival."""
        context = self._contexts[message.metadata.dst_node_id]
        self.messages_run += 1
        try:
            reply = self.client_app(message, context)
        except NodeDropout as drop:
            if drop.silent:
                return Message(
                    Error(ErrorCode.REPLY_MESSAGE_UNAVAILABLE, str(drop)),
                    reply_to=message,
                ), math.inf
            return Message(
                Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, str(drop)),
                reply_to=message,
            ), drop.after_s
        except Exception as err:  # a crashing ClientApp is an error reply, as in Flower
            log.warning("node %s raised %r", message.metadata.dst_node_id, err)
            return Message(
                Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, repr(err)),
                reply_to=message,
            ), 0.0
        if reply.has_error():
            return reply, 0.0
        return reply, reply_duration(reply)


def reply_duration(reply: Message) -> float:
    """Virtual seconds a reply reports for its task (sum of its duration keys)."""
    total = 0.0
    for record in reply.content.metric_records.values():
        for key in DURATION_KEYS:
            value = record.get(key)
            if isinstance(value, (int, float)):
                total += float(value)
    return total
