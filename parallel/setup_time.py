"""Where a span member's set-up goes, measured on the member.

Flower starts a fresh ``flwr-clientapp`` process for every message, so every
segment pays, before its first step, for that process's start and for the
rendezvous of its group. Each member measures its share and reports it:

- ``span-start-s`` (:data:`SPAN_START_S`): the ClientApp's start, seconds from
  this process's start to the runner's arrival (the process spawn, flwr's and
  the app's imports, torch's above all, pulling the message and its arrays);
- ``span-join-s`` (:data:`SPAN_JOIN_S`): the rendezvous, seconds from entering
  the segment's group until every member had arrived and the gloo group
  formed (mostly waiting for the member whose ClientApp started last);
- ``span-setup-s`` (``flowerbed.keys.SPAN_SETUP_S``): seconds from the
  runner's arrival to the first step (the model, the data, the rendezvous,
  weights moved from peers).

A member's set-up is ``span-start-s + span-setup-s``
(:func:`member_setup_s`); the round's set-up as the server sees it, Flower's
delivery included, is in :mod:`flowerbed.strategies.span_sizing`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass

from flowerbed import keys

SPAN_START_S = "span-start-s"
"""Seconds from the ClientApp process's start to the runner's arrival."""
SPAN_JOIN_S = "span-join-s"
"""Seconds the member spent in its segment's rendezvous."""


def process_age_s() -> float:
    """Seconds since this process started, from Linux's ``/proc`` (the kernel's
    start time in clock ticks since boot against the uptime); 0.0 where that
    cannot be read (another OS)."""
    try:
        with open("/proc/self/stat", encoding="ascii") as fh:
            # The command name (field 2) may hold spaces: fields after its ')'.
            fields = fh.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime", encoding="ascii") as fh:
            uptime = float(fh.read().split()[0])
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22, starttime
    except (OSError, ValueError, IndexError):
        return 0.0
    return max(0.0, uptime - started)


@dataclass
class SetupClock:
    """A member's set-up times, started when its runner is called.

    ``start_s`` is the process's age then (:func:`process_age_s`); the runner
    marks the rendezvous (:meth:`joined`, with the seconds it took) and the first
    step (:meth:`ready`)."""

    arrived: float
    start_s: float
    join_s: float = 0.0
    setup_s: float = 0.0

    @classmethod
    def begin(cls) -> SetupClock:
        return cls(arrived=time.monotonic(), start_s=process_age_s())

    def joined(self, seconds: float) -> None:
        self.join_s = seconds

    def ready(self) -> float:
        """Mark the first step; return the seconds since arrival."""
        self.setup_s = time.monotonic() - self.arrived
        return self.setup_s

    def describe(self) -> str:
        """One log phrase: where the set-up went."""
        return (
            f"set-up {self.start_s + self.setup_s:.1f} s: ClientApp start "
            f"{self.start_s:.1f} s, rendezvous {self.join_s:.1f} s, model, data and "
            f"weights {max(0.0, self.setup_s - self.join_s):.1f} s"
        )

    def metrics(self) -> dict[str, float]:
        return {
            SPAN_START_S: self.start_s,
            SPAN_JOIN_S: self.join_s,
            keys.SPAN_SETUP_S: self.setup_s,
        }


def member_setup_s(metrics: Mapping[str, object]) -> float:
    """A member's set-up from its reply's metrics: ClientApp start plus the
    seconds from arrival to the first step (0 for what it did not report)."""
    total = 0.0
    for key in (SPAN_START_S, keys.SPAN_SETUP_S):
        value = metrics.get(key, 0.0)
        if isinstance(value, int | float) and not isinstance(value, bool):
            total += float(value)
    return total
