"""Clocks: how a strategy waits, whether time is real or simulated.

docs/architecture.md ("Two clocks, one code path"): in deployment a strategy pushes
messages and pulls replies on wall time; in simulation the in-process engine keeps a
virtual clock and releases replies in virtual-time order. A strategy asks
:func:`clock_of` for the grid's clock and never needs to know which one it has.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from flwr.app import Message

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


def collect_replies(
    grid: object, message_ids: Iterable[str], timeout: float | None
) -> list[Message]:
    """Pull replies to ``message_ids`` until all arrived or ``timeout`` passed.

    Flower's ``Grid.send_and_receive`` semantics on the grid's own clock: with a
    virtual clock the wait costs no real time; with wall time it polls.
    """
    from flwr.serverapp import Grid

    assert isinstance(grid, Grid)
    clock = clock_of(grid)
    waiting = set(message_ids)
    end = math.inf if timeout is None else clock.now() + timeout
    replies: list[Message] = []
    while waiting:
        for reply in grid.pull_messages(list(waiting)):
            replies.append(reply)
            waiting.discard(reply.metadata.reply_to_message_id)
        remaining = end - clock.now()
        if not waiting or remaining <= 0:
            break
        clock.wait(remaining)
    return replies
