"""Rate-limited logging: a flood of bad requests cannot flood the gateway's log.

Each kind of event (``"refused"``, ``"rejected"``, ...) has a token bucket: ``burst``
lines at once, then one line per ``interval_s``. Lines over the budget are counted,
not written, and the next line written for that kind says how many were dropped.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any


class RateLimitedLog:
    """A logger wrapper with one token bucket per event kind.

    Parameters
    ----------
    logger : logging.Logger
        Where lines go.
    burst : int
        Lines of one kind written at once before the limit applies.
    interval_s : float
        Seconds per further line of one kind.
    clock : Callable[[], float]
        Monotonic seconds (injectable for tests).
    """

    def __init__(
        self,
        logger: logging.Logger,
        burst: int = 5,
        interval_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger = logger
        self.burst = burst
        self.interval_s = interval_s
        self.clock = clock
        self._buckets: dict[str, tuple[float, float, int]] = {}
        """kind -> (tokens, time of last refill, lines suppressed since last write)"""
        self._lock = threading.Lock()

    def log(self, kind: str, level: int, msg: str, *args: Any) -> bool:
        """Write one line of ``kind`` if its budget allows; True when written."""
        now = self.clock()
        with self._lock:
            tokens, last, dropped = self._buckets.get(kind, (self.burst, now, 0))
            tokens = min(self.burst, tokens + (now - last) / self.interval_s)
            if tokens < 1:
                self._buckets[kind] = (tokens, now, dropped + 1)
                return False
            self._buckets[kind] = (tokens - 1, now, 0)
        if dropped:
            msg += f" ({dropped} similar lines suppressed)"
        self.logger.log(level, msg, *args)
        return True
