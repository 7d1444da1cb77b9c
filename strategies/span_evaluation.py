"""Evaluation messages of the span jobs (LargeBatchSync, TiledTraining).

A span job's members evaluate the whole model themselves: the message carries
the model and, in its config, the span query (``span-query``: the job's model
and dataset as JSON) that tells the span ClientApp what to build and read.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from flowerbed import keys
from flwr.app import ConfigRecord, Message, MessageType, RecordDict


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
