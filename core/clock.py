"""Clocks: how a strategy waits, whether time is real or simulated.

ARCHITECTURE.md ("Two clocks, one code path"): in deployment a strategy pushes
messages and pulls replies on wall time; in simulation the in-process engine keeps a
virtual clock and releases replies in virtual-time order. A strategy asks
:func:`clock_of` for the grid's clock and never needs to know which one it has.
"""

from __future__ import annotations

import time
from typing import Protocol, runtime_checkable

DEFAULT_POLL_INTERVAL_S = 0.1
"""Wall-clock polling period while waiting for replies (seconds)."""


@runtime_checkable
class Clock(Protocol):
    """Time source and waiting primitive used by strategies."""

    def now(self) -> float:
        """Seconds since an arbitrary, fixed origin (monotonic)."""
        ...

    def wait(self, seconds: float) -> None:
        """Wait at most ``seconds``; may return early once a reply may have arrived."""
        ...


class WallClock:
    """Real time: ``time.monotonic`` and short sleeps between polls."""

    def __init__(self, poll_interval_s: float = DEFAULT_POLL_INTERVAL_S) -> None:
        self.poll_interval_s = poll_interval_s

    def now(self) -> float:
        return time.monotonic()

    def wait(self, seconds: float) -> None:
        if seconds > 0:
            time.sleep(min(seconds, self.poll_interval_s))


def clock_of(grid: object) -> Clock:
    """Return ``grid.clock`` when the grid keeps its own clock, else wall time."""
    clock = getattr(grid, "clock", None)
    if isinstance(clock, Clock):
        return clock
    return WallClock()
