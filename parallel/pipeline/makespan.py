"""How long a synchronous pipeline takes: the virtual clock of pipeline jobs (pure).

One training step of a synchronous pipeline (a flush per step, so every step
boundary is a consistent cut) runs ``m`` micro-batches through ``p`` stages in
the order of a schedule; this module replays that order as a small event
simulation instead of using a closed form, so unequal stages, slow links and
the schedule's exact order all count:

- each stage runs its operations one at a time, in the schedule's order;
- forward ``F(s, i)`` needs ``F(s-1, i)`` finished and its activation moved over
  link ``s-1`` (``cut_s[s-1]`` seconds); backward ``B(s, i)`` needs ``B(s+1, i)``
  finished and its gradient moved back over link ``s`` (``cut_s[s]``); the last
  stage's ``B(p-1, i)`` follows its own ``F(p-1, i)``;
- a link carries one transfer per direction at a time (queued in order).

Orders, as ``torch.distributed.pipelining`` runs them: **GPipe** (Huang et al.,
NeurIPS 2019; ``ScheduleGPipe``): all forwards, then all backwards. **1F1B**
(PipeDream-Flush, Narayanan et al., ICML 2021, Sec. 2; ``Schedule1F1B``): stage
``s`` first runs ``w = min(m, p - s)`` forwards, then alternates one backward and
one forward, then the remaining backwards.

For equal stages of ``t = f + b`` seconds and free links both give the familiar
``(m + p - 1) * t`` (the bubble is ``(p - 1) / (m + p - 1)`` of it; Narayanan et
al. 2021, Sec. 2.2); the tests check the simulation against hand-worked cases.

A segment of ``K`` steps adds its set-up, the optimiser step of every step, and
one replication exchange every ``R`` steps (every stage sends its state to its
ring successor at once: the slowest link's transfer, FTPipeHD Sec. 4.3's
neighbour replication); recovery after a loss costs the detection delay, a new
segment's set-up, the moved layers' transfer and the recomputed steps
(:func:`recovery_s`). Validated against real local runs by ``flowerbed bench``'s
pipeline section (target: within 15%).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ..plan import SCHEDULES


def schedule_order(
    schedule: str, stage: int, stages: int, micro_batches: int
) -> list[tuple[str, int]]:
    """Operations of ``stage`` in order: ``("F", i)`` and ``("B", i)``."""
    m = micro_batches
    if schedule == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    if schedule != "1f1b":
        raise ValueError(
            f"schedule {schedule!r}; valid choices: {', '.join(SCHEDULES)}"
        )
    warmup = min(m, stages - stage)
    order = [("F", i) for i in range(warmup)]
    forward, backward = warmup, 0
    while backward < m:
        order.append(("B", backward))
        backward += 1
        if forward < m:
            order.append(("F", forward))
            forward += 1
    return order


def step_s(
    forward_s: Sequence[float],
    backward_s: Sequence[float],
    micro_batches: int,
    cut_s: Sequence[float] | None = None,
    schedule: str = "1f1b",
) -> float:
    """Seconds of one pipeline step (all micro-batches, forward and backward).

    ``forward_s[s]``/``backward_s[s]``: stage ``s``'s seconds per micro-batch;
    ``cut_s[s]``: one-way transfer seconds of one micro-batch's activation (and
    of its gradient) over the link between stages ``s`` and ``s+1``.
    """
    p, m = len(forward_s), micro_batches
    if p < 1 or len(backward_s) != p:
        raise ValueError("forward_s and backward_s need one entry per stage")
    if m < 1:
        raise ValueError(f"micro_batches must be >= 1, got {m}")
    cuts = list(cut_s) if cut_s is not None else [0.0] * (p - 1)
    if len(cuts) != p - 1:
        raise ValueError(f"{p} stages need {p - 1} cut times, got {len(cuts)}")
    orders = [schedule_order(schedule, s, p, m) for s in range(p)]
    done: dict[tuple[str, int, int], float] = {}
    position = [0] * p
    free = [0.0] * p
    link_free = {("F", s): 0.0 for s in range(p - 1)} | {
        ("B", s): 0.0 for s in range(p - 1)
    }
    arrival: dict[tuple[str, int, int], float] = {}
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for s in range(p):
            while position[s] < len(orders[s]):
                kind, i = orders[s][position[s]]
                if kind == "F":
                    ready = 0.0 if s == 0 else arrival.get(("F", s, i))
                    cost = forward_s[s]
                elif s == p - 1:
                    ready = done.get(("F", s, i))
                    cost = backward_s[s]
                else:
                    ready = arrival.get(("B", s, i))
                    cost = backward_s[s]
                if ready is None:
                    break
                start = max(ready, free[s])
                end = start + cost
                free[s] = end
                done[(kind, s, i)] = end
                position[s] += 1
                remaining -= 1
                progressed = True
                if kind == "F" and s < p - 1:
                    begin = max(end, link_free[("F", s)])
                    link_free[("F", s)] = begin + cuts[s]
                    arrival[("F", s + 1, i)] = begin + cuts[s]
                if kind == "B" and s > 0:
                    begin = max(end, link_free[("B", s - 1)])
                    link_free[("B", s - 1)] = begin + cuts[s - 1]
                    arrival[("B", s - 1, i)] = begin + cuts[s - 1]
        if not progressed:  # pragma: no cover - the orders above cannot deadlock
            raise RuntimeError("pipeline schedule deadlocked")
    return max(free)


@dataclass(frozen=True)
class SegmentCost:
    """Predicted seconds of a segment and of its parts."""

    setup_s: float
    step_s: float
    steps: int
    replications: int
    replicate_s: float

    @property
    def total_s(self) -> float:
        return (
            self.setup_s
            + self.steps * self.step_s
            + self.replications * self.replicate_s
        )


def replications(start_step: int, steps: int, every: int) -> int:
    """Replication exchanges in a segment: after global steps that are multiples of
    ``every``, except the segment's last (its reply carries the state)."""
    if every <= 0 or steps <= 0:
        return 0
    end = start_step + steps
    return sum(1 for done in range(start_step + 1, end) if done % every == 0)


def replicate_s(state_bytes: Sequence[float], ring_bandwidth: Sequence[float]) -> float:
    """One replication exchange: every stage sends its state to its ring successor
    at once, so it lasts as long as the slowest of those transfers.

    ``ring_bandwidth[s]``: bytes/s of the link from stage ``s`` to ``(s+1) % p``.
    """
    if len(state_bytes) < 2:
        return 0.0
    return max(b / bw for b, bw in zip(state_bytes, ring_bandwidth, strict=True))


def segment_cost(
    forward_s: Sequence[float],
    backward_s: Sequence[float],
    micro_batches: int,
    *,
    steps: int,
    start_step: int = 0,
    cut_s: Sequence[float] | None = None,
    schedule: str = "1f1b",
    optimizer_s: float = 0.0,
    setup_s: float = 0.0,
    replicate_every: int = 0,
    replication_s: float = 0.0,
) -> SegmentCost:
    """Predicted cost of a segment of ``steps`` steps (see the module doc)."""
    one = step_s(forward_s, backward_s, micro_batches, cut_s, schedule) + optimizer_s
    return SegmentCost(
        setup_s=setup_s,
        step_s=one,
        steps=steps,
        replications=replications(start_step, steps, replicate_every),
        replicate_s=replication_s,
    )


def recovery_s(
    *,
    detect_s: float,
    setup_s: float,
    moved_bytes: float,
    move_bandwidth: float,
    lost_steps: int,
    step_seconds: float,
) -> float:
    """Seconds a loss costs beyond the work itself: detecting it, starting a new
    segment, moving layers to their new owners, and recomputing the lost steps.

    FTPipeHD (Sec. 4.4) recovers the same way: detect, re-partition over the
    survivors, fetch each layer from its nearest copy, retrain the lost batches.
    """
    move = moved_bytes / move_bandwidth if moved_bytes > 0 else 0.0
    if math.isinf(move_bandwidth):
        move = 0.0
    return detect_s + setup_s + move + lost_steps * step_seconds


def throughput(batch_size: int, seconds_per_step: float) -> float:
    """Samples per second."""
    return batch_size / seconds_per_step if seconds_per_step > 0 else math.inf
