"""Option objects of :class:`~flowerbed.strategies.TiledTraining`.

- :class:`TilePlanning`: which boards a job takes and how its tiles are planned
  (the grouping, the bands, batch norm, the boards' memory and speed models);
- :class:`TileLinks`: the links between the boards, as the planner models them
  (and as members emulate them on one machine).

The flat keywords these replace (``TiledTraining(max_devices=4)``) still work for
one release and warn with the object to use instead
(:func:`flowerbed.strategies.options.take_options`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from flowerbed.parallel.tiles.regions import TileError
from flowerbed.parallel.tiles.speed import DEFAULT_SMOOTHING

DEFAULT_LINK_MBPS = 100.0
"""Raspberry Pi 3 Ethernet (docs/references.md, "Devices")."""
DEFAULT_LATENCY_S = 1e-3
DEFAULT_SUBNET_PREFIX = 24
DEFAULT_MAX_DEVICES = 6


def check_count(name: str, value: object) -> None:
    """Raise ValueError unless ``value`` is an integer >= 1 (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


@dataclass(frozen=True)
class TilePlanning:
    """Which boards a tiled job takes and how its tiles are planned.

    Parameters
    ----------
    max_devices : int (default: 6)
        Most boards one job takes.
    front : int, optional
        Tile exactly this many top-level layers (default: the DP chooses).
    bounds : sequence of int, optional
        Fix the grouping, e.g. ``(0, 4, 8)`` (default: the DP chooses).
    bands : int, optional
        Bands of rows of the tile grid (default: least halo).
    norm : str (default: "sync")
        Batch norm in the tiled layers: ``"sync"`` (full-map statistics summed
        across boards) or ``"frozen"`` (running statistics).
    memory_budget_mb : float, optional
        Cap on the memory a board may use (MiB), e.g. 900 for a 1 GB Pi 3
        (default: 80% of what the board reports free).
    subnet_prefix : int (default: 24)
        Boards whose IPv4 addresses share this prefix count as co-located.
    profile_size : int (default: 64)
        Side of the square crop each board times when profiled.
    speed_smoothing : float (default: 0.5)
        Weight of a segment's speed estimate against the previous one
        (:class:`flowerbed.parallel.tiles.speed.SpeedModel`), in (0, 1].
    """

    max_devices: int = DEFAULT_MAX_DEVICES
    front: int | None = None
    bounds: Sequence[int] | None = None
    bands: int | None = None
    norm: str = "sync"
    memory_budget_mb: float | None = None
    subnet_prefix: int = DEFAULT_SUBNET_PREFIX
    profile_size: int = 64
    speed_smoothing: float = DEFAULT_SMOOTHING

    def __post_init__(self) -> None:
        from flowerbed.parallel.tiles.region_ops import check_norm  # torch

        check_count("max_devices", self.max_devices)
        check_count("profile_size", self.profile_size)
        if self.memory_budget_mb is not None and not self.memory_budget_mb > 0:
            raise ValueError(
                f"memory_budget_mb must be > 0, got {self.memory_budget_mb}"
            )
        if not 0 <= self.subnet_prefix <= 32:
            raise ValueError(f"subnet_prefix must be 0..32, got {self.subnet_prefix}")
        try:
            check_norm(self.norm)
        except TileError as err:
            raise ValueError(str(err)) from None
        if not 0 < self.speed_smoothing <= 1:
            raise ValueError(
                f"speed_smoothing must be in (0, 1], got {self.speed_smoothing}"
            )
        if self.bounds is not None:
            object.__setattr__(self, "bounds", tuple(self.bounds))

    @property
    def memory_budget_bytes(self) -> float:
        """Bytes a board may use (infinite without ``memory_budget_mb``)."""
        return self.memory_budget_mb * 2**20 if self.memory_budget_mb else math.inf


@dataclass(frozen=True)
class TileLinks:
    """The links between a tiled job's boards.

    Parameters
    ----------
    link_mbps : float (default: 100)
        Each board's link speed (megabits/s), for the planner.
    latency_s : float (default: 0.001)
        Seconds per message, for the planner.
    emulate_link : bool (default: False)
        Members sleep to emulate ``link_mbps`` (local runs on one machine).
    """

    link_mbps: float = DEFAULT_LINK_MBPS
    latency_s: float = DEFAULT_LATENCY_S
    emulate_link: bool = False

    def __post_init__(self) -> None:
        if not (math.isfinite(self.link_mbps) and self.link_mbps > 0):
            raise ValueError(f"link_mbps must be > 0, got {self.link_mbps}")
        if not (math.isfinite(self.latency_s) and self.latency_s >= 0):
            raise ValueError(f"latency_s must be >= 0, got {self.latency_s}")

    @property
    def bytes_per_s(self) -> float:
        """The link speed in bytes per second."""
        return self.link_mbps * 1e6 / 8
