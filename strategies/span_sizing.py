"""How many steps a span job's segment runs, so that its set-up stays small.

Every segment of a span job pays a set-up before its first step: Flower
delivers the plan (a SuperNode looks for messages every few seconds), starts a
fresh ``flwr-clientapp`` process per message (imports included), the members
meet at the rendezvous and move weights; and after the last step the replies
travel back. Seen from the server, a round's set-up is its wall time less the
time of its steps,

    S = W - k * T

(``W`` the segment's wall seconds, ``k`` its steps, ``T`` the measured seconds
per step; the members report their own share of ``S``:
:mod:`flowerbed.parallel.setup_time`). Its share of the round is
``S / (S + k T)``; it is at most ``s`` when

    k >= S (1 - s) / (s T)

so :class:`SegmentSizer` grows the steps per segment to the smallest such ``k``
(never below the starting value) after each completed round, on the mean of
the rounds measured so far. The default ``s`` is :data:`DEFAULT_SETUP_SHARE`.

``S`` is a remainder, so it carries the error of ``k T``: at the share ``s`` the
steps take ``k T = S (1 - s) / s`` (nine times ``S`` at 10%), and a 2% error in
``T`` moves the measured ``S`` by about 18%. The set-up also varies from round
to round (a SuperNode polls every few seconds; ClientApp start-up depends on
the board's load): on the pipeline benchmark's real deployment one round
measured 12.7 s of set-up and the next, sized on it, 15.3 s, 12% of its wall
time. So the sizer aims at :data:`SHARE_HEADROOM` times the share, which keeps
the realised share under ``s`` through a quarter more set-up than forecast.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from logging import INFO

from flwr.supercore import log

DEFAULT_SETUP_SHARE = 0.1
"""Largest share of a round that set-up may take by default."""
SHARE_HEADROOM = 0.8
"""The sizer aims at this fraction of the share (module doc): a set-up 1/0.8 =
1.25 times the forecast still stays within the share."""
ROUND_SETUP_S = "setup-s"
"""Round metric: the segment's seconds not spent in steps (``S`` above)."""
ROUND_SETUP_SHARE = "setup-share"
"""Round metric: ``S / W``, the share of the segment's wall time."""
ROUND_NEXT_STEPS = "next-steps-per-round"
"""Round metric: the steps the next round's segment runs."""


def round_setup_s(wall_s: float, steps: int, step_s: float) -> float:
    """``S = W - k T``, at least 0 (the module doc)."""
    return max(0.0, wall_s - steps * step_s)


def steps_for_share(setup_s: float, step_s: float, share: float) -> int:
    """The fewest steps ``k`` with ``S / (S + k T) <= share`` (at least 1)."""
    if not 0.0 < share < 1.0:
        raise ValueError(f"setup share must be in (0, 1), got {share}")
    if setup_s <= 0.0:
        return 1
    if step_s <= 0.0:
        raise ValueError(f"seconds per step must be > 0, got {step_s}")
    exact = setup_s * (1.0 - share) / (share * step_s)
    # math.ceil of a quotient that should be whole may land one above it.
    return max(1, math.ceil(exact - 1e-9))


@dataclass
class SegmentSizer:
    """Steps per segment: ``steps`` to start with; with a ``share``, grown after
    each measured round so that set-up stays at most that share, aiming at
    :data:`SHARE_HEADROOM` of it (module doc); with ``share=None``, fixed.

    Attributes
    ----------
    steps : int
        The steps the next segment runs.
    share : float or None
        Largest share of a round set-up may take; None keeps ``steps`` fixed.
    """

    steps: int
    share: float | None = DEFAULT_SETUP_SHARE
    setups: list[float] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"steps per segment must be >= 1, got {self.steps}")
        if self.share is not None and not 0.0 < self.share < 1.0:
            raise ValueError(f"setup_share must be in (0, 1) or None, got {self.share}")

    def measured(self, wall_s: float, steps: int, step_s: float) -> dict[str, float]:
        """Record a completed segment (``W``, ``k``, ``T``); return its round
        metrics (set-up, its share, the next segment's steps)."""
        setup = round_setup_s(wall_s, steps, step_s)
        if math.isfinite(setup) and math.isfinite(step_s) and step_s > 0 and steps > 0:
            self.setups.append(setup)
            self.step_times.append(step_s)
            if self.share is not None:
                mean_setup = sum(self.setups) / len(self.setups)
                mean_step = sum(self.step_times) / len(self.step_times)
                aim = self.share * SHARE_HEADROOM
                self.steps = max(
                    self.steps, steps_for_share(mean_setup, mean_step, aim)
                )
        return {
            ROUND_SETUP_S: setup,
            ROUND_SETUP_SHARE: setup / wall_s if wall_s > 0 else 0.0,
            ROUND_NEXT_STEPS: float(self.steps),
        }

    def report(
        self,
        owner: str,
        server_round: int,
        wall_s: float,
        setup: Mapping[str, float],
        slowest_s: float,
    ) -> None:
        """Log where a measured segment's time went (``setup``: what
        :meth:`measured` returned; ``slowest_s``: the slowest member's seconds
        to its first step) and the steps of the next rounds."""
        log(
            INFO,
            "%s: round %d set-up %.1f s of the segment's %.1f s (%.0f%%; slowest "
            "member: %.1f s to its first step); next rounds %d steps",
            owner,
            server_round,
            setup[ROUND_SETUP_S],
            wall_s,
            100 * setup[ROUND_SETUP_SHARE],
            slowest_s,
            self.steps,
        )
