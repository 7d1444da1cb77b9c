"""A scripted Flower Grid on a virtual clock, for strategy unit tests.

Each node is a function ``message -> (reply or None, seconds)``: the reply arrives
that many virtual seconds after the push; ``None`` means the node never answers (an
error reply appears when the message's TTL expires, as from Flower's SuperLink).
Other strategy test files import this module; its own tests check the fake itself.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterable, Mapping

import numpy as np
from flowerbed import keys
from flowerbed.strategies.accumulation import to_arrayrecord, to_numpy
from flwr.app import (
    ArrayRecord,
    Error,
    Message,
    MetricRecord,
    RecordDict,
)
from flwr.common.constant import SUPERLINK_NODE_ID, ErrorCode
from flwr.serverapp import Grid
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

NodeFn = Callable[[Message], tuple[Message | None, float]]


class FakeClock:
    def __init__(self, grid: FakeGrid) -> None:
        self.grid = grid
        self.t = 0.0

    def now(self) -> float:
        return self.t

    def wait(self, seconds: float) -> None:
        target = self.t + max(0.0, seconds)
        if self.grid.queue:
            target = min(target, max(self.t, self.grid.queue[0][0]))
        self.t = target


class FakeGrid(Grid):
    def __init__(self, nodes: Mapping[int, NodeFn]) -> None:
        TaskIdentity.run_id = 1
        TaskIdentity.node_id = SUPERLINK_NODE_ID
        TaskIdentity.task_id = 0
        self.nodes = dict(nodes)
        self.clock = FakeClock(self)
        self.queue: list[tuple[float, int, str, Message]] = []
        self.arrived: dict[str, Message] = {}
        self.pushed: list[tuple[float, Message]] = []
        self._seq = itertools.count()

    def set_run(self, run: Run) -> None:
        pass

    @property
    def run(self) -> Run:
        return Run.create_empty(1)

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None):  # type: ignore[no-untyped-def]
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        return sorted(self.nodes)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids = []
        for message in messages:
            seq = next(self._seq)
            message_id = f"m{seq}"
            message.metadata.__dict__["_message_id"] = message_id
            self.pushed.append((self.clock.t, message))
            reply, delay = self.nodes[message.metadata.dst_node_id](message)
            ttl = message.metadata.ttl
            if reply is None or delay > ttl:
                reply = Message(
                    Error(ErrorCode.REPLY_MESSAGE_UNAVAILABLE, "TTL expired"),
                    reply_to=message,
                )
                delay = ttl
            heapq.heappush(self.queue, (self.clock.t + delay, seq, message_id, reply))
            ids.append(message_id)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        while self.queue and self.queue[0][0] <= self.clock.t:
            _, _, message_id, reply = heapq.heappop(self.queue)
            self.arrived[message_id] = reply
        wanted = [m for m in message_ids if m in self.arrived]
        return [self.arrived.pop(m) for m in wanted]

    def send_and_receive(self, messages, *, timeout=None):  # type: ignore[no-untyped-def]
        raise AssertionError("strategies must push and pull, not send_and_receive")

    def pushed_to(self, node_id: int) -> list[Message]:
        return [m for _, m in self.pushed if m.metadata.dst_node_id == node_id]


def reply(
    message: Message, arrays: Mapping[str, np.ndarray], **metrics: float
) -> Message:
    """A well-formed train reply carrying ``arrays`` and ``metrics``."""
    record = RecordDict(
        {
            keys.ARRAYS: to_arrayrecord(arrays),
            keys.METRICS: MetricRecord(
                {k.replace("_", "-"): v for k, v in metrics.items()}
            ),
        }
    )
    return Message(record, reply_to=message)


def eval_reply(message: Message, **metrics: float) -> Message:
    record = RecordDict(
        {
            keys.METRICS: MetricRecord(
                {k.replace("_", "-"): v for k, v in metrics.items()}
            )
        }
    )
    return Message(record, reply_to=message)


def received(message: Message) -> dict[str, np.ndarray]:
    return to_numpy(message.content[keys.ARRAYS])  # type: ignore[arg-type]


def config_of(message: Message) -> dict:
    return dict(message.content[keys.CONFIG])  # type: ignore[arg-type]


def node(
    value: float | Callable[[Message], float],
    *,
    seconds: float,
    report_time: bool = True,
    examples: int = 10,
    steps: int | None = None,
    evaluate_acc: float = 0.5,
) -> NodeFn:
    """A node that answers ``x + value`` after ``seconds``; evaluations instantly."""

    def run(message: Message) -> tuple[Message | None, float]:
        if message.metadata.message_type == "evaluate":
            return eval_reply(
                message, num_examples=examples, eval_acc=evaluate_acc
            ), 0.0
        shift = value(message) if callable(value) else value
        x = {k: v + shift for k, v in received(message).items()}
        metrics: dict[str, float] = {"num_examples": examples}
        if report_time:
            metrics["train_time_s"] = seconds
        if steps is not None:
            metrics["num_steps"] = steps
        return reply(message, x, **metrics), seconds

    return run


def silent(message: Message) -> tuple[Message | None, float]:
    """A node that never answers."""
    return None, 0.0


def weights(x: float = 0.0) -> ArrayRecord:
    return to_arrayrecord({"w": np.array([x], dtype=np.float32)})


def test_fake_grid_releases_replies_in_arrival_order() -> None:
    grid = FakeGrid({1: node(1.0, seconds=5.0), 2: node(2.0, seconds=1.0)})
    msgs = [
        Message(RecordDict({keys.ARRAYS: weights()}), n, "train", ttl=10.0)
        for n in (1, 2)
    ]
    ids = list(grid.push_messages(msgs))
    assert list(grid.pull_messages(ids)) == []
    grid.clock.wait(100.0)
    assert grid.clock.now() == 1.0
    (first,) = grid.pull_messages(ids)
    assert first.metadata.src_node_id == 2
