"""The boards of a tiled job: who they are, which ones a job takes, in what order.

A board answers the ``tiles`` profiling query with its training speed on the
model's first layers and its free memory; a job takes the largest group of
boards on one subnet (co-located: their links are the LAN's), fastest first, and
rank 0 is the board with the most memory, since it holds the weight-heavy head
(:class:`~flowerbed.strategies.TiledTraining`).
"""

from __future__ import annotations

import ipaddress
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from flowerbed import keys
from flowerbed.parallel.tiles.speed import SpeedModel

from .span import SegmentReply, SpanMember
from .tile_options import TilePlanning

MEMORY_HEADROOM = 0.8
"""Share of a board's reported free memory a plan may use (the rest: the
ClientApp process, torch's allocator slack, the OS)."""


def subnet_of(address: str, prefix: int) -> str:
    """The network an address belongs to (``/prefix`` for IPv4, ``/64`` for
    IPv6); a host name's domain (after its first dot) stands for its network."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return "dns:" + address.partition(".")[2]
    bits = prefix if ip.version == 4 else 64
    return str(ipaddress.ip_network(f"{address}/{bits}", strict=False))


def colocated(
    members: Iterable[SpanMember], prefix: int, speed: Callable[[SpanMember], float]
) -> list[SpanMember]:
    """The largest group of members on one subnet (ties: the faster group)."""
    groups: dict[str, list[SpanMember]] = {}
    for member in members:
        groups.setdefault(subnet_of(member.address, prefix), []).append(member)
    if not groups:
        return []
    return max(
        groups.values(),
        key=lambda g: (len(g), sum(speed(m) for m in g)),
    )


@dataclass
class Board:
    """A selected member with what the planner needs."""

    node_id: int
    address: str
    speed: float
    """Forward MACs per second of forward + backward (profiled, then measured)."""
    memory: float
    """Bytes this job may use on the board."""
    label: str = ""


def profiled_boards(
    members: Mapping[int, SpanMember],
    errors: dict[int, str],
    speed_models: dict[int, SpeedModel],
    planning: TilePlanning,
) -> dict[int, Board]:
    """The members whose profile has a positive speed, as boards (the others
    named in ``errors``); a board measured before keeps its speed model, a new
    one gets a model in ``speed_models``."""
    budget = planning.memory_budget_bytes
    boards: dict[int, Board] = {}
    for node_id, member in members.items():
        speed = member.metrics.get(keys.TILES_SPEED)
        free = member.metrics.get(keys.TILES_MEMORY_BYTES)
        if not isinstance(speed, int | float) or not speed > 0:
            errors[node_id] = f"profile reply has no positive {keys.TILES_SPEED}"
            continue
        memory = MEMORY_HEADROOM * float(free) if free else math.inf
        model = speed_models.get(node_id)
        if model is None:  # a board measured before keeps its measurements
            model = SpeedModel(float(speed), smoothing=planning.speed_smoothing)
            speed_models[node_id] = model
        boards[node_id] = Board(
            node_id, member.address, model.rate, min(memory, budget), member.label
        )
    return boards


def colocated_boards(
    boards: Mapping[int, Board],
    members: Mapping[int, SpanMember],
    planning: TilePlanning,
    fewest: int,
    fraction: float,
) -> list[Board]:
    """The fastest ``fraction`` (at least ``fewest``, at most ``max_devices``) of
    the largest group of ``boards`` on one subnet, fastest first."""
    group = colocated(
        (members[n] for n in boards), planning.subnet_prefix, lambda m: 1.0
    )
    chosen = sorted(
        (boards[m.node_id] for m in group), key=lambda b: (-b.speed, b.node_id)
    )
    count = max(fewest, int(fraction * len(chosen)))
    return chosen[: min(count, planning.max_devices)]


def rank_order(boards: Sequence[Board]) -> list[Board]:
    """Rank 0 holds the head: the most memory, then the fastest."""
    head = max(boards, key=lambda b: (b.memory, b.speed, -b.node_id))
    rest = sorted((b for b in boards if b is not head), key=lambda b: b.node_id)
    return [head, *rest]


def observe_speeds(
    replies: Mapping[int, SegmentReply],
    boards: Sequence[Board],
    speed_models: Mapping[int, SpeedModel],
) -> None:
    """Update each board's speed model with its segment's MACs and compute
    seconds per step, and the board's speed with the model's rate."""
    by_node = {b.node_id: b for b in boards}
    for node_id, reply in replies.items():
        macs = float(reply.metrics.get(keys.TILES_MACS, 0.0))
        seconds = float(reply.metrics.get(keys.TILES_COMPUTE_S, 0.0))
        model = speed_models.get(node_id)
        if macs > 0 and seconds > 0 and node_id in by_node and model is not None:
            model.observe(macs, seconds)
            by_node[node_id].speed = model.rate
