"""Simulated dropouts look the same to a strategy on both engines, and are quiet.

``flwr run`` runs ``flowerbed.sims.apps.client_app`` on Flower's simulation engine;
``flowerbed sim`` runs the same node on the in-process ``FleetGrid``. For each
task both must report the same failure: a node that vanished answers as Flower's
SuperLink does once the message expires (``REPLY_MESSAGE_UNAVAILABLE``), a node
that failed with ``CLIENT_APP_RAISED_EXCEPTION``, quietly; a node whose deadline
leaves no time for one step is not a failure at all.
"""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest
from flowerbed import keys
from flowerbed.models import build_model
from flowerbed.sims.apps import client_app
from flowerbed.sims.scenario import build_fleet_grid
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.common.constant import ErrorCode

NODES = 12
RUN = {"dropout": 0.5, "local-steps": 2, "batch-size": 8, "seed": 4, "num-nodes": NODES}
TTL = 500.0


def train_message(node_id: int, **config: float) -> Message:
    model = build_model("lenet", 1, 8, 10)
    content = RecordDict(
        {
            keys.ARRAYS: ArrayRecord(model.state_dict()),
            keys.CONFIG: ConfigRecord({keys.SERVER_ROUND: 1, **config}),
        }
    )
    return Message(content, node_id, "train", ttl=TTL, group_id="1")


def outcome(reply: Message) -> str:
    if not reply.has_error():
        return "ok"
    return {
        ErrorCode.REPLY_MESSAGE_UNAVAILABLE: "vanished",
        ErrorCode.CLIENT_APP_RAISED_EXCEPTION: "failed",
    }[reply.error.code]


def test_both_engines_report_the_same_dropouts_and_nodes_log_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    grid = build_fleet_grid(RUN)
    node_ids = sorted(grid.get_node_ids())
    messages = {n: train_message(n) for n in node_ids}
    pushed = grid.push_messages(messages.values())
    ids = {mid: n for n, mid in zip(node_ids, pushed, strict=True)}
    in_process: dict[int, tuple[str, float]] = {}
    while len(in_process) < NODES:
        grid.clock.wait(math.inf)
        for reply in grid.pull_messages(list(ids)):
            n = ids[reply.metadata.reply_to_message_id]
            in_process[n] = (outcome(reply), grid.clock.now())

    caplog.set_level(logging.INFO, logger="flwr")
    flower: dict[int, str] = {}
    for n in node_ids:
        context = Context(
            run_id=1,
            node_id=n,
            node_config={"partition-id": n - 1000, "num-partitions": NODES},
            state=RecordDict(),
            run_config=dict(grid._contexts[n].run_config),
        )
        flower[n] = outcome(client_app(train_message(n), context))

    assert {n: o for n, (o, _) in in_process.items()} == flower
    kinds = set(flower.values())
    assert kinds == {"ok", "vanished", "failed"}  # the seed draws all three
    # A vanished node's error arrives when its message expires, as on a SuperLink.
    assert all(t == TTL for o, t in in_process.values() if o == "vanished")
    assert all(t < TTL for o, t in in_process.values() if o != "vanished")
    # No line from the node: under flwr run Ray forwards a node's lines when it
    # likes (after the round's evaluation, say); the strategy names each failure.
    assert [r.getMessage() for r in caplog.records if r.name == "flwr"] == []


def test_a_node_with_no_time_for_one_step_answers_zero_steps_not_an_error() -> None:
    grid = build_fleet_grid({**RUN, "dropout": 0.0}, ["low-end-phone"])
    message = train_message(1000, **{keys.DEADLINE_S: 1e-6})
    [reply] = grid.send_and_receive([message])
    assert not reply.has_error()
    metrics = reply.content.metric_records[keys.METRICS]
    assert metrics[keys.NUM_STEPS] == 0 and metrics[keys.NUM_EXAMPLES] == 0
    sent = message.content.array_records[keys.ARRAYS]
    got = reply.content.array_records[keys.ARRAYS]
    assert all(np.array_equal(sent[k].numpy(), got[k].numpy()) for k in sent)
