"""What a span job's members answer, and the checks of it.

A member's reply to a segment (:class:`SegmentReply`, checked by
:func:`check_segment_reply`) and what became of a segment's members
(:class:`SegmentOutcome`), for :class:`flowerbed.strategies.span.SpanJobStrategy`
and its subclasses.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from flowerbed import keys
from flowerbed.replies import ReplyRejected
from flwr.app import Message


@dataclass
class SegmentReply:
    """One member's checked segment reply."""

    node_id: int
    ok: bool
    metrics: dict[str, Any]
    arrays: dict[str, np.ndarray]
    optimizer: dict[str, np.ndarray]
    failure: str = ""
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class SegmentOutcome:
    """What became of a segment's members.

    ``replies``: checked replies (``ok`` or a reported lost peer); ``errors``:
    error replies, by node (member alive, plan or board problem); ``rejected``:
    malformed replies, by node; ``lost``: members that never answered.
    """

    replies: dict[int, SegmentReply] = field(default_factory=dict)
    errors: dict[int, str] = field(default_factory=dict)
    rejected: dict[int, str] = field(default_factory=dict)
    lost: set[int] = field(default_factory=set)
    seconds: float = 0.0

    @property
    def complete(self) -> bool:
        """Every member finished its segment."""
        return (
            not self.errors
            and not self.rejected
            and not self.lost
            and all(r.ok for r in self.replies.values())
        )

    @property
    def answered(self) -> set[int]:
        """Members heard from: a reply, an error reply or a malformed one."""
        return set(self.replies) | set(self.errors) | set(self.rejected)

    @property
    def failed_members(self) -> set[int]:
        """Members whose state after the segment cannot be used (lost, malformed)."""
        return set(self.lost) | set(self.rejected)

    @property
    def port_errors(self) -> set[int]:
        """Members that answered only that the segment's rendezvous port was in use:
        alive and blameless (the server skips the port from then on)."""
        return {n for n, why in self.errors.items() if port_in_use(why) is not None}

    @property
    def dropped_members(self) -> set[int]:
        """Members to leave out of the next attempt: lost, malformed, or refusing
        the plan with an error other than a taken port."""
        return self.failed_members | (set(self.errors) - self.port_errors)


def _finite(value: object) -> bool:
    if isinstance(value, list):
        return all(_finite(v) for v in value)
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
    )


def check_segment_reply(reply: Message) -> SegmentReply:
    """Validate a span reply; raise :class:`ReplyRejected` saying what is wrong.

    Every metric must be a finite number (or list of them) and ``span-ok`` 0 or 1;
    every array finite. Which arrays a reply must hold is the subclass's check.
    """
    content = reply.content
    if keys.METRICS not in content.metric_records:
        raise ReplyRejected(f"no {keys.METRICS!r} MetricRecord")
    metrics = dict(content.metric_records[keys.METRICS])
    for key, value in metrics.items():
        if not _finite(value):
            raise ReplyRejected(f"metric {key!r} is not a finite number ({value!r})")
    ok = metrics.get(keys.SPAN_OK)
    if ok not in (0, 1):
        raise ReplyRejected(f"metric {keys.SPAN_OK!r} must be 0 or 1, got {ok!r}")
    arrays: dict[str, dict[str, np.ndarray]] = {}
    for name in (keys.ARRAYS, keys.SPAN_OPTIMIZER):
        arrays[name] = {}
        if name in content.array_records:
            for key, array in content.array_records[name].items():
                try:
                    decoded: np.ndarray = array.numpy()
                except Exception as err:
                    raise ReplyRejected(
                        f"array {key!r} cannot be decoded: {err}"
                    ) from err
                if decoded.dtype.kind in "fc" and not np.isfinite(decoded).all():
                    raise ReplyRejected(f"array {key!r} contains NaN or Inf")
                arrays[name][key] = decoded
    info = (
        dict(content.config_records[keys.SPAN_RECORD])
        if keys.SPAN_RECORD in content.config_records
        else {}
    )
    return SegmentReply(
        node_id=reply.metadata.src_node_id,
        ok=ok == 1,
        metrics=metrics,
        arrays=arrays[keys.ARRAYS],
        optimizer=arrays[keys.SPAN_OPTIMIZER],
        failure=str(info.get("failure", "")),
        info=info,
    )


def port_in_use(reason: str) -> int | None:
    """The port an error reply says is in use (``rendezvous port N ... in use``),
    or None."""
    marker = "rendezvous port "
    if marker in reason and "in use" in reason:
        tail = reason.split(marker, 1)[1].split()[0]
        if tail.isdigit():
            return int(tail)
    return None
