"""The ``probe`` mode: join a group, measure the ring's links, hold if asked.

The smallest real span job, used to check a cohort before committing a job to it
(and by the tests of the shared machinery): every member joins the segment's
group, exchanges ``probe-bytes`` random bytes with its ring neighbours
``probe-rounds`` times (pausing ``probe-pause-s`` between rounds), and reports the
median seconds of an exchange and the bandwidth it implies
(``bytes / seconds``, one direction of the link to its successor).

Queries in this mode answer at once with the member's address: a liveness check.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping

import numpy as np
import torch
from flowerbed import keys

from .group import PeerFailure, joined_group
from .member import (
    MemberContext,
    MemberResult,
    MetricValue,
    exchange_ring,
    lost_ranks_metric,
)
from .plan import MemberPlan

PROBE_BYTES = "probe-bytes"
PROBE_ROUNDS = "probe-rounds"
PROBE_PAUSE_S = "probe-pause-s"


def run(
    plan: MemberPlan, context: MemberContext, arrays: Mapping[str, np.ndarray]
) -> MemberResult:
    del arrays
    size = int(plan.options.get(PROBE_BYTES, 1 << 16))
    rounds = max(1, int(plan.options.get(PROBE_ROUNDS, 1)))
    pause = float(plan.options.get(PROBE_PAUSE_S, 0.0))
    begin = time.monotonic()
    seconds: list[float] = []
    try:
        with joined_group(plan, context.address):
            payload = {"probe": torch.randint(0, 255, (size,), dtype=torch.uint8)}
            for index in range(rounds):
                if plan.world_size > 1:
                    seconds.append(
                        exchange_ring(payload, plan.rank, plan.world_size).seconds
                    )
                if pause > 0 and index < rounds - 1:
                    time.sleep(pause)
    except PeerFailure as err:
        return MemberResult(
            ok=False,
            metrics={
                keys.SPAN_OK: 0,
                keys.TRAIN_TIME_S: time.monotonic() - begin,
                **lost_ranks_metric(err.lost_ranks),
            },
            failure=f"{err.phase}: {err}",
        )
    link = statistics.median(seconds) if seconds else 0.0
    metrics: dict[str, MetricValue] = {
        keys.SPAN_OK: 1,
        keys.TRAIN_TIME_S: time.monotonic() - begin,
        keys.SPAN_LINK_S: link,
        keys.SPAN_LINK_BYTES_PER_S: size / link if link > 0 else 0.0,
    }
    return MemberResult(ok=True, metrics=metrics)


def profile(query: Mapping[str, object], context: MemberContext) -> MemberResult:
    del query
    return MemberResult(
        ok=True, metrics={keys.SPAN_OK: 1}, info={"address": context.address}
    )
