"""The layout of a tile plan: the model's geometry, every rank's tiles and
regions, and the pieces that move at each group boundary (pure, no torch).

:class:`FrontGeometry` is the planner's view of a model (what
:func:`flowerbed.parallel.tiles.region_ops.front_geometry` reads from torch);
:func:`layout` turns a grouping and the tile weights into a :class:`Layout`,
which every member of a job derives from its plan, so all agree on who sends
which rectangle to whom (:mod:`flowerbed.parallel.tiles.exact_step`), and which the
cost model (:mod:`flowerbed.parallel.tiles.grouping`) prices.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from ..plan import PlanError
from .regions import (
    GroupTrace,
    Op,
    Rect,
    TileError,
    flatten,
    layer_shapes,
    map_shapes,
    tile_grid,
    trace_group,
)


@dataclass(frozen=True)
class FrontGeometry:
    """What the planner knows of a model (built by
    :func:`flowerbed.parallel.tiles.region_ops.front_geometry`).

    Attributes
    ----------
    in_shape : (int, int, int)
        ``(channels, height, width)`` of one sample.
    layers : tuple of tuple of Op
        The operations of the first top-level layers that can be tiled.
    num_layers : int
        Top-level layers of the whole model.
    layer_params : tuple of int
        Trainable parameters of every top-level layer.
    head_macs : tuple of int
        ``head_macs[F]``: forward MACs per sample of layers ``F..`` (``F`` from 0
        to ``len(layers)``).
    head_elements : tuple of int
        ``head_elements[F]``: activation elements per sample of layers ``F..``.
    stop : str
        Why tiling cannot go beyond ``len(layers)`` layers.
    """

    in_shape: tuple[int, int, int]
    layers: tuple[tuple[Op, ...], ...]
    num_layers: int
    layer_params: tuple[int, ...]
    head_macs: tuple[int, ...]
    head_elements: tuple[int, ...]
    stop: str = ""

    def __post_init__(self) -> None:
        if len(self.layer_params) != self.num_layers:
            raise ValueError("layer_params must list every top-level layer")
        if (
            len(self.head_macs) != len(self.layers) + 1
            or len(self.head_elements) != len(self.layers) + 1
        ):
            raise ValueError("head_macs/head_elements need one entry per front end")

    @property
    def tileable(self) -> int:
        return len(self.layers)

    def shapes(self) -> list[tuple[int, int, int]]:
        """Shape of the input of every tileable layer, then the last one's output."""
        return layer_shapes(self.layers, self.in_shape)

    def ops(self, first: int, stop: int) -> list[Op]:
        return flatten(self.layers[first:stop])

    def front_params(self, front: int) -> int:
        return sum(self.layer_params[:front])

    def head_params(self, front: int) -> int:
        return sum(self.layer_params[front:])

    def full_macs(self, first: int, stop: int) -> int:
        """Forward MACs per sample of layers ``first..stop-1`` on one device."""
        ops = self.ops(first, stop)
        shapes = map_shapes(ops, self.shapes()[first])
        return sum(
            out[1] * out[2] * op.macs_per_pixel
            for op, out in zip(ops, shapes[1:], strict=True)
        )

    def full_elements(self, first: int, stop: int) -> int:
        """Activation elements per sample of layers ``first..stop-1`` (input and
        every op's output), on one device."""
        ops = self.ops(first, stop)
        shapes = map_shapes(ops, self.shapes()[first])
        return sum(c * h * w for c, h, w in shapes)


def map_tiles(
    shape: tuple[int, int, int], weights: Sequence[float], bands: int
) -> list[Rect]:
    """The tile grid of a map of ``shape`` (``bands`` capped by the devices)."""
    return tile_grid(shape[1], shape[2], weights, min(bands, len(weights)))


def group_traces(
    geometry: FrontGeometry,
    first: int,
    stop: int,
    weights: Sequence[float],
    bands: int,
) -> list[GroupTrace]:
    """Every rank's trace of the group of layers ``first..stop-1``."""
    shapes = geometry.shapes()
    where = f"group of layers {first}..{stop - 1}"
    tiles = map_tiles(shapes[stop], weights, bands)
    ops = geometry.ops(first, stop)
    return [
        trace_group(ops, shapes[first], tile, where=f"{where}, rank {rank}")
        for rank, tile in enumerate(tiles)
    ]


def exchange_pieces(
    owners: Sequence[Rect], inputs: Sequence[Rect]
) -> dict[tuple[int, int], Rect]:
    """``(source, destination) -> rectangle`` of a map that ``source`` owns and
    ``destination`` needs (``source != destination``, non-empty only)."""
    pieces: dict[tuple[int, int], Rect] = {}
    for dst, region in enumerate(inputs):
        for src, owned in enumerate(owners):
            if src == dst:
                continue
            piece = region.intersect(owned)
            if not piece.empty:
                pieces[(src, dst)] = piece
    return pieces


def port_bytes(
    pieces: dict[tuple[int, int], Rect], ranks: int, bytes_per_pixel: float
) -> tuple[list[float], list[float]]:
    """Bytes each rank sends and receives for ``pieces``."""
    sent = [0.0] * ranks
    received = [0.0] * ranks
    for (src, dst), piece in pieces.items():
        sent[src] += piece.area * bytes_per_pixel
        received[dst] += piece.area * bytes_per_pixel
    return sent, received


def check_bounds(geometry: FrontGeometry, bounds: Sequence[int]) -> tuple[int, ...]:
    bounds = tuple(int(b) for b in bounds)
    if len(bounds) < 2 or bounds[0] != 0:
        raise PlanError(
            f"group boundaries {list(bounds)} must start at 0 and end at the front's "
            "last layer + 1"
        )
    if any(b <= a for a, b in itertools.pairwise(bounds)):
        raise PlanError(
            f"group boundaries {list(bounds)} must increase strictly (every group "
            "holds at least one layer)"
        )
    if bounds[-1] > geometry.tileable:
        raise TileError(
            f"group boundaries {list(bounds)} tile {bounds[-1]} layers but only the "
            f"first {geometry.tileable} can be tiled: {geometry.stop}"
        )
    return bounds


@dataclass(frozen=True)
class Layout:
    """Everything a member needs to run a plan, for every rank (pure data).

    ``traces[g][r]``: rank ``r``'s trace of group ``g``; ``tiles[g][r]``: its
    output tile of group ``g``; ``pieces[g]``: for ``g > 0``, the rectangles of
    group ``g - 1``'s output map that move from owner to user at the boundary
    (:func:`exchange_pieces`); ``shapes[g]``: the shape of group ``g``'s input.
    """

    bounds: tuple[int, ...]
    bands: int
    weights: tuple[float, ...]
    shapes: tuple[tuple[int, int, int], ...]
    traces: tuple[tuple[GroupTrace, ...], ...]
    tiles: tuple[tuple[Rect, ...], ...]
    pieces: tuple[dict[tuple[int, int], Rect], ...]

    @property
    def ranks(self) -> int:
        return len(self.weights)

    @property
    def front(self) -> int:
        return self.bounds[-1]

    @property
    def out_shape(self) -> tuple[int, int, int]:
        """Shape of the front's output map (what rank 0 gathers)."""
        return self.shapes[-1]

    def busiest_bytes(self, group: int, bytes_per_pixel: float) -> float:
        """Bytes the busiest port moves one way at group ``group``'s input."""
        if group == 0:
            return 0.0
        sent, received = port_bytes(self.pieces[group], self.ranks, bytes_per_pixel)
        return max(max(s, r) for s, r in zip(sent, received, strict=True))


def layout(
    geometry: FrontGeometry,
    bounds: Sequence[int],
    weights: Sequence[float],
    bands: int,
) -> Layout:
    """The :class:`Layout` of a grouping (TileError if a tile is too small)."""
    bounds = check_bounds(geometry, bounds)
    all_shapes = geometry.shapes()
    traces, tiles, pieces = [], [], []
    for g, (first, stop) in enumerate(itertools.pairwise(bounds)):
        group = group_traces(geometry, first, stop, weights, bands)
        traces.append(tuple(group))
        tiles.append(tuple(t.tile for t in group))
        pieces.append(
            exchange_pieces(tiles[g - 1], [t.input for t in group]) if g else {}
        )
    return Layout(
        bounds=bounds,
        bands=bands,
        weights=tuple(float(w) for w in weights),
        shapes=tuple(all_shapes[b] for b in bounds),
        traces=tuple(traces),
        tiles=tuple(tiles),
        pieces=tuple(pieces),
    )
