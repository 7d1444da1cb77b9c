"""Fleets: named mixes of device classes, assigned to nodes reproducibly."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
from flowerbed.sims.devices import DeviceProfile, get_device

FLEETS: dict[str, dict[str, float]] = {
    # Every node the same mid-range board: the control case.
    "uniform": {"rpi4b": 1.0},
    # Best device 10x the worst (Pixel 7 vs low-end phone, 3300 vs 330 Geekbench 5),
    # the heterogeneity FTPipeHD evaluates (MISSION.md, S3).
    "phones-10x": {"low-end-phone": 0.4, "galaxy-s10": 0.3, "pixel-7": 0.3},
    "boards": {"rpi3b": 0.25, "rpi4b": 0.35, "rpi5": 0.25, "jetson-nano": 0.15},
    # Two boards of the same radio, the faster ~1.8x the slower in compute.
    "boards-2x": {"rpi4b": 0.5, "rpi5": 0.5},
    # Pi 3B against Pi 5: ~4.6x in compute, ~3x in Wi-Fi throughput.
    "boards-4x": {"rpi3b": 0.5, "rpi5": 0.5},
    "mixed": {
        "low-end-phone": 0.25,
        "galaxy-s10": 0.15,
        "pixel-7": 0.15,
        "rpi3b": 0.10,
        "rpi4b": 0.15,
        "rpi5": 0.10,
        "jetson-nano": 0.10,
    },
}


def check_fleet_name(name: str) -> None:
    if name not in FLEETS:
        raise ValueError(f"unknown fleet {name!r}; valid choices: {', '.join(FLEETS)}")


def assign_devices(fleet: str, num_nodes: int, seed: int) -> list[DeviceProfile]:
    """Device of each node 0..num_nodes-1 for a named fleet.

    Counts follow the mix by largest remainder (so 10 nodes of ``phones-10x`` are
    exactly 4/3/3), then a seeded shuffle decides which node gets which device.
    """
    return [get_device(name) for name in _assignment(fleet, num_nodes, seed)]


def device_of(fleet: str, num_nodes: int, seed: int, node: int) -> DeviceProfile:
    """Device of node ``node`` (as :func:`assign_devices`; the draw is cached)."""
    return get_device(_assignment(fleet, num_nodes, seed)[node])


@functools.lru_cache(maxsize=8)
def _assignment(fleet: str, num_nodes: int, seed: int) -> tuple[str, ...]:
    check_fleet_name(fleet)
    if num_nodes < 1:
        raise ValueError(f"num-nodes must be >= 1, got {num_nodes}")
    mix = FLEETS[fleet]
    exact = {name: share * num_nodes for name, share in mix.items()}
    counts = {name: int(v) for name, v in exact.items()}
    by_remainder = sorted(
        mix, key=lambda n: (-(exact[n] - counts[n]), list(mix).index(n))
    )
    for name in by_remainder[: num_nodes - sum(counts.values())]:
        counts[name] += 1
    names = [name for name in mix for _ in range(counts[name])]
    order = np.random.default_rng(seed).permutation(num_nodes)
    return tuple(names[i] for i in order)


def speed_groups(devices: Sequence[DeviceProfile]) -> list[int]:
    """Group of each node for the ``device`` partition: 0 (slow) for devices slower
    than the fleet's median device, 1 (fast) for the rest."""
    if not devices:
        return []
    speeds = sorted(d.relative_speed for d in devices)
    median = speeds[len(speeds) // 2]
    return [0 if d.relative_speed < median else 1 for d in devices]
