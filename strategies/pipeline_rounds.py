"""A :class:`~flowerbed.strategies.PipelineTraining` round's replies and figures:
the checks of a member's arrays, the stitching of the stages' layers into the
whole model, the round metrics (their keys below) and the reports recovery
reads (:mod:`flowerbed.parallel.pipeline.recovery`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from logging import WARNING
from typing import Any

import numpy as np
from flowerbed import keys
from flowerbed.parallel.pipeline.makespan import replications, step_s, throughput
from flowerbed.parallel.pipeline.planner import Layout, PipelinePlanner
from flowerbed.parallel.pipeline.recovery import MemberReport
from flowerbed.replies import ReplyRejected
from flwr.app import ArrayRecord, Message, MetricRecord, MetricRecordValues
from flwr.supercore import log

from .pipeline_options import Pipelining
from .span import SegmentOutcome, SegmentReply, arrayrecord, check_segment_reply
from .span_members import SpanMember

# Round metrics (the train MetricRecord of each round) ------------------------------
ROUND_STEP_S = "step-s"
"""Measured seconds per step (the slowest member's median)."""
ROUND_PREDICTED_STEP_S = "predicted-step-s"
"""The makespan model's seconds per step for the round's layout."""
ROUND_PARTITION = "partition"
"""Layers per stage, in stage order."""
ROUND_STAGES = "stages"
ROUND_LOST_STEPS = "lost-steps"
"""Steps recomputed after losses in the round."""
ROUND_RECOVERIES = "recoveries"
ROUND_REPARTITIONS = "repartitions"
ROUND_SECONDS = "round-s"
"""Clock seconds of the round (set-up, steps, recoveries)."""
ROUND_FAILURE_S = "failure-s"
"""Clock seconds the round's failed attempts cost beyond the steps they kept:
set-up, the lost steps, the time until the loss was known."""
ROUND_MODEL_STEP_S = "model-step-s"
"""The makespan model's step time from the stage times measured in this round
(the model's check; ``predicted-step-s`` is the forecast made before it)."""


@dataclass
class RoundBook:
    """What happened in one round."""

    lost_steps: int = 0
    recoveries: int = 0
    repartitions: int = 0
    failure_s: float = 0.0
    began: float = 0.0
    """Clock seconds when the round began."""
    predicted: float = 0.0
    """The planner's step time for the completed segment's layout, forecast
    before its measurements."""


def round_figures(
    book: RoundBook,
    planner: PipelinePlanner,
    layout: Layout,
    replies: Mapping[int, SegmentReply],
    pipelining: Pipelining,
    segment: tuple[int, int, int],
    now: float,
) -> dict[str, MetricRecordValues]:
    """A completed round's metrics (``segment``: batch size, first step and
    steps of the segment; ``now``: the clock), after ``planner`` took the
    round's measurements."""
    batch_size, first, steps = segment
    measured = slowest(replies, keys.SPAN_STEP_S)
    return {
        keys.SAMPLES_PER_S: throughput(batch_size, measured),
        ROUND_STEP_S: measured,
        ROUND_PREDICTED_STEP_S: book.predicted,
        ROUND_PARTITION: layout.sizes,
        ROUND_STAGES: len(layout.members),
        ROUND_LOST_STEPS: book.lost_steps,
        ROUND_RECOVERIES: book.recoveries,
        ROUND_REPARTITIONS: book.repartitions,
        ROUND_SECONDS: now - book.began,
        ROUND_FAILURE_S: book.failure_s,
        ROUND_MODEL_STEP_S: model_step_s(
            planner, layout, replies, pipelining.micro_batches, pipelining.schedule
        ),
        "replications": replications(first, steps, pipelining.replicate_every),
    }


def read_profiles(
    found: Mapping[int, SpanMember], layers: int
) -> tuple[dict[int, tuple[list[float], list[float]]], dict[int, str]]:
    """Each profiled member's per-layer forward and backward seconds, and the
    members whose profile is refused with the reason (logged)."""
    profiles, refused = {}, {}
    for node_id, member in found.items():
        try:
            profiles[node_id] = (
                layer_times(member.metrics, keys.SPAN_LAYER_FORWARD_S, layers),
                layer_times(member.metrics, keys.SPAN_LAYER_BACKWARD_S, layers),
            )
        except ReplyRejected as err:
            refused[node_id] = err.reason
            log(WARNING, "node %d: bad profile: %s", node_id, err.reason)
    return profiles, refused


def num(value: Any) -> float:
    """A checked metric (check_segment_reply made it finite) as a float."""
    return float(value) if isinstance(value, int | float) else 0.0


def ints(values: Any) -> list[int]:
    """A checked list metric as integers (an empty list when it is not one)."""
    return [int(v) for v in values] if isinstance(values, list) else []


def layer_times(metrics: Mapping[str, Any], key: str, layers: int) -> list[float]:
    """A profile's per-layer seconds under ``key``; ReplyRejected unless there
    are ``layers`` finite, non-negative ones."""
    values = metrics.get(key)
    if not isinstance(values, list) or len(values) != layers:
        raise ReplyRejected(f"{key!r} must list {layers} per-layer seconds")
    out = [float(v) for v in values]
    if any(not math.isfinite(v) or v < 0 for v in out):
        raise ReplyRejected(f"{key!r} holds a negative or non-finite time")
    return out


def check_arrays(
    reply: SegmentReply, reference_state: Mapping[str, tuple[int, ...]]
) -> SegmentReply:
    """Reject arrays the model does not have, wrong shapes, a bad listing."""
    for name, value in reply.arrays.items():
        if name not in reference_state:
            raise ReplyRejected(f"unexpected array {name!r}")
        if tuple(value.shape) != reference_state[name]:
            raise ReplyRejected(
                f"array {name!r} has shape {tuple(value.shape)}, expected "
                f"{reference_state[name]}"
            )
    holds = reply.metrics.get(keys.SPAN_HOLDS, [])
    if not isinstance(holds, list) or len(holds) % 3:
        raise ReplyRejected(f"{keys.SPAN_HOLDS!r} must be a list of triples")
    return reply


def stitch(
    replies: Sequence[SegmentReply],
    reference_state: Mapping[str, tuple[int, ...]],
    batch_size: int,
) -> tuple[ArrayRecord | None, MetricRecord | None]:
    """The stages' layers as the whole model, in ``reference_state``'s order,
    and the segment's examples, steps and mean loss; ``(None, None)`` (the
    reason logged) unless every reply finished and each array came once."""
    arrays: dict[str, np.ndarray] = {}
    for reply in replies:
        if not reply.ok:
            return None, None
        for name, value in reply.arrays.items():
            if name in arrays:
                log(WARNING, "array %s came from two members", name)
                return None, None
            arrays[name] = value
    missing = sorted(set(reference_state) - set(arrays))
    if missing:
        log(WARNING, "the replies lack arrays %s", missing[:5])
        return None, None
    steps = min(int(num(r.metrics.get(keys.NUM_STEPS, 0))) for r in replies)
    losses = [
        num(r.metrics[keys.TRAIN_LOSS]) for r in replies if keys.TRAIN_LOSS in r.metrics
    ]
    metrics: dict[str, MetricRecordValues] = {
        keys.NUM_EXAMPLES: steps * batch_size,
        keys.NUM_STEPS: steps,
    }
    if losses:
        metrics[keys.TRAIN_LOSS] = float(np.mean(losses))
    ordered = {name: arrays[name] for name in reference_state}
    return arrayrecord(ordered), MetricRecord(metrics)


def stage_seconds(replies: Mapping[int, SegmentReply]) -> dict[int, float]:
    """Each member's measured forward plus backward seconds per step."""
    return {
        n: num(r.metrics.get(keys.SPAN_FORWARD_S, 0))
        + num(r.metrics.get(keys.SPAN_BACKWARD_S, 0))
        for n, r in replies.items()
    }


def link_speeds(replies: Mapping[int, SegmentReply]) -> dict[int, float]:
    """Each member's measured link bytes per second."""
    return {
        n: num(r.metrics.get(keys.SPAN_LINK_BYTES_PER_S, 0)) for n, r in replies.items()
    }


def slowest(replies: Mapping[int, SegmentReply], key: str) -> float:
    """The largest of the replies' ``key`` metric (0 without replies)."""
    return max((num(r.metrics.get(key, 0)) for r in replies.values()), default=0.0)


def model_step_s(
    planner: PipelinePlanner,
    layout: Layout,
    replies: Mapping[int, SegmentReply],
    micro_batches: int,
    schedule: str,
) -> float:
    """The makespan model on this round's measured per-stage times."""
    fwd = [num(replies[m].metrics.get(keys.SPAN_FORWARD_S, 0)) for m in layout.members]
    bwd = [num(replies[m].metrics.get(keys.SPAN_BACKWARD_S, 0)) for m in layout.members]
    cuts = [
        planner.out_bytes[layout.bounds[s + 1] - 1]
        / planner.link(layout.members[s], layout.members[s + 1])
        for s in range(len(layout.members) - 1)
    ]
    return step_s(fwd, bwd, micro_batches, cuts, schedule)


def segment_reply(message: Message) -> SegmentReply:
    """A reply message as a checked :class:`SegmentReply`; ReplyRejected when
    it is an error or fails :func:`check_segment_reply`."""
    if message.has_error():
        raise ReplyRejected(message.error.reason or "error reply")
    return check_segment_reply(message)


def dropped_members(outcome: SegmentOutcome, layout: Layout) -> dict[int, str | None]:
    """Members a failed segment loses: those that failed (None) and those whose
    plan, which suited the others, they could not run (the reason: they are
    refused too)."""
    dropped: dict[int, str | None] = dict.fromkeys(outcome.failed_members)
    for node_id, reason in outcome.errors.items():
        if node_id not in outcome.port_errors and node_id in layout.members:
            dropped[node_id] = reason
    return dropped


def member_reports(outcome: SegmentOutcome) -> dict[int, MemberReport]:
    """What each reply of a failed segment tells recovery."""
    return {
        node_id: MemberReport(
            ok=reply.ok,
            steps=int(num(reply.metrics.get(keys.NUM_STEPS, 0))),
            failed_step=int(num(reply.metrics.get(keys.SPAN_FAILED_STEP, -1))),
            holds=ints(reply.metrics.get(keys.SPAN_HOLDS, [])),
        )
        for node_id, reply in outcome.replies.items()
    }
