"""The adaptive deadline: what recent rounds showed, and the deadline it gives."""

from __future__ import annotations

import math
from collections.abc import Callable
from logging import INFO
from typing import Any

from flowerbed import keys
from flwr.serverapp.strategy import Result
from flwr.supercore import log

from .checkpoints import (
    FINITE,
    METRIC_VALUES,
    NODE_IDS,
    NON_NEGATIVE,
    ROUNDS,
    Bounds,
    StateReader,
)
from .durations import (
    DurationHistory,
    Observation,
    deadline_seconds,
    two_speed_percentile,
)
from .lateness import LATENESS_SLACK, NodeLateness, deadline_floor
from .options import PATIENT_PERCENTILE, Deadlines
from .pacer import Pacer

PROGRESS_METRICS = ("accuracy", keys.EVAL_ACC)
"""Metrics the pacer looks for (server-side evaluation first, then federated)."""
DEFAULT_PACER_STEP = 0.1
"""The pacer's step with a fixed percentile (Oort's pacer, see :class:`Pacer`)."""
TWO_SPEED_PACER_STEP = 0.0
"""No pacer with two speeds: :func:`two_speed_percentile` already sets how long
rounds wait, from durations, and the pacer's factor follows differences of
noisy accuracies. On the mnist1d suite (device-correlated labels, seeds 1-5)
it wandered (up to 1.8 in seed 1: rounds of ~1.8x the 30th percentile) and the
two-speed deadline reached 58.7% accuracy in 3,781, 5,603, 3,943, 4,558 and
3,613 virtual s with it, 3,658, 3,322, 3,440, 3,628 and 4,460 without."""
WHOLE_WORK_PERCENTILE = PATIENT_PERCENTILE
"""The adaptive deadline's percentile without partial work: without it the slow
nodes' full-work durations are never seen, only that they did not finish, so
there is nothing to weigh the two speeds with."""


class AdaptiveDeadline:
    """Each round's deadline, from the full-work durations of recent rounds.

    ``D_r = f * P_p(full-work durations of the last W rounds)``, the ``p``-th
    percentile (nearest rank) of the time each sampled node needed for its
    whole assigned work, times a pacing factor ``f``. A node that did not
    finish (straggler, expired message, no step within ``deadline-s``) counts
    as slower than every node that did; when the percentile falls on such a
    node, the deadline grows: ``D_r = f * deadline_growth * (the time it was
    given)``. With partial work a reply of ``k`` of ``L`` steps counts as
    ``(t_rtt - t_compute) + t_compute * L / k``
    (:func:`~flowerbed.strategies.durations.full_work_seconds`), so the
    deadline cannot shrink round after round on its own partial work. ``f`` is
    Oort's pacer (:class:`~flowerbed.strategies.pacer.Pacer`, ``pacer_step``,
    ``pacer_window``, ``pacing_bounds``). ``D`` never exceeds ``start()``'s
    ``timeout``.

    **Two speeds** (the default with partial work, ``deadline_percentile``
    None): each round ``p`` is 80 while the 80th percentile of the recent
    full-work durations is at most ``wait_ratio`` times the 30th, else
    ``fast_percentile`` (:func:`two_speed_percentile`, which gives the
    rationale and the measurements): rounds wait for the slow nodes where that
    is cheap and do not where it is not.

    Parameters
    ----------
    deadlines : Deadlines
        The settings (:class:`~flowerbed.strategies.options.Deadlines`).
    """

    def __init__(self, deadlines: Deadlines) -> None:
        self.options = deadlines
        percentile = deadlines.deadline_percentile
        if percentile is None and not deadlines.partial_work:
            percentile = WHOLE_WORK_PERCENTILE
        self.fixed_percentile = None if percentile is None else float(percentile)
        """The fixed percentile; None: two speeds (:func:`two_speed_percentile`)."""
        self.percentile = self.fixed_percentile or PATIENT_PERCENTILE
        """The percentile of the current round's deadline."""
        step = deadlines.pacer_step
        if step is None:
            step = (
                TWO_SPEED_PACER_STEP
                if self.fixed_percentile is None
                else DEFAULT_PACER_STEP
            )
        self.pacer_step = float(step)
        """The pacer's step, ``None`` resolved."""
        self.pacer = Pacer()
        """The pacer's factor on the deadline and the accuracies it follows."""
        self.history = DurationHistory()
        """Recent full-work durations and least-useful seconds of replies."""
        self.lateness = NodeLateness()
        """What each node's replies need after its ``deadline-s``."""

    def summary(self) -> None:
        """Log the deadline's settings (a line of the strategy's summary)."""
        options = self.options
        log(
            INFO,
            "\t│\t├── Deadline: %s (adaptive %s, %s of %d rounds, growth %.2g)",
            options.deadline_s,
            options.adaptive_deadline,
            f"p{self.fixed_percentile:g}"
            if self.fixed_percentile is not None
            else f"p{PATIENT_PERCENTILE:g} or p{float(options.fast_percentile):g} "
            f"(wait ratio {float(options.wait_ratio):g})",
            options.deadline_window,
            options.deadline_growth,
        )

    def deadline(self, server_round: int, timeout: float) -> float | None:
        """The deadline (clock seconds) for ``server_round``; None if unknown.

        ``D = c(p)`` (times the pacer's factor), the ``p``-th percentile of
        recent full-work durations; with partial work and ``learn_margin``,
        ``D = c(p) / (1 - 0.02)``, so that the node at the percentile, given
        ``D - l - 0.02 D``
        (:meth:`~flowerbed.strategies.DeadlineFedAvg.node_deadline`), still has
        the whole task it needs. Without that division the percentile's own
        node lost its last step every round (on 20 identical boards, 9 of 10
        steps in a round as long as FedAvg's). With partial work ``D`` is at
        least :func:`~flowerbed.strategies.lateness.deadline_floor`. Also sets
        :attr:`percentile`, the one this deadline is taken at.
        """
        options = self.options
        if not options.adaptive_deadline:
            return options.deadline_s
        recent = self.history.recent(server_round, options.deadline_window)
        self.percentile = (
            self.fixed_percentile
            if self.fixed_percentile is not None
            else two_speed_percentile(
                recent,
                float(options.fast_percentile),
                PATIENT_PERCENTILE,
                options.deadline_growth,
                float(options.wait_ratio),
            )
        )
        base = deadline_seconds(recent, self.percentile, options.deadline_growth)
        if base is None:
            return options.deadline_s
        deadline = self.pacer.factor * base
        if options.partial_work and options.learn_margin:
            # The percentile's node keeps its whole task: its deadline-s,
            # D - l - 0.02 D, covers the c(p) - l it needs before what follows.
            deadline /= 1 - LATENESS_SLACK
        if options.partial_work:
            least = self.history.least_seconds(
                server_round, options.deadline_window, self.percentile
            )
            if least is not None:
                late = self.lateness.fleet() if options.learn_margin else None
                deadline = max(
                    deadline,
                    deadline_floor(
                        deadline,
                        least,
                        late,
                        options.work_fraction,
                        options.deadline_growth,
                    ),
                )
        return min(deadline, timeout)

    def pace(self, server_round: int, result: Result) -> None:
        """Feed the round's accuracy (``progress_metric``, else
        :data:`PROGRESS_METRICS`) to the pacer; log when it moves."""
        value = self._progress_value(server_round, result)
        if value is None or not self.options.adaptive_deadline or self.pacer_step == 0:
            return
        if not math.isfinite(value):  # an evaluate_fn's NaN says nothing of pace
            return
        change = self.pacer.update(
            server_round,
            value,
            self.pacer_step,
            self.options.pacer_window,
            self.options.pacing_bounds,
        )
        if change is None:
            return
        log(
            INFO,
            "round %d: accuracy progress %s the deadline (pacing factor %.2f)",
            server_round,
            change,
            self.pacer.factor,
        )

    def _progress_value(self, server_round: int, result: Result) -> float | None:
        metric = self.options.progress_metric
        names = (metric,) if metric else PROGRESS_METRICS
        for history in (
            result.evaluate_metrics_serverapp,
            result.evaluate_metrics_clientapp,
        ):
            record = history.get(server_round)
            if record is None:
                continue
            for name in names:
                value = record.get(name)
                if isinstance(value, int | float):
                    return float(value)
        return None

    def state(self) -> dict[str, Any]:
        """The pacing, durations, progress, least-useful seconds and lateness."""
        return {
            "pacing": self.pacer.factor,
            "durations": [
                [o.round, o.seconds, o.censored] for o in self.history.durations
            ],
            "progress": self.pacer.progress,
            "least": [[r, s] for r, s in self.history.least],
            "lateness": [
                [n, s] for n, seen in self.lateness.seen.items() for s in seen
            ],
        }

    def reader(self, saved: StateReader) -> Callable[[], None]:
        """Check what :meth:`state` returned (a field out of range raises one
        CheckpointError naming it); the function returned loads it."""
        pacing = saved.number("pacing", Bounds(*self.options.pacing_bounds))
        durations = [
            Observation(int(r), float(d), c)
            for r, d, c in saved.rows("durations", ROUNDS, NON_NEGATIVE, bool)
        ]
        progress = saved.numbers("progress", METRIC_VALUES)
        least = saved.rows("least", ROUNDS, NON_NEGATIVE) if "least" in saved else []
        lateness = (
            saved.rows("lateness", NODE_IDS, FINITE) if "lateness" in saved else []
        )

        def load() -> None:
            self.pacer.factor = pacing
            self.history.durations = durations
            self.pacer.progress = progress
            self.history.least = [(int(r), float(s)) for r, s in least]
            self.lateness.seen = {}
            for n, s in lateness:
                self.lateness.seen.setdefault(int(n), []).append(float(s))

        return load
