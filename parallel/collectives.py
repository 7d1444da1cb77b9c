"""What a collective costs on a link: the ring all-reduce (pure, no torch).

One formula shared by every model of a job that spans devices: the fused-tile
cost model (:mod:`flowerbed.parallel.tiles.grouping`), the network model and the
all-reduce clock of the simulator (:mod:`flowerbed.sims.links`) and the
benchmark. ``parallel/`` may not import ``sims/``, so it lives here.

**Ring all-reduce** (reduce-scatter then all-gather; Patarasuk and Yuan,
"Bandwidth optimal all-reduce algorithms for clusters of workstations", JPDC
69(2), 2009; Thakur, Rabenseifner, Gropp, "Optimization of collective
communication operations in MPICH", IJHPCA 19(1), 2005, Sec. 4): each of the
``n`` devices sends ``2 (n - 1)`` messages of ``bytes / n``, one after the
other, so

    T = 2 (n - 1) / n * bytes / bandwidth + 2 (n - 1) * latency

with ``bandwidth`` what each device can send while all send at once and
``latency`` the per-message cost.
"""

from __future__ import annotations

import math


def ring_allreduce_seconds(
    n: int, num_bytes: float, bandwidth_mbps: float, latency_s: float
) -> float:
    """``2 (n - 1) / n * bytes / bandwidth + 2 (n - 1) * latency`` (module doc).

    ``bandwidth_mbps`` in Mbit/s (10^6 bits); 0 for a single device (nothing to
    exchange). ValueError for fewer than one device, a bandwidth that is not a
    finite number > 0, or a negative byte count or latency.
    """
    if n < 1:
        raise ValueError(f"an all-reduce needs at least one device, got {n}")
    if not (math.isfinite(bandwidth_mbps) and bandwidth_mbps > 0):
        raise ValueError(f"bandwidth must be > 0 Mbit/s, got {bandwidth_mbps}")
    if not num_bytes >= 0:
        raise ValueError(f"an all-reduce moves >= 0 bytes, got {num_bytes}")
    if not latency_s >= 0:
        raise ValueError(f"latency must be >= 0 s, got {latency_s}")
    if n == 1:
        return 0.0
    seconds_per_byte = 8.0 / (bandwidth_mbps * 1e6)
    return 2 * (n - 1) / n * num_bytes * seconds_per_byte + 2 * (n - 1) * latency_s
