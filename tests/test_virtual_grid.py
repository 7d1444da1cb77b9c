"""VirtualTimeGrid gives strategies the in-process engine's clock on any Grid."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import pytest
from flowerbed import keys
from flowerbed.grid import LocalGrid
from flowerbed.sims.apps import client_app
from flowerbed.sims.config import Scenario
from flowerbed.sims.scenario import build_fleet_grid, build_strategy, run_server
from flowerbed.sims.vclock import NodeDropout
from flowerbed.sims.virtual_grid import VirtualTimeGrid
from flwr.app import (
    ConfigRecord,
    Context,
    Error,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid

pytestmark = pytest.mark.usefixtures("quiet_single_threaded")
"""Tiny models train fastest on one thread."""


def flower_error_text(err: Exception) -> str:
    """The reason Flower's simulation engine gives a ClientApp's exception."""
    return (
        "<class 'flwr.clientapp.client_app.ClientAppException'>:<'\nException "
        f"ClientAppException occurred. Message: {err}'>"
    )


class WallGrid(LocalGrid):
    """Answers like Flower's engine: no clock, errors for exceptions, any order.

    Each node's reply becomes visible after ``polls`` pulls (wall latency that
    has nothing to do with the device's time); node ids are arbitrary.
    """

    def __init__(
        self,
        nodes: Mapping[int, Mapping[str, Any]],
        run_config: Mapping[str, Any],
        answer: Any = client_app,
        polls: Mapping[int, int] | None = None,
    ) -> None:
        self.nodes = nodes
        self.answer = answer
        self.polls = dict(polls or {})
        self.contexts = {
            n: Context(1, n, dict(cfg), RecordDict(), dict(run_config))
            for n, cfg in nodes.items()
        }
        self.waiting: list[tuple[int, str, Message]] = []
        self.count = 0
        super().__init__(run_id=1)

    def get_node_ids(self) -> Iterable[int]:
        return list(self.nodes)  # not sorted, as Flower's may not be

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids = []
        for message in messages:
            self.count += 1
            message_id = f"wall-{self.count}"
            message.metadata.__dict__["_message_id"] = message_id
            node = message.metadata.dst_node_id
            try:
                reply = self.answer(message, self.contexts[node])
            except Exception as err:
                reply = Message(
                    Error(
                        ErrorCode.CLIENT_APP_RAISED_EXCEPTION, flower_error_text(err)
                    ),
                    reply_to=message,
                )
            self.waiting.append((self.polls.get(node, 1), message_id, reply))
            ids.append(message_id)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        wanted = set(message_ids)
        ready = [r for polls, mid, r in self.waiting if polls <= 1 and mid in wanted]
        self.waiting = [
            (polls - 1 if mid in wanted else polls, mid, r)
            for polls, mid, r in self.waiting
            if not (polls <= 1 and mid in wanted)
        ]
        return list(reversed(ready))  # latest first: wall order is not device order

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        raise NotImplementedError


def timed_node(seconds: Mapping[int, float | Exception]) -> Any:
    def answer(message: Message, context: Context) -> Message:
        outcome = seconds[context.node_id]
        if isinstance(outcome, Exception):
            raise outcome
        metrics = MetricRecord({keys.TRAIN_TIME_S: outcome, keys.NUM_EXAMPLES: 1})
        return Message(RecordDict({"metrics": metrics}), reply_to=message)

    return answer


def push_to_all(grid: Grid, ttl: float = 100.0) -> list[str]:
    messages = [
        grid.create_message(
            RecordDict({"config": ConfigRecord()}), MessageType.TRAIN, n, "1", ttl
        )
        for n in grid.get_node_ids()
    ]
    return list(grid.push_messages(messages))


def test_replies_leave_in_device_time_order_whatever_the_wall_order() -> None:
    # node 7's device takes 3 s but its reply is computed first; node 9's takes 1 s
    # but the cluster answers it last
    seconds = {7: 3.0, 8: 2.0, 9: 1.0}
    inner = WallGrid(
        {n: {} for n in seconds}, {}, timed_node(seconds), polls={7: 1, 8: 2, 9: 4}
    )
    grid = VirtualTimeGrid(inner, poll_interval_s=1e-3)
    ids = push_to_all(grid)
    assert list(grid.pull_messages(ids)) == []  # nothing has arrived at t = 0
    order = []
    while len(order) < 3:
        grid.clock.wait(10.0)
        for reply in grid.pull_messages(ids):
            order.append((reply.metadata.src_node_id, grid.clock.now()))
    assert order == [(9, 1.0), (8, 2.0), (7, 3.0)]


def test_a_vanished_node_expires_at_the_ttl_and_a_failing_one_at_its_time() -> None:
    seconds: dict[int, float | Exception] = {
        1: NodeDropout("node 1 vanished", silent=True, after_s=0.5),
        2: NodeDropout("node 2 failed", silent=False, after_s=0.5),
        3: ValueError("bug"),
    }
    inner = WallGrid({n: {} for n in seconds}, {}, timed_node(seconds))
    grid = VirtualTimeGrid(inner, poll_interval_s=1e-3)
    ids = push_to_all(grid, ttl=4.0)
    # an ordinary exception: an error at once, as the in-process engine sends it
    [bug] = grid.pull_messages(ids)
    assert bug.error.code == ErrorCode.CLIENT_APP_RAISED_EXCEPTION
    assert "bug" in bug.error.reason
    grid.clock.wait(10.0)
    [failed] = grid.pull_messages(ids)
    assert grid.clock.now() == 0.5
    assert failed.error.reason == "node 2 failed"  # the tag is gone
    grid.clock.wait(10.0)
    [vanished] = grid.pull_messages(ids)
    assert grid.clock.now() == 4.0  # the TTL, in virtual seconds
    assert vanished.error.code == ErrorCode.REPLY_MESSAGE_UNAVAILABLE


def test_the_wrapped_grid_gets_a_wall_ttl_the_strategy_keeps_its_own() -> None:
    seen: list[float] = []

    def answer(message: Message, context: Context) -> Message:
        seen.append(message.metadata.ttl)
        return timed_node({5: 1.0})(message, context)

    grid = VirtualTimeGrid(WallGrid({5: {}}, {}, answer), wall_ttl_s=3600.0)
    message = grid.create_message(RecordDict(), MessageType.TRAIN, 5, "1", 20.0)
    grid.push_messages([message])
    assert seen == [3600.0] and message.metadata.ttl == 20.0


class StoringGrid(WallGrid):
    """Keeps the pushed objects and answers them at the next pull, as Flower's
    in-memory grid does (its nodes read the stored message later)."""

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        self.stored = list(messages)
        for i, message in enumerate(self.stored, start=1):
            message.metadata.__dict__["_message_id"] = f"kept-{i}"
        return [m.metadata.message_id for m in self.stored]

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        stored, self.stored = self.stored, []
        nodes = {m.metadata.dst_node_id: m for m in stored}
        return [self.answer(m, self.contexts[n]) for n, m in nodes.items()]


def test_a_grid_that_keeps_the_pushed_message_sees_the_wall_ttl_until_it_answers() -> (
    None
):
    # The strategy's message keeps its virtual 20 s; the node, answering after
    # the push returned, still reads the wall TTL, and its reply's TTL is positive
    # (a virtual TTL there expired while Ray started: every reply of the first
    # round lost, then "`metadata.ttl` must be higher than zero").
    seen: list[float] = []

    def answer(message: Message, context: Context) -> Message:
        seen.append(message.metadata.ttl)
        return timed_node({5: 1.0})(message, context)

    inner = StoringGrid({5: {}}, {}, answer)
    grid = VirtualTimeGrid(inner, wall_ttl_s=3600.0, poll_interval_s=1e-3)
    message = grid.create_message(RecordDict(), MessageType.TRAIN, 5, "1", 20.0)
    [message_id] = grid.push_messages([message])
    assert message.metadata.ttl == 20.0 and message.metadata.message_id == message_id
    grid.clock.wait(10.0)
    [reply] = grid.pull_messages([message_id])
    assert seen == [3600.0]
    assert reply.metadata.reply_to_message_id == message_id and not reply.has_error()
    assert grid.clock.now() == 1.0


RUN = {
    "fleet": "mixed",
    "num-nodes": 6,
    "num-rounds": 3,
    "dropout": 0.5,
    "local-steps": 3,
    "seed": 5,
}


def rounds_on_both(strategy: str) -> tuple[list[Any], list[Any]]:
    """Per-round (round, participants, failed, virtual time) on both grids.

    The recorder names a node that never succeeded by its node id: mapped back
    to its partition id here, since the two grids number nodes differently.
    """
    config = {**RUN, "strategy": strategy}
    scenario = Scenario.from_run_config(config)
    local = build_fleet_grid(config)
    try:
        in_process = run_server(local, scenario, write=False).records
    finally:
        local.close()
    # Flower-like node ids: large, unordered
    nodes = {
        (i * 7_919_993) % 1_000_003 + 10**9: {"partition-id": i, "num-partitions": 6}
        for i in range(6)
    }
    wall = WallGrid(
        nodes, scenario.to_run_config(), polls={n: 1 + n % 3 for n in nodes}
    )
    wrapped = run_server(
        VirtualTimeGrid(wall, poll_interval_s=1e-3),
        scenario,
        strategy=build_strategy(scenario),
        write=False,
    ).records
    partition = {n: int(cfg["partition-id"]) for n, cfg in nodes.items()}
    partition |= {1000 + i: i for i in range(6)}

    def rows(records: list[Any]) -> list[Any]:
        return [
            (
                r.round,
                r.participants,
                sorted(partition.get(n, n) for n in r.failed),
                r.virtual_time_s,
                r.accuracy,
            )
            for r in records
        ]

    return rows(in_process), rows(wrapped)


@pytest.mark.parametrize("strategy", ["deadline", "fedbuff"])
def test_a_wall_time_grid_wrapped_matches_the_in_process_engine(strategy: str) -> None:
    in_process, wrapped = rounds_on_both(strategy)
    assert [row[:4] for row in wrapped] == [row[:4] for row in in_process]
    if strategy == "deadline":
        assert any(row[2] for row in wrapped)  # dropouts happened
    else:  # a fast device delivered twice into one version: order mattered
        assert any(len(set(row[1])) < len(row[1]) for row in wrapped)
    for a, b in zip(wrapped, in_process, strict=True):
        assert a[4] == pytest.approx(b[4], abs=0.01)  # per-node vs batched training
