"""The weight of one train reply under each weighting, and work balancing's shares.

:class:`ReplyWeights` turns a reply's metrics into ``(w_i, c_i, tau_i)`` (the
formulas are in :class:`~flowerbed.strategies.RuntimeWeightedFedAvg`'s
docstring), reading the runtime and the steps the reply reports or, failing
that, what the server measured or assigned. :func:`balanced_steps` is work
balancing's ``L * s_i / mean(s)``.
"""

from __future__ import annotations

from logging import WARNING

from flowerbed import keys
from flowerbed.replies import ReplyRejected
from flowerbed.strategies.inflight import Ticket
from flwr.app import MetricRecord
from flwr.supercore import log

from .robust import Reference


class ReplyWeights:
    """How a strategy weighs train replies, and what it remembers to do so.

    Parameters
    ----------
    weighting : str
        ``"runtime"``, ``"throughput"``, ``"fednova"`` or ``"examples"``.
    weight_cap : float, optional
        Bounds a ``num-steps`` claim where no work was assigned
        (:meth:`bounded_steps`); None: no bound.
    """

    def __init__(self, weighting: str, weight_cap: float | None) -> None:
        self.weighting = weighting
        self.weight_cap = weight_cap
        self.recent_steps = Reference()
        """``num-steps`` of recent accepted replies: the bound on a claim where
        no work was assigned (:meth:`bounded_steps`)."""
        self._steps_capped: set[int | None] = set()
        self._fallbacks_logged: set[str] = set()

    def fallback_once(self, what: str, message: str) -> None:
        """Log ``message`` the first time the fallback ``what`` is taken."""
        if what not in self._fallbacks_logged:
            self._fallbacks_logged.add(what)
            log(WARNING, message)

    def runtime(
        self, metrics: MetricRecord, ticket: Ticket | None, arrived: float | None
    ) -> float:
        """``t_i``: ``train-time-s``, else the measured reply round trip."""
        if keys.TRAIN_TIME_S in metrics:
            return float(metrics[keys.TRAIN_TIME_S])  # type: ignore[arg-type]
        if ticket is None or arrived is None:
            raise ReplyRejected(
                f"no {keys.TRAIN_TIME_S!r} and no measured round trip", fault=False
            )
        self.fallback_once(
            "runtime",
            f"replies carry no {keys.TRAIN_TIME_S!r}: using the measured reply "
            "round-trip time as each node's runtime",
        )
        return arrived - ticket.sent_at

    def steps(self, metrics: MetricRecord, ticket: Ticket | None) -> float | None:
        """``tau_i``: ``num-steps`` (bounded), else the steps assigned, else None."""
        if keys.NUM_STEPS in metrics:
            reported = float(metrics[keys.NUM_STEPS])  # type: ignore[arg-type]
            return self.bounded_steps(reported, ticket)
        if ticket is not None and ticket.assigned_steps is not None:
            self.fallback_once(
                "steps",
                f"replies carry no {keys.NUM_STEPS!r}: assuming each node did the "
                f"{keys.LOCAL_STEPS!r} it was assigned",
            )
            return float(ticket.assigned_steps)
        return None

    def bounded_steps(self, reported: float, ticket: Ticket | None) -> float:
        """``num-steps`` as far as the server can vouch for it.

        With FedNova's weighting a reply's steps ``tau_i`` set how far the whole
        round moves (``tau_eff = sum_i p_i tau_i``, Wang et al., NeurIPS 2020,
        Eq. 6), so a claim of 10^9 steps would scale every node's update. A node
        is held to the ``local-steps`` it was assigned; where nothing was
        assigned, to ``weight_cap`` times the median of the steps recent accepted
        replies reported (no bound until :data:`~.robust.MIN_REFERENCE` are
        known, or with ``weight_cap=None``). A capped claim is logged once per
        node with the value and the bound.
        """
        if ticket is not None and ticket.assigned_steps is not None:
            bound, why = float(ticket.assigned_steps), "the local-steps it was assigned"
        else:
            median = self.recent_steps.median()
            if median is None or self.weight_cap is None:
                return reported
            bound = self.weight_cap * median
            why = f"weight_cap={self.weight_cap:g} x the median of recent replies"
        if reported <= bound:
            return reported
        node = ticket.node_id if ticket is not None else None
        if node not in self._steps_capped:
            self._steps_capped.add(node)
            log(
                WARNING,
                "node %s reported %s=%g, more than %g (%s): counted as %g from now on",
                "?" if node is None else node,
                keys.NUM_STEPS,
                reported,
                bound,
                why,
                bound,
            )
        return bound

    def weigh(
        self,
        metrics: MetricRecord,
        num_examples: float,
        ticket: Ticket | None,
        arrived: float | None,
    ) -> tuple[float, float, float]:
        """``(w_i, c_i, tau_i)`` of one reply under ``weighting``.

        Raises
        ------
        ReplyRejected
            When the metrics the weighting needs are zero or unavailable.
        """
        steps = self.steps(metrics, ticket)
        if self.weighting == "examples":
            return num_examples, 1.0, steps or 1.0
        if self.weighting == "fednova":
            if steps is None:
                self.fallback_once(
                    "fednova",
                    f"fednova weighting without {keys.NUM_STEPS!r} or assigned "
                    f"{keys.LOCAL_STEPS!r}: every node counts as one step (FedAvg)",
                )
                steps = 1.0
            if steps <= 0:
                raise ReplyRejected(
                    "0 optimiser steps: nothing to average", fault=False
                )
            return num_examples, 1.0 / steps, steps
        if self.weighting == "throughput" and keys.SAMPLES_PER_S in metrics:
            rate = float(metrics[keys.SAMPLES_PER_S])  # type: ignore[arg-type]
            if rate <= 0:
                raise ReplyRejected(f"{keys.SAMPLES_PER_S!r} is 0", fault=False)
            return rate, 1.0, steps or 1.0
        runtime = self.runtime(metrics, ticket, arrived)
        if runtime <= 0:
            raise ReplyRejected(
                f"runtime is {runtime:g} s: cannot weight by runtime", fault=False
            )
        if self.weighting == "runtime":
            return 1.0 / runtime, 1.0, steps or 1.0
        return num_examples / runtime, 1.0, steps or 1.0

    def speed(
        self, metrics: MetricRecord, ticket: Ticket | None, arrived: float | None
    ) -> float | None:
        """The reply's optimiser steps per second; None when not measurable."""
        steps = self.steps(metrics, ticket)
        if steps is None or steps <= 0:
            return None
        try:
            runtime = self.runtime(metrics, ticket, arrived)
        except ReplyRejected:
            return None
        if runtime <= 0:
            return None
        return steps / runtime


def balanced_steps(
    speeds: dict[int, float],
    node_ids: list[int],
    base: int,
    least: int,
    most: int | None,
) -> dict[int, int]:
    """Work balancing: ``L * s_i / mean(s)`` steps for known nodes, ``L`` else.

    ``L`` is ``base``; the mean runs over the known nodes among ``node_ids``; a
    share is clamped to ``[least, most]`` (``most`` None: ``4 * L``).
    """
    known = [speeds[n] for n in node_ids if n in speeds]
    mean = sum(known) / len(known) if known else 0.0
    most = most or 4 * base
    steps = {}
    for node in node_ids:
        if node in speeds and mean > 0:
            share = round(base * speeds[node] / mean)
            steps[node] = int(min(most, max(least, share)))
        else:
            steps[node] = base
    return steps


def smooth(speeds: dict[int, float], node: int, speed: float, a: float) -> None:
    """``s <- a s_new + (1 - a) s`` for ``node`` (its first ``speed`` as it is)."""
    old = speeds.get(node)
    speeds[node] = speed if old is None else a * speed + (1 - a) * old
