"""Evaluation of the span jobs: their messages, replies and averages.

A span job's members evaluate the whole model themselves: the message carries
the model and, in its config, the span query (``span-query``: the job's model
and dataset as JSON) that tells the span ClientApp what to build and read.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from logging import WARNING
from typing import Any

from flowerbed import keys
from flowerbed.replies import ReplyRejected, check_evaluate_reply
from flowerbed.strategies.accumulation import MetricsAccumulator
from flowerbed.strategies.inflight import InFlight
from flwr.app import ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.supercore import log


def query_config(config: ConfigRecord, query: Mapping[str, Any]) -> ConfigRecord:
    """A copy of ``config`` carrying ``query`` as the span query."""
    record = ConfigRecord(dict(config))
    record[keys.SPAN_QUERY] = json.dumps(query)
    return record


def evaluate_messages(
    records: Mapping[str, Any], nodes: Iterable[int], ttl: float
) -> list[Message]:
    """One EVALUATE message to each node with ``records`` (its ArrayRecord and
    ConfigRecord by key, in that order)."""
    return [
        Message(
            RecordDict(dict(records)),
            dst_node_id=node,
            message_type=MessageType.EVALUATE,
            ttl=ttl,
        )
        for node in nodes
    ]


def gather_evaluations(
    inflight: InFlight, server_round: int, messages: list[Message], wait: float
) -> list[Message]:
    """Push evaluation ``messages``; the replies that arrive within ``wait``
    clock seconds."""
    sent = inflight.push(messages, server_round)
    until = inflight.clock.now() + wait
    replies = [
        reply for reply, _, _ in inflight.replies(until, kind=MessageType.EVALUATE)
    ]
    inflight.forget(sent)
    return replies


def average_evaluations(
    server_round: int,
    replies: Iterable[Message],
    weighted_by_key: str,
    aggr_fn: Callable[[list[RecordDict], str], MetricRecord] | None,
) -> MetricRecord | None:
    """Evaluation metrics averaged by ``weighted_by_key`` (``aggr_fn`` when
    given, :class:`~flowerbed.strategies.accumulation.MetricsAccumulator`);
    a reply that fails :func:`~flowerbed.replies.check_evaluate_reply` is logged
    and left out."""
    acc = MetricsAccumulator(weighted_by_key)
    for reply in replies:
        try:
            metrics = check_evaluate_reply(reply, weighted_by_key)
        except ReplyRejected as err:
            log(
                WARNING,
                "round %d: rejected evaluate reply from node %d: %s",
                server_round,
                reply.metadata.src_node_id,
                err.reason,
            )
            continue
        acc.add(metrics, float(metrics[weighted_by_key]))  # type: ignore[arg-type]
    return acc.result(aggr_fn)
