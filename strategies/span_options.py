"""Option objects shared by the span-job strategies
(:class:`~flowerbed.strategies.span.SpanJobStrategy` and its subclasses).

- :class:`SpanGroup`: where a job's members meet each segment (the rendezvous
  port range) and how long they wait for each other and for Flower.

The flat keywords it replaces (``PipelineTraining(timeout_s=30)``) still work for
one release and warn with the object to use instead
(:func:`flowerbed.strategies.options.take_options`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from flowerbed.parallel.group import segment_port

DEFAULT_RENDEZVOUS_PORT = 29500
DEFAULT_RENDEZVOUS_PORTS = 50
DEFAULT_JOIN_TIMEOUT_S = 60.0
DEFAULT_TIMEOUT_S = 60.0
DEFAULT_REPLY_MARGIN_S = 15.0


@dataclass(frozen=True)
class SpanGroup:
    """Where a span job's members meet, and how long everyone waits.

    Parameters
    ----------
    rendezvous_port : int (default: 29500)
        First port of the rendezvous range; rank 0's board must accept
        connections on it (and gloo's own ephemeral ports) from the others.
    rendezvous_ports : int (default: 50)
        Size of the range; segment ``n`` uses port ``first + n % size``.
    join_timeout_s : float (default: 60)
        How long members wait for each other to join a segment's group
        (covers Flower's delivery skew: SuperNodes poll every few seconds and
        start a process per message).
    timeout_s : float (default: 60)
        How long one collective or send/receive may take before a peer counts as
        lost.
    reply_margin_s : float (default: 15)
        Extra seconds for replies to travel through Flower after a loss.
    """

    rendezvous_port: int = DEFAULT_RENDEZVOUS_PORT
    rendezvous_ports: int = DEFAULT_RENDEZVOUS_PORTS
    join_timeout_s: float = DEFAULT_JOIN_TIMEOUT_S
    timeout_s: float = DEFAULT_TIMEOUT_S
    reply_margin_s: float = DEFAULT_REPLY_MARGIN_S

    def __post_init__(self) -> None:
        segment_port(self.rendezvous_port, self.rendezvous_ports, 0)  # range check
        for name in ("join_timeout_s", "timeout_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be > 0, got {value}")
        if not (math.isfinite(self.reply_margin_s) and self.reply_margin_s >= 0):
            raise ValueError(f"reply_margin_s must be >= 0, got {self.reply_margin_s}")
        for name in ("join_timeout_s", "timeout_s", "reply_margin_s"):
            object.__setattr__(self, name, float(getattr(self, name)))
