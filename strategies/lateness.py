"""Per-node lateness learnt from replies, and the ``deadline-s`` it gives each node.

A node's lateness is how long after its ``deadline-s`` its reply arrived, from
replies that used all of it: ``l_i = t_rtt - deadline-s``. What comes after a
node's ``deadline-s`` depends on the node: a board's client stops training at
it and then uploads (``flowerbed.clients.timed``), a simulated device counts its
transfers in it, Flower's delivery adds the SuperNode's polling. A fixed share
of the round's deadline cut the fast nodes' work where nothing comes after it
(in the suite's small fleets, a fifth of every round's steps) and was too
little where the upload is most of the task.
"""

from __future__ import annotations

import numpy as np
from flowerbed import keys
from flwr.app import Message, MetricRecord

from .durations import metric_number
from .inflight import Ticket

LATENESS_MEMORY = 3
"""Replies per node whose largest lateness the node's deadline allows for."""
LATENESS_SAMPLE = 100
"""Lateness values of the fleet a node without its own is judged by."""
LATENESS_PERCENTILE = 80.0
"""Percentile of the fleet's lateness given to a node without its own."""
LATENESS_SLACK = 0.02
"""Share of the deadline kept free beyond a node's learnt lateness."""
MIN_DEADLINE_SHARE = 0.1
"""Smallest share of the deadline a node is given, however late it replies."""


class NodeLateness:
    """The learnt lateness of each node, and the ``deadline-s`` it leaves it.

    :attr:`seen` holds, per node, the seconds its last (up to three) replies
    that stopped at their deadline arrived after their ``deadline-s``, newest
    last; the node seen late most recently comes last.
    """

    def __init__(self) -> None:
        self.seen: dict[int, list[float]] = {}
        """Per node, its last lateness values, newest last (newest node last)."""

    def note(self, node_id: int, late: float) -> None:
        """Record that a reply of ``node_id`` arrived ``late`` s after its
        ``deadline-s``; keep the node's last three values."""
        seen = self.seen.pop(node_id, [])  # newest node last
        self.seen[node_id] = [*seen, late][-LATENESS_MEMORY:]

    def note_reply(self, reply: Message, ticket: Ticket, arrived: float) -> None:
        """Record how late after its ``deadline-s`` a reply that used all of it
        arrived: one that stopped short of its assigned steps, or came after
        its ``deadline-s``, having done at least one step (a node that could
        not start says nothing about what follows its training). Measured
        against the ``deadline-s`` of the reply's own task: a node may have
        been given another since."""
        given = ticket.deadline_s
        if given is None or reply.has_error() or not reply.has_content():
            return
        metrics = next(iter(reply.content.metric_records.values()), MetricRecord())
        steps = metric_number(metrics, keys.NUM_STEPS)
        if not steps:  # no step: its time says nothing of what follows training
            return
        round_trip = arrived - ticket.sent_at
        stopped = (
            steps is not None
            and ticket.assigned_steps is not None
            and steps < ticket.assigned_steps
        )
        if stopped or round_trip > given:
            self.note(ticket.node_id, round_trip - given)

    def fleet(self) -> float | None:
        """The 80th percentile of the fleet's last 100 lateness values."""
        if not self.seen:
            return None
        recent = [max(v) for v in list(self.seen.values())[-LATENESS_SAMPLE:]]
        return float(np.percentile(recent, LATENESS_PERCENTILE))

    def deadline_s(self, node_id: int, deadline: float, work_fraction: float) -> float:
        """The ``deadline-s`` node ``node_id`` gets in a round of ``deadline`` s.

        ``D`` less the time the node's replies need after its ``deadline-s``::

            deadline-s = clamp(D - max(l, 0) - max(0.02 D, spread), 0.1 D, D)

        with ``l`` the largest of the node's last three lateness values, else
        the 80th percentile of that value over the last 100 nodes seen late,
        else ``(1 - work_fraction) D``. The largest, not the last: a node stops
        at its last whole step before ``deadline-s``, so one reply can
        understate what comes after it by up to a step. ``spread`` is the
        range of those three values (each taken as at least 0): a node whose
        delivery varies (a SuperNode's polling, a ClientApp's start on a busy
        board) keeps that much more in hand. The 2% is a margin for jitter,
        not a measured value.
        """
        seen = [max(v, 0.0) for v in self.seen.get(node_id, [])]
        spread = max(seen) - min(seen) if seen else 0.0
        late = max(seen) if seen else self.fleet()
        if late is None:
            return work_fraction * deadline
        slack = max(LATENESS_SLACK * deadline, spread)
        given = deadline - max(late, 0.0) - slack
        return min(deadline, max(MIN_DEADLINE_SHARE * deadline, given))


def deadline_floor(
    deadline: float,
    least: float,
    late: float | None,
    work_fraction: float,
    growth: float,
) -> float:
    """The shortest deadline that leaves the percentile's node one step.

    ``least`` is ``P_p(least)``, the seconds recent usable replies needed for
    their transfers and one smallest step
    (:meth:`~flowerbed.strategies.durations.DurationHistory.least_seconds`).
    With the fleet's lateness ``l = late`` known (``learn_margin``, see
    :meth:`NodeLateness.fleet`): ``(P_p(least) + max(l, 0)) / (1 - 0.02)``, the
    deadline whose ``deadline-s`` covers the transfers and one smallest step.
    Otherwise, when ``work_fraction * D < P_p(least)``, ``D`` grows as for a
    censored percentile to ``P_p(least) * growth / work_fraction`` (the fixed
    share gives no better estimate of what comes after ``deadline-s``). On
    digits with 50 phones (transfers ~85% of a fast phone's task) that growth
    set rounds 1.6x the 30th percentile's duration, longer than Flower's best
    timeout.
    """
    if late is not None:
        return (least + max(late, 0.0)) / (1 - LATENESS_SLACK)
    if deadline * work_fraction < least:
        return least * growth / work_fraction
    return deadline
