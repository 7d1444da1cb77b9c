"""Fused tile partitioning: which input region each output tile needs (pure).

A CNN's early layers are feature-map heavy: their activations, not their weights,
fill a small board's memory. Fused tile partitioning (Zhao, Barijough,
Gerstlauer, "DeepThings: Distributed Adaptive Deep Learning Inference on
Resource-Constrained IoT Edge Clusters", IEEE TCAD 37(11), 2018, Sec. III-A)
cuts the output map of a *group* of consecutive layers into tiles, one per
device, and traces back through the group the input region each tile needs, so
a device computes its tile from its region alone; the regions of neighbouring
tiles overlap (the *halo*), and the overlap is computed redundantly. Rama,
Threadgill, Gerstlauer ("Distributed Convolutional Neural Network Training on
Mobile and Edge Clusters", arXiv 2409.09083) apply the same partitioning to the
forward *and backward* passes of training;
:mod:`flowerbed.parallel.tiles.exact_step` runs it, this module only does the
geometry (no torch), so the planner, the strategy and the tests share it.

Geometry of one operation (rows and columns alike, half-open ranges)
-------------------------------------------------------------------
A window operation (convolution, pooling) with kernel ``k``, stride ``s``,
padding ``p`` and dilation ``d`` computes output ``o`` from inputs
``o*s - p .. o*s - p + d*(k-1)``, so an output range ``[o0, o1)`` needs::

    need(o0, o1) = [o0*s - p,  (o1 - 1)*s - p + d*(k - 1) + 1)

(DeepThings Sec. III-A gives the same bounds for ``p = (k-1)/2``, ``d = 1``: conv
``[o0*s - k/2, o1*s + k/2]``, pool ``[o0*s, o1*s + s - 1]``, inclusive.) Output
size: ``floor((n + 2p - d*(k-1) - 1) / s) + 1`` (torch.nn.Conv2d's docs). The
part of ``need`` outside ``[0, n)`` is padding: a device zero-pads (``-inf`` for
max pooling) only where its region reaches a *true* image border, and takes
real neighbouring pixels everywhere else. Point-wise operations (activations)
and normalisations need exactly their output range.

Owned pixels
------------
Normalisation statistics are sums over the *whole* map, so each pixel of every
intermediate map must be counted by exactly one device. The tiles of a group's
output are a partition; each boundary ``b`` of it maps back through an operation
to the centre of output ``b``'s window, ``clip(b*s - p + (d*(k-1))//2, 0, n_in)``
(``0 -> 0``, ``n_out -> n_in``), which carries the partition to every
intermediate map (a monotone map of the grid lines keeps a partition a
partition; a stride-1 "same" convolution keeps it unchanged). A device's held
region at each map is widened to cover its owned cell there (this matters only
where a stride exceeds its kernel's extent, or at the far border, where inputs
feed no output).

Tiles
-----
:func:`tile_grid` cuts a map into bands of rows and each band into columns, with
areas proportional to per-device weights (measured speeds: faster devices get
bigger tiles so all finish together). :func:`trace_group` raises
:class:`TileError` when a tile is empty or smaller than its halo (the group is
too deep for tiles that small: fewer devices or a shallower group).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ..plan import PlanError

WINDOW = "window"
"""Convolution or pooling: reads a window around each output position."""
POINTWISE = "pointwise"
"""Element-wise (activations): output position = input position."""
NORM = "norm"
"""Normalisation: point-wise geometry, statistics over the whole map."""
KINDS = (WINDOW, POINTWISE, NORM)

ZERO = "zero"
NEG_INF = "-inf"
PAD_VALUES = (ZERO, NEG_INF)


class TileError(PlanError):
    """A tile plan that cannot be carried out (empty tile, tile smaller than its
    halo, unsupported layer); the message says which and what to change."""


@dataclass(frozen=True)
class Rect:
    """Rows ``[top, bottom)`` and columns ``[left, right)`` of a map."""

    top: int
    bottom: int
    left: int
    right: int

    @property
    def height(self) -> int:
        return max(0, self.bottom - self.top)

    @property
    def width(self) -> int:
        return max(0, self.right - self.left)

    @property
    def area(self) -> int:
        return self.height * self.width

    @property
    def empty(self) -> bool:
        return self.area == 0

    def intersect(self, other: Rect) -> Rect:
        return Rect(
            max(self.top, other.top),
            min(self.bottom, other.bottom),
            max(self.left, other.left),
            min(self.right, other.right),
        )

    def hull(self, other: Rect) -> Rect:
        """The smallest rectangle holding both (an empty one adds nothing)."""
        if other.empty:
            return self
        if self.empty:
            return other
        return Rect(
            min(self.top, other.top),
            max(self.bottom, other.bottom),
            min(self.left, other.left),
            max(self.right, other.right),
        )

    def clip(self, height: int, width: int) -> Rect:
        return self.intersect(Rect(0, height, 0, width))

    def contains(self, other: Rect) -> bool:
        return other.empty or (
            self.top <= other.top
            and other.bottom <= self.bottom
            and self.left <= other.left
            and other.right <= self.right
        )

    def relative_to(self, outer: Rect) -> Rect:
        """This rectangle in the coordinates of ``outer``'s top-left corner."""
        return Rect(
            self.top - outer.top,
            self.bottom - outer.top,
            self.left - outer.left,
            self.right - outer.left,
        )

    def as_tuple(self) -> tuple[int, int, int, int]:
        return (self.top, self.bottom, self.left, self.right)

    def __str__(self) -> str:
        return f"rows {self.top}..{self.bottom - 1}, cols {self.left}..{self.right - 1}"


Pair = tuple[int, int]


@dataclass(frozen=True)
class Op:
    """The geometry and cost of one operation of a layer.

    Attributes
    ----------
    name : str
        Where it is in the model, e.g. ``"3.0 (Conv2d)"`` (for messages).
    kind : str
        One of :data:`KINDS`.
    kernel, stride, padding, dilation : (int, int)
        Window geometry (rows, columns); ``(1, 1)``/``(0, 0)`` for point-wise.
    out_channels : int
        Channels of the output (0: as many as the input).
    macs_per_pixel : int
        Multiply-accumulates per output position per sample (all channels), as
        :func:`flowerbed.models.count_macs` counts them (conv: ``C_out x C_in /
        groups x kh x kw``; everything else 0).
    pad_value : str
        What a window reads beyond a true border: ``"zero"`` or ``"-inf"`` (max
        pooling).
    params : int
        Trainable parameters (for the all-reduce and memory).
    stats : int
        Normalisation only: statistics (each a mean and a variance) per batch
        (batch norm: channels) or, with ``stats_per_sample``, per sample (group
        norm: groups).
    stats_per_sample : bool
        Whether ``stats`` counts per sample.
    """

    name: str
    kind: str
    kernel: Pair = (1, 1)
    stride: Pair = (1, 1)
    padding: Pair = (0, 0)
    dilation: Pair = (1, 1)
    out_channels: int = 0
    macs_per_pixel: int = 0
    pad_value: str = ZERO
    params: int = 0
    stats: int = 0
    stats_per_sample: bool = False

    def statistics(self, batch_size: int) -> int:
        """Statistics this op reduces across devices for a batch."""
        return self.stats * (batch_size if self.stats_per_sample else 1)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"op kind {self.kind!r}; valid: {', '.join(KINDS)}")
        if self.pad_value not in PAD_VALUES:
            raise ValueError(f"pad value {self.pad_value!r}; valid: {PAD_VALUES}")
        for axis in (0, 1):
            if min(self.kernel[axis], self.stride[axis], self.dilation[axis]) < 1:
                raise ValueError(f"{self.name}: kernel, stride, dilation must be >= 1")
            if self.padding[axis] < 0:
                raise ValueError(f"{self.name}: padding must be >= 0")

    def extent(self, axis: int) -> int:
        """Input positions one output position spans: ``d*(k-1) + 1``."""
        return self.dilation[axis] * (self.kernel[axis] - 1) + 1

    def out_size(self, height: int, width: int) -> tuple[int, int]:
        """Output map size for an input of ``height x width``."""
        if self.kind != WINDOW:
            return height, width
        out = []
        for axis, n in enumerate((height, width)):
            size = (n + 2 * self.padding[axis] - self.extent(axis)) // self.stride[
                axis
            ] + 1
            if size < 1:
                raise TileError(
                    f"{self.name}: a {height}x{width} input is too small for its "
                    f"window (kernel {self.kernel}, padding {self.padding})"
                )
            out.append(size)
        return out[0], out[1]

    def channels(self, in_channels: int) -> int:
        return self.out_channels or in_channels

    def _need(self, axis: int, first: int, stop: int) -> Pair:
        if stop <= first:
            return first, first
        s, p = self.stride[axis], self.padding[axis]
        return first * s - p, (stop - 1) * s - p + self.extent(axis)

    def need(self, out: Rect) -> Rect:
        """Input rectangle (unclipped: padding included) ``out`` depends on."""
        if self.kind != WINDOW:
            return out
        top, bottom = self._need(0, out.top, out.bottom)
        left, right = self._need(1, out.left, out.right)
        return Rect(top, bottom, left, right)

    def _bound(self, axis: int, b: int, n_out: int, n_in: int) -> int:
        if b <= 0:
            return 0
        if b >= n_out:
            return n_in
        centre = (
            b * self.stride[axis] - self.padding[axis] + (self.extent(axis) - 1) // 2
        )
        return min(max(centre, 0), n_in)

    def owned_in(
        self, owned_out: Rect, in_hw: tuple[int, int], out_hw: tuple[int, int]
    ) -> Rect:
        """The owned cell of the input map that corresponds to ``owned_out``."""
        if self.kind != WINDOW:
            return owned_out
        return Rect(
            self._bound(0, owned_out.top, out_hw[0], in_hw[0]),
            self._bound(0, owned_out.bottom, out_hw[0], in_hw[0]),
            self._bound(1, owned_out.left, out_hw[1], in_hw[1]),
            self._bound(1, owned_out.right, out_hw[1], in_hw[1]),
        )


Layer = Sequence[Op]
"""One top-level layer of the model: its operations in order."""


def flatten(layers: Sequence[Layer]) -> list[Op]:
    return [op for layer in layers for op in layer]


def map_shapes(
    ops: Sequence[Op], in_shape: tuple[int, int, int]
) -> list[tuple[int, int, int]]:
    """``(channels, height, width)`` of the input of every op, then the output."""
    shapes = [tuple(in_shape)]
    c, h, w = in_shape
    for op in ops:
        h, w = op.out_size(h, w)
        c = op.channels(c)
        shapes.append((c, h, w))
    return shapes  # type: ignore[return-value]


def layer_shapes(
    layers: Sequence[Layer], in_shape: tuple[int, int, int]
) -> list[tuple[int, int, int]]:
    """Shape of the input of every top-level layer, then the last one's output."""
    shapes = [tuple(in_shape)]
    current = tuple(in_shape)
    for layer in layers:
        current = tuple(map_shapes(layer, current)[-1])  # type: ignore[arg-type]
        shapes.append(current)
    return shapes  # type: ignore[return-value]


@dataclass(frozen=True)
class OpRegion:
    """What one device computes for one op of a group.

    ``held`` is the (clipped) region of the op's input map the device holds,
    ``need`` the (unclipped) rectangle the op reads (``need`` minus the map is
    border padding), ``out`` the region of the output map it computes and
    ``owned`` its owned cell of the output map (normalisation statistics).
    """

    op: Op
    in_shape: tuple[int, int, int]
    out_shape: tuple[int, int, int]
    need: Rect
    held: Rect
    out: Rect
    owned: Rect

    @property
    def macs(self) -> int:
        """Multiply-accumulates per sample."""
        return self.out.area * self.op.macs_per_pixel

    @property
    def padding(self) -> tuple[int, int, int, int]:
        """Border padding (top, bottom, left, right) this device adds."""
        h, w = self.in_shape[1], self.in_shape[2]
        return (
            max(0, -self.need.top),
            max(0, self.need.bottom - h),
            max(0, -self.need.left),
            max(0, self.need.right - w),
        )


@dataclass(frozen=True)
class GroupTrace:
    """One device's part of one fused group: its tile and every op's regions."""

    tile: Rect
    input: Rect
    """Region of the group's input map the device needs (clipped)."""
    owned_input: Rect
    """The device's owned cell of the group's input map."""
    ops: tuple[OpRegion, ...]

    @property
    def macs(self) -> int:
        """Multiply-accumulates per sample (halo included)."""
        return sum(r.macs for r in self.ops)

    @property
    def halo(self) -> tuple[int, int, int, int]:
        """Input pixels beyond the owned cell (top, bottom, left, right)."""
        return (
            self.owned_input.top - self.input.top,
            self.input.bottom - self.owned_input.bottom,
            self.owned_input.left - self.input.left,
            self.input.right - self.owned_input.right,
        )

    def activation_elements(self) -> int:
        """Elements per sample the group keeps for backward: its input region and
        every op's output region (upper bound: some ops keep less)."""
        first = self.ops[0]
        return first.held.area * first.in_shape[0] + sum(
            r.out.area * r.out_shape[0] for r in self.ops
        )


def trace_group(
    ops: Sequence[Op],
    in_shape: tuple[int, int, int],
    tile: Rect,
    *,
    where: str = "group",
) -> GroupTrace:
    """The regions ``tile`` (of the group's output map) needs, op by op.

    Raises :class:`TileError` if the tile is empty or outside the map, or is
    smaller than its halo at the group's input.
    """
    if not ops:
        raise TileError(f"{where} has no operations")
    shapes = map_shapes(ops, in_shape)
    _, out_h, out_w = shapes[-1]
    if tile.empty:
        raise TileError(
            f"{where}: a tile is empty ({out_h}x{out_w} output map split among too "
            "many devices): use fewer devices or stop tiling before this group"
        )
    if not Rect(0, out_h, 0, out_w).contains(tile):
        raise TileError(f"{where}: tile {tile} is outside the {out_h}x{out_w} map")
    out, owned = tile, tile
    regions: list[OpRegion] = []
    for index in range(len(ops) - 1, -1, -1):
        op = ops[index]
        in_s, out_s = shapes[index], shapes[index + 1]
        need = op.need(out)
        owned_in = op.owned_in(owned, in_s[1:], out_s[1:])
        held = need.clip(in_s[1], in_s[2]).hull(owned_in)
        regions.append(OpRegion(op, in_s, out_s, need, held, out, owned))
        out, owned = held, owned_in
    trace = GroupTrace(tile, out, owned, tuple(reversed(regions)))
    top, bottom, left, right = trace.halo
    if trace.owned_input.height < max(top, bottom) or trace.owned_input.width < max(
        left, right
    ):
        raise TileError(
            f"{where}: the tile at {tile} owns {trace.owned_input.height}x"
            f"{trace.owned_input.width} input pixels but needs a halo of "
            f"{max(top, bottom)} rows / {max(left, right)} columns: the tile is "
            "smaller than its halo; use fewer devices or a shallower group"
        )
    return trace


# --------------------------------------------------------------------------------
# Tiles sized to device speed
# --------------------------------------------------------------------------------


def apportion(total: int, weights: Sequence[float], *, what: str = "map") -> list[int]:
    """Split ``total`` pixels into integer shares proportional to ``weights``.

    Hamilton's largest-remainder method: every share gets the floor of its quota
    ``total * w / sum(w)``, the pixels left over go to the largest remainders
    (ties to the lower index). Raises :class:`TileError` if a share is empty.
    """
    if not weights:
        raise TileError("no devices to split the map among")
    for weight in weights:
        if not (math.isfinite(weight) and weight > 0):
            raise TileError(f"device weights must be finite and > 0, got {weight}")
    whole = float(sum(weights))
    quotas = [total * w / whole for w in weights]
    shares = [math.floor(q) for q in quotas]
    left = total - sum(shares)
    order = sorted(range(len(weights)), key=lambda i: (-(quotas[i] - shares[i]), i))
    for i in order[:left]:
        shares[i] += 1
    if min(shares) < 1:
        raise TileError(
            f"a {total}-pixel {what} cannot give every one of {len(weights)} devices "
            f"a share in proportion to {list(weights)}: use fewer devices or stop "
            "tiling before this map"
        )
    return shares


def auto_bands(height: int, width: int, devices: int) -> int:
    """Bands of rows that minimise the tiles' total perimeter (the halo's size).

    ``b`` bands of ``D/b`` equal tiles: perimeters sum to ``2 (D*H/b + b*W)``,
    least at ``b = sqrt(D*H/W)``; the best integer in ``1..D`` (ties: fewer).
    """
    return min(
        range(1, devices + 1), key=lambda b: (devices * height / b + b * width, b)
    )


def band_sizes(devices: int, bands: int) -> list[int]:
    """Devices per band, as even as possible (earlier bands take the extra)."""
    if not 1 <= bands <= devices:
        raise TileError(
            f"bands must be 1..{devices} for {devices} devices, got {bands}"
        )
    return [devices // bands + (1 if i < devices % bands else 0) for i in range(bands)]


def tile_grid(
    height: int, width: int, weights: Sequence[float], bands: int | None = None
) -> list[Rect]:
    """Tiles of a ``height x width`` map, one per device, areas ~ ``weights``.

    Devices fill ``bands`` bands of rows in rank order; a band's height is in
    proportion to its devices' summed weight, a tile's width within its band in
    proportion to its device's weight, so ``area_r / area = w_r / sum(w)`` up to
    rounding to whole pixels (:func:`apportion`).
    """
    count = len(weights)
    if count < 1:
        raise TileError("no devices to split the map among")
    b = auto_bands(height, width, count) if bands is None else bands
    sizes = band_sizes(count, b)
    starts = [sum(sizes[:k]) for k in range(b)]
    band_weights = [sum(weights[s : s + n]) for s, n in zip(starts, sizes, strict=True)]
    heights = apportion(height, band_weights, what=f"{height}-row map")
    tiles: list[Rect] = []
    top = 0
    for start, size, rows in zip(starts, sizes, heights, strict=True):
        widths = apportion(width, weights[start : start + size], what="band")
        left = 0
        for cols in widths:
            tiles.append(Rect(top, top + rows, left, left + cols))
            left += cols
        top += rows
    return tiles
