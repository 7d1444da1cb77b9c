"""What one tiled segment sends: its plan, the members' tile options and weights.

The tile plan (:func:`flowerbed.parallel.tiles.grouping.plan_tiles`) says which
layers are tiled, in which groups and bands, with each board's share of the map;
every member gets it as the ``tiles`` options of its
:class:`~flowerbed.parallel.plan.MemberPlan`. Rank 0 runs the whole model, so it
gets every array and its optimiser state; the others only the tiled front's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from flowerbed.parallel.plan import MemberPlan
from flowerbed.parallel.tiles.grouping import Cluster, TilePlan
from flowerbed.parallel.tiles.layout import layout

from .tile_boards import Board
from .tile_options import TileLinks

Arrays = dict[str, np.ndarray]


@dataclass
class SegmentPlan:
    """What one segment sends: the plan, its boards in rank order, the layout."""

    tile_plan: TilePlan
    boards: list[Board]
    plans: dict[int, MemberPlan] = field(default_factory=dict)


def cluster_of(boards: Sequence[Board], links: TileLinks, bands: int | None) -> Cluster:
    """The planner's view of ``boards`` (in rank order) and their links."""
    return Cluster(
        speeds=tuple(b.speed for b in boards),
        memory=tuple(b.memory for b in boards),
        link_bytes_per_s=links.bytes_per_s,
        latency_s=links.latency_s,
        bands=bands,
    )


def tile_areas(geometry: Any, tile_plan: TilePlan) -> list[int]:
    """Pixels of each rank's tile of the first tiled group's output (the
    largest map), in rank order."""
    tp = tile_plan
    lay = layout(geometry, tp.bounds, tp.weights, tp.bands)
    return [int(tile.area) for tile in lay.tiles[0]]


def tile_options(
    tile_plan: TilePlan,
    input_shape: tuple[int, int, int],
    num_classes: int,
    norm: str,
    links: TileLinks,
) -> dict[str, Any]:
    """The ``tiles`` options every member of the segment gets with its plan."""
    from flowerbed.parallel.tiles.exact_step import TileSettings  # torch

    return TileSettings(
        input_shape=input_shape,
        bounds=tile_plan.bounds,
        weights=tile_plan.weights,
        bands=tile_plan.bands,
        norm=norm,
        emulate_link=links.emulate_link,
        link_bytes_per_s=links.bytes_per_s,
        latency_s=links.latency_s,
        num_classes=num_classes,
    ).options()


def segment_payloads(
    state: Arrays,
    optimizer: Mapping[str, np.ndarray],
    plans: Mapping[int, MemberPlan],
    front: int,
) -> tuple[dict[int, Arrays], dict[int, Arrays]]:
    """Each member's weights and optimiser state: rank 0's every array, the
    others' the first ``front`` top-level layers' (names ``"<layer>.<...>"``)."""
    front_names = [n for n in state if int(n.split(".", 1)[0]) < front]
    payload: dict[int, Arrays] = {}
    momentum: dict[int, Arrays] = {}
    for node_id, plan in plans.items():
        names = list(state) if plan.rank == 0 else front_names
        payload[node_id] = {n: state[n] for n in names}
        momentum[node_id] = {n: optimizer[n] for n in names if n in optimizer}
    return payload, momentum
