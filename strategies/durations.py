"""Full-work durations of nodes, and the percentiles a deadline is taken from.

How long each sampled node needed for its whole assigned work
(:func:`full_work_seconds`), recorded per round by :class:`DurationHistory`,
gives :class:`~flowerbed.strategies.DeadlineFedAvg` its adaptive deadline: a
nearest-rank percentile in which nodes that did not finish count as slower than
every node that did (:func:`censored_percentile`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from flowerbed import keys
from flowerbed.replies import UNAVAILABLE_CODES
from flwr.app import ConfigRecord, Message, MetricRecord

from .inflight import Arrival, Ticket
from .options import DEFAULT_WAIT_RATIO, FAST_PERCENTILE, PATIENT_PERCENTILE


@dataclass(frozen=True)
class Observation:
    """How long one sampled node needed for its whole assigned work in a round.

    ``censored``: it did not finish (straggler, expired message, no step done),
    so it needed more than ``seconds``.
    """

    round: int
    seconds: float
    censored: bool = False


def full_work_seconds(
    round_trip_s: float,
    compute_s: float | None,
    steps_done: float | None,
    steps_assigned: int | None,
) -> float | None:
    """Seconds a node would have needed for all its assigned steps; None if 0 done.

    With partial work a reply covers ``k`` of ``L`` assigned steps, so its round
    trip understates the time the whole task takes. The compute part scales with
    the steps, the rest (transfers, queueing) does not::

        t_full = (t_rtt - t_compute) + t_compute * L / k

    and without a reported ``train-time-s`` the whole round trip is scaled.
    """
    if steps_done is None or steps_assigned is None or steps_done >= steps_assigned:
        return round_trip_s
    if steps_done <= 0:
        return None
    compute = round_trip_s if compute_s is None else min(compute_s, round_trip_s)
    return round_trip_s - compute + compute * steps_assigned / steps_done


def censored_percentile(
    observations: Iterable[Observation], percentile: float
) -> tuple[float, bool] | None:
    """Nearest-rank ``percentile`` of durations; ``(value, censored)``, None if empty.

    Nodes that did not finish sort after every finished one (they needed longer
    than their ``seconds``). The result is the duration of rank
    ``ceil(p/100 * n)``; when that rank falls on a node that did not finish, the
    percentile is only known to exceed ``value`` and ``censored`` is True.
    """
    ranked = sorted(observations, key=lambda o: (o.censored, o.seconds))
    if not ranked:
        return None
    rank = max(1, math.ceil(percentile / 100 * len(ranked)))
    chosen = ranked[rank - 1]
    return chosen.seconds, chosen.censored


def deadline_seconds(
    observations: Iterable[Observation], percentile: float, growth: float
) -> float | None:
    """The seconds a deadline at ``percentile`` starts from: the nearest-rank
    value of :func:`censored_percentile`, times ``growth`` when it is censored
    (the percentile is only known to exceed it). None if there are none."""
    found = censored_percentile(observations, percentile)
    if found is None:
        return None
    seconds, censored = found
    return seconds * growth if censored else seconds


def two_speed_percentile(
    observations: Iterable[Observation],
    fast: float = FAST_PERCENTILE,
    patient: float = PATIENT_PERCENTILE,
    growth: float = 1.5,
    wait_ratio: float = DEFAULT_WAIT_RATIO,
) -> float:
    """The percentile of the next deadline: ``patient`` while waiting is cheap.

    With ``c(p)`` the seconds a deadline at percentile ``p`` starts from
    (:func:`deadline_seconds`, as
    :meth:`~flowerbed.strategies.DeadlineFedAvg.current_deadline` uses
    it)::

        p = patient   if c(patient) <= wait_ratio * c(fast)   else fast

    and ``patient`` before any observation. Rationale: a round at the fast
    percentile folds the full work of the fast part of the cohort and a step
    sized to the deadline from the rest, so it gains less accuracy per round
    than one that waits, and more per second only when waiting is expensive.
    What waiting costs is known from the durations the deadline already
    records; how much accuracy a round gains is not (the train loss replies
    report is local and noisy under non-IID data). Measured (the
    ``flowerbed bench`` suite and tests/test_deadline_sweep.py): on phones-10x
    with digits, where a slow phone's transfers alone outlast a fast phone's
    task, ``c(80) / c(30)`` is ~3.4 and the patient deadline is needed from the
    first round to end within a point of FedAvg at equal rounds (a first round
    at p30, then p80, ended 1.1-1.4 points below at 20 and 50 nodes); on the
    1,000-phone mnist1d suite, charged as MobileNet compute, it is ~8 (fast
    phones ~35-42 s, low-end ones ~306 s) and p30 reached 58.7% accuracy 2.1x
    as fast as Flower's best timeout, where p80 never did in the budget.
    ``wait_ratio`` 5 sits between the two (about their geometric mean); it is a
    measured threshold, not a published one.
    """
    recent = list(observations)
    slow = deadline_seconds(recent, patient, growth)
    quick = deadline_seconds(recent, fast, growth)
    if slow is None or quick is None:
        return patient
    return patient if slow <= wait_ratio * quick else fast


def metric_number(metrics: MetricRecord | ConfigRecord, key: str) -> float | None:
    """``metrics[key]`` as a float when it is a finite number >= 0, else None."""
    value = metrics.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    number = float(value)
    return number if math.isfinite(number) and number >= 0 else None


def reply_seconds(
    reply: Message,
    ticket: Ticket,
    arrived: float,
    min_batch_size: int,
    batch: float | None,
) -> tuple[float | None, float | None]:
    """Full-work seconds and least-useful seconds of a fresh reply.

    Full work (:func:`full_work_seconds`): None when it did no step; the
    round trip for an error. Least useful: the seconds for its transfers and
    one smallest step, ``(t_rtt - t_compute) + t_compute / k * b_min / b``
    for ``k`` steps of batch ``b`` (``b_min`` = ``min_batch_size``, or ``b``
    when work sizing is off); None without ``train-time-s`` or a step.
    """
    round_trip = arrived - ticket.sent_at
    if reply.has_error() or not reply.has_content():
        return round_trip, None
    metrics = next(iter(reply.content.metric_records.values()), MetricRecord())
    steps = metric_number(metrics, keys.NUM_STEPS)
    examples = metric_number(metrics, keys.NUM_EXAMPLES)
    compute = metric_number(metrics, keys.TRAIN_TIME_S)
    least = None
    if steps and compute is not None:
        share = 1.0
        if min_batch_size and batch:
            share = min(1.0, min_batch_size / batch)
        bounded = min(compute, round_trip)
        least = round_trip - bounded + bounded / steps * share
    if min_batch_size and steps and examples is not None and batch:
        # A step on a smaller batch (min_batch_size) is that share of a step.
        steps = min(steps, examples / batch)
    full = full_work_seconds(round_trip, compute, steps, ticket.assigned_steps)
    return full, least


class DurationHistory:
    """What the replies of the last rounds say about how long nodes need.

    :attr:`durations` holds the full-work durations of the sampled nodes
    (:class:`Observation`, censored for a node that did not finish),
    :attr:`least` the seconds usable replies needed for their transfers and one
    smallest step (:func:`reply_seconds`); both keep the last ``window`` rounds.
    """

    def __init__(self) -> None:
        self.durations: list[Observation] = []
        """Full-work durations of the sampled nodes of recent rounds."""
        self.least: list[tuple[int, float]] = []
        """(round, seconds) a usable reply of recent rounds needed for its
        transfers and one smallest step: the floor of a partial-work deadline."""
        self._fresh: list[tuple[Arrival, float | None]] = []
        self._fresh_least: list[float] = []

    def open_round(self) -> None:
        """Start a round: forget the previous round's fresh replies."""
        self._fresh = []
        self._fresh_least = []

    def note(self, arrival: Arrival, full: float | None, least: float | None) -> None:
        """Record a fresh reply's full-work and least-useful seconds
        (:func:`reply_seconds`)."""
        self._fresh.append((arrival, full))
        if least is not None:
            self._fresh_least.append(least)

    def recent(self, server_round: int, window: int) -> list[Observation]:
        """The durations of the ``window`` rounds before ``server_round``."""
        return [o for o in self.durations if o.round > server_round - 1 - window]

    def least_seconds(
        self, server_round: int, window: int, percentile: float
    ) -> float | None:
        """``P_p(least)``: what a partial-work deadline must leave a node.

        The ``p``-th percentile of the seconds recent usable replies needed for
        their transfers and one smallest step (:func:`reply_seconds`). When
        ``work_fraction * D`` falls below it, the deadline grows as for a
        censored percentile: ``D = P_p(least) * deadline_growth /
        work_fraction``. A fast percentile of full-work durations can fall
        there when transfers dominate a task (digits on phones-10x, where a
        fast phone's task is ~85% transfer): every node would answer zero steps
        and the round would starve. None before any usable reply.
        """
        recent = [
            Observation(r, s) for r, s in self.least if r > server_round - 1 - window
        ]
        found = censored_percentile(recent, percentile)
        return None if found is None else found[0]

    def close_round(
        self,
        server_round: int,
        closed_at: float,
        deadline: float | None,
        unfinished: Iterable[Ticket],
        window: int,
    ) -> None:
        """Record the round's full-work durations; unfinished nodes (the
        round's ``unfinished`` tickets, and replies with no step or an
        unavailable error) are censored. Keep the last ``window`` rounds."""
        # An unfinished node needed longer than it waited, and than the deadline
        # (one that did no step at all answers early, but had the deadline).
        given = deadline or 0.0
        for arrival, seconds in self._fresh:
            if arrival.fault or (
                arrival.error_code is not None
                and arrival.error_code not in UNAVAILABLE_CODES
            ):
                continue  # broken, not slow: says nothing about the deadline
            waited = arrival.arrived - arrival.ticket.sent_at
            if arrival.error_code is not None or seconds is None:
                self.durations.append(
                    Observation(server_round, max(waited, given), True)
                )
            else:
                self.durations.append(Observation(server_round, seconds))
        for ticket in unfinished:
            waited = closed_at - ticket.sent_at
            self.durations.append(Observation(server_round, max(waited, given), True))
        self.durations = [o for o in self.durations if o.round > server_round - window]
        self.least = [(r, s) for r, s in self.least if r > server_round - window] + [
            (server_round, s) for s in self._fresh_least
        ]
