"""A LargeBatchSync round's figures, from its members' segment replies.

Each member reports its compute and communication seconds per step; a step
ends when the slowest member has computed and the all-reduce is done, so a
step's wall time is ``max_i (compute_i + comm_i)``. The round's metrics
(``Result.train_metrics_clientapp``) are the means over the segment's steps, the
examples per second of wall time and the examples-weighted train loss.
"""

from __future__ import annotations

import numpy as np
from flowerbed import keys
from flwr.app import MetricRecord

from .span import SegmentReply

ROUND_MEMBERS = "members"
ROUND_ATTEMPTS = "attempts"
ROUND_STEP_S = "step-s"
ROUND_COMPUTE_S = "compute-s"
ROUND_COMM_S = "comm-s"
ROUND_SAMPLES_PER_S = "samples-per-s"
ROUND_REPLICA_DIFF = "replica-max-diff"
ROUND_LR = "lr"
REPLICA_TOLERANCE = 1e-4
"""Largest absolute difference between replicas before a warning is logged."""


def replica_difference(replies: list[SegmentReply]) -> float:
    """Largest absolute difference between the first reply's arrays and the
    others' (0 when the replicas agree exactly, as they should)."""
    first = replies[0]
    return max(
        (
            float(np.max(np.abs(other.arrays[k] - v))) if v.size else 0.0
            for other in replies[1:]
            for k, v in first.arrays.items()
        ),
        default=0.0,
    )


def round_figures(replies: list[SegmentReply], diff: float) -> MetricRecord:
    """The round's metrics: members, examples, the schedule's rate, the replicas'
    ``diff``, and (when the members timed their steps) the mean step, compute and
    communication seconds, samples per second and the train loss."""
    compute = [r.metrics.get(keys.SPAN_STEP_COMPUTE_S, []) for r in replies]
    comm = [r.metrics.get(keys.SPAN_STEP_COMM_S, []) for r in replies]
    steps = min((len(c) for c in compute), default=0)
    walls = [
        max(c[t] + m[t] for c, m in zip(compute, comm, strict=True))
        for t in range(steps)
    ]
    examples = sum(float(r.metrics.get(keys.NUM_EXAMPLES, 0)) for r in replies)
    losses = [
        (float(r.metrics[keys.TRAIN_LOSS]), float(r.metrics[keys.NUM_EXAMPLES]))
        for r in replies
        if keys.TRAIN_LOSS in r.metrics
    ]
    record = MetricRecord(
        {
            keys.NUM_EXAMPLES: int(examples),
            ROUND_MEMBERS: len(replies),
            ROUND_REPLICA_DIFF: diff,
            ROUND_LR: float(replies[0].metrics.get(keys.SPAN_LR, 0.0)),
        }
    )
    if walls:
        record[ROUND_STEP_S] = float(np.mean(walls))
        record[ROUND_COMPUTE_S] = float(
            np.mean([max(c[t] for c in compute) for t in range(steps)])
        )
        record[ROUND_COMM_S] = float(
            np.mean([min(m[t] for m in comm) for t in range(steps)])
        )
        record[ROUND_SAMPLES_PER_S] = examples / max(sum(walls), 1e-9)
    if losses:
        total = sum(n for _, n in losses)
        record[keys.TRAIN_LOSS] = sum(v * n for v, n in losses) / total
    return record
