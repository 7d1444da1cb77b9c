"""The gateway's limits and timings (no Flower imports, so ``flowerbed bridge --help``
can show their defaults without loading the gateway)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class GatewaySettings:
    """Limits and timings of a gateway.

    Parameters
    ----------
    max_upload_bytes : int
        Largest result blob a phone may upload (default 64 MiB); larger: 413.
    chunk_bytes : int
        Largest upload chunk (default 1 MiB).
    max_poll_s : float
        Cap on a long poll's ``wait`` (default 20 s).
    poll_s : int
        Seconds a phone is told to wait between polls after an error (default 5).
    offline_after_s : float
        A phone silent this long, with no open task, is disconnected and its node
        deactivated (default 60 s).
    deadline_slack_s : float
        Seconds after a config's ``deadline-s`` before its task expires (default 30).
    pull_interval_s : float
        Seconds between a node's pulls when idle (default 3, as Flower's SuperNode).
    max_connections : int
        Open HTTP connections at most (default 512). When full, a new connection
        closes the one that has waited longest for a request; when none waits, the
        new one gets ``503`` and is closed.
    workers : int
        Threads that run requests' blocking work (default 8): node registration,
        result decoding. Long polls wait without a thread.
    idle_timeout_s : float
        A connection must deliver a whole request head (request line and headers)
        within this many seconds of opening or of its previous answer (default 30).
    read_timeout_s : float
        Seconds a request body, or an answer being sent, may make no progress
        (default 15).
    min_bytes_per_s : int
        Slowest transfer allowed for a body or an answer: the whole transfer must
        end within ``read_timeout_s + bytes / min_bytes_per_s`` (default 4096, a
        poor mobile link).
    max_requests_per_phone : int
        Requests one phone may have in progress at once (default 4); more: ``429``.
    """

    max_upload_bytes: int = 64 * 2**20
    chunk_bytes: int = 2**20
    max_poll_s: float = 20.0
    poll_s: int = 5
    offline_after_s: float = 60.0
    deadline_slack_s: float = 30.0
    pull_interval_s: float = 3.0
    max_connections: int = 512
    workers: int = 8
    idle_timeout_s: float = 30.0
    read_timeout_s: float = 15.0
    min_bytes_per_s: int = 4096
    max_requests_per_phone: int = 4

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"{name} must be a number, got {value!r}")
            if not math.isfinite(value):
                raise ValueError(f"{name} must be finite, got {value}")
            if name == "deadline_slack_s":
                if value < 0:
                    raise ValueError(f"{name} must be >= 0, got {value}")
            elif value <= 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if self.chunk_bytes > self.max_upload_bytes:
            raise ValueError(
                f"chunk_bytes ({self.chunk_bytes}) must not exceed max_upload_bytes "
                f"({self.max_upload_bytes})"
            )
