"""One member of a fused-tile job: its plan settings and its exact tiled step.

The plan (mode ``tiles``) names a model, the number of tiled layers and their
grouping, and every rank's tile weight; every member derives the same
:class:`~flowerbed.parallel.tiles.layout.Layout` from it. One training step, on
rank ``r`` (Rama, Threadgill, Gerstlauer, arXiv 2409.09083; docs/tiles.md):

1. **forward, group by group**: take the input region of group 0 from the batch
   (every member reads the same batch: ``batch_indices(seed, step)``); run the
   group's ops on the region with autograd
   (:func:`~flowerbed.parallel.tiles.region_ops.run_group`): the result is
   exactly rank ``r``'s output tile. At a boundary, every rank sends each
   other rank the part of its tile that rank's next input region needs (the
   halo), receives the parts it needs, and starts the next group from a fresh
   leaf tensor;
2. **head**: every rank sends its last tile to rank 0, which assembles the map,
   runs the rest of the model and the loss (cross-entropy, mean over the batch)
   and back-propagates to the map; it sends every rank the gradient of its tile;
3. **backward, group by group in reverse**: back-propagate the tile's gradient
   through the group; the gradient of the group's input region is cut into the
   pieces other ranks own and sent to them; each owner adds what it receives to
   its own piece: the gradient of its previous tile (halo gradients are partial
   sums of the same pixels' gradients, so the scatter-add is exact);
4. **weights**: one all-reduce (sum) of the front's weight gradients; every rank
   steps the same SGD, so the front's weights stay identical; rank 0 also steps
   the head.

Forward tiles equal the full map's pixels and the summed gradients equal
single-device gradients, up to float rounding (tests/test_tiles_exact.py).

Why the head runs on one device (rank 0) and not data-parallel. The later
layers are weight-heavy and their maps small: YOLOv2-tiny's 3x3 512->1024 conv
holds 4.7 M parameters (19 MB of gradients, ~2.5 s of ring all-reduce per step
for 6 boards on 100 Mb/s) while its 13x13x512 input is 0.35 MB per sample.
Gathering the map on one board and keeping the head's gradients there moves
orders of magnitude fewer bytes, and only one board holds the head's weights and
momentum (memory is what forces tiling). The strategy makes the board with the
most memory rank 0 (then the fastest). The planner
(:mod:`~flowerbed.parallel.tiles.grouping`) decides how many layers to tile,
so a conv layer whose compute outweighs the all-reduce of its weights is tiled
rather than left to rank 0.

Emulation on one machine: a member with an emulated speed
(:class:`~flowerbed.parallel.emulation.DeviceSpeed`) sleeps after each group's
forward/backward up to ``2 / 4 x MACs / rate`` (the group's MACs on its region,
halo included); with ``tiles-emulate-link`` every exchange phase also lasts the
busiest port's bytes over the link's speed plus its latency (the planner's
model, :class:`~flowerbed.parallel.tiles.grouping.Cluster`), so local runs show
the communication a 100 Mb/s network would cost.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from flowerbed.models import count_macs
from torch import nn

from ..emulation import DeviceSpeed
from ..plan import MemberPlan, PlanError
from .grouping import Cluster
from .layout import Layout
from .region_ops import (
    NORM_SYNC,
    RegionOp,
    check_norm,
    layer_ops,
    run_group,
)
from .regions import Rect, TileError

INPUT_SHAPE = "input-shape"
"""Option: shape of one sample, ``[channels, height, width]``."""
BOUNDS = "tiles-bounds"
"""Option: group boundaries over top-level layers, ``[0, ..., front]``."""
WEIGHTS = "tiles-weights"
"""Option: every rank's tile weight (its measured speed), rank order."""
BANDS = "tiles-bands"
"""Option: bands of rows of the tile grid."""
NORM = "tiles-norm"
"""Option: ``sync`` or ``frozen`` (batch norm in the front; see region_ops)."""
EMULATE_LINK = "tiles-emulate-link"
"""Option: emulate the link's speed on one machine (bool)."""
LINK_BYTES_PER_S = "tiles-link-bytes-per-s"
LATENCY_S = "tiles-latency-s"
NUM_CLASSES = "num-classes"
"""Option: classes of the synthetic dataset."""

# --------------------------------------------------------------------------------
# Reading the plan
# --------------------------------------------------------------------------------


@dataclass(frozen=True)
class TileSettings:
    """The ``tiles`` options of a plan, checked."""

    input_shape: tuple[int, int, int]
    bounds: tuple[int, ...]
    weights: tuple[float, ...]
    bands: int
    norm: str = NORM_SYNC
    emulate_link: bool = False
    link_bytes_per_s: float = 12.5e6
    latency_s: float = 1e-3
    num_classes: int = 10

    def options(self) -> dict[str, Any]:
        return {
            INPUT_SHAPE: list(self.input_shape),
            BOUNDS: list(self.bounds),
            WEIGHTS: list(self.weights),
            BANDS: self.bands,
            NORM: self.norm,
            EMULATE_LINK: self.emulate_link,
            LINK_BYTES_PER_S: self.link_bytes_per_s,
            LATENCY_S: self.latency_s,
            NUM_CLASSES: self.num_classes,
        }

    def cluster(self) -> Cluster:
        """The link model of the plan (speeds are the tile weights)."""
        return Cluster(
            speeds=self.weights,
            link_bytes_per_s=self.link_bytes_per_s,
            latency_s=self.latency_s,
            bands=self.bands,
        )


def _ints(value: object, name: str) -> tuple[int, ...]:
    if not isinstance(value, list | tuple) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        raise PlanError(f"option {name!r} must be a list of integers, got {value!r}")
    return tuple(value)


def settings_of(plan: MemberPlan) -> TileSettings:
    """The plan's tile settings; :class:`PlanError` naming a bad option."""
    o = plan.options
    shape = _ints(o.get(INPUT_SHAPE), INPUT_SHAPE)
    if len(shape) != 3 or min(shape) < 1:
        raise PlanError(f"option {INPUT_SHAPE!r} must be [channels, h, w] > 0")
    bounds = _ints(o.get(BOUNDS), BOUNDS)
    weights = o.get(WEIGHTS)
    if (
        not isinstance(weights, list | tuple)
        or len(weights) != plan.world_size
        or not all(
            isinstance(w, int | float)
            and not isinstance(w, bool)
            and math.isfinite(w)
            and w > 0
            for w in weights
        )
    ):
        raise PlanError(
            f"option {WEIGHTS!r} must list {plan.world_size} positive numbers, got "
            f"{weights!r}"
        )
    bands = o.get(BANDS)
    if not isinstance(bands, int) or isinstance(bands, bool) or bands < 1:
        raise PlanError(f"option {BANDS!r} must be an integer >= 1, got {bands!r}")
    norm = o.get(NORM, NORM_SYNC)
    if not isinstance(norm, str):
        raise PlanError(f"option {NORM!r} must be a string")
    try:
        check_norm(norm)
    except TileError as err:
        raise PlanError(str(err)) from None
    link = o.get(LINK_BYTES_PER_S, 12.5e6)
    latency = o.get(LATENCY_S, 1e-3)
    classes = o.get(NUM_CLASSES, 10)
    if not isinstance(link, int | float) or not link > 0 or not math.isfinite(link):
        raise PlanError(f"option {LINK_BYTES_PER_S!r} must be > 0, got {link!r}")
    if not isinstance(latency, int | float) or not 0 <= latency < math.inf:
        raise PlanError(f"option {LATENCY_S!r} must be >= 0, got {latency!r}")
    if not isinstance(classes, int) or classes < 1:
        raise PlanError(f"option {NUM_CLASSES!r} must be an integer >= 1")
    return TileSettings(
        input_shape=(shape[0], shape[1], shape[2]),
        bounds=bounds,
        weights=tuple(float(w) for w in weights),
        bands=bands,
        norm=norm,
        emulate_link=bool(o.get(EMULATE_LINK, False)),
        link_bytes_per_s=float(link),
        latency_s=float(latency),
        num_classes=classes,
    )


# --------------------------------------------------------------------------------
# Moving pieces between ranks
# --------------------------------------------------------------------------------


def swap(
    sends: Sequence[tuple[int, torch.Tensor]],
    receives: Sequence[tuple[int, tuple[int, ...]]],
) -> list[torch.Tensor]:
    """Send each ``(peer, tensor)`` and receive each ``(peer, shape)`` at once.

    Every receive and send is posted before any is waited on, so no order of
    arrival deadlocks; a pair of ranks exchanges at most one tensor each way per
    call. Returns the received tensors in the order of ``receives``.
    """
    import torch.distributed as dist

    buffers = [torch.empty(shape) for _, shape in receives]
    works = [
        dist.irecv(buf, peer) for buf, (peer, _) in zip(buffers, receives, strict=True)
    ]
    works += [dist.isend(t.contiguous(), peer) for peer, t in sends]
    for work in works:
        if work is not None:
            work.wait()
    return buffers


def _cut(tensor: torch.Tensor, piece: Rect, origin: Rect) -> torch.Tensor:
    rel = piece.relative_to(origin)
    return tensor[:, :, rel.top : rel.bottom, rel.left : rel.right]


# --------------------------------------------------------------------------------
# One member's tiled training
# --------------------------------------------------------------------------------


@dataclass
class Forward:
    """One forward pass through the front on one rank (:meth:`TiledMember.forward`)."""

    inputs: list[torch.Tensor] = field(default_factory=list)
    outputs: list[torch.Tensor] = field(default_factory=list)
    compute_s: float = 0.0
    link_s: float = 0.0
    sent_bytes: float = 0.0


@dataclass
class StepStats:
    """What one member measured over a segment (per step lists)."""

    step_s: list[float] = field(default_factory=list)
    compute_s: list[float] = field(default_factory=list)
    link_s: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    link_bytes: list[float] = field(default_factory=list)
    activation_bytes: int = 0
    overrun_s: float = 0.0


class TiledMember:
    """Rank ``rank``'s part of a tile job (module docstring).

    ``model`` is the whole model; this rank keeps its front (and rank 0 the
    head, where ``loss_fn`` turns the logits into the loss: the job's loss,
    cross-entropy by default). ``collectives`` may be False for a one-rank job
    without a group.
    """

    def __init__(
        self,
        model: nn.Sequential,
        plan_layout: Layout,
        rank: int,
        settings: TileSettings,
        *,
        speed: DeviceSpeed | None = None,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.cross_entropy,
    ) -> None:
        self.layout = plan_layout
        self.loss_fn = loss_fn
        self.rank = rank
        self.settings = settings
        self.speed = speed
        self.cluster = settings.cluster()
        front = plan_layout.front
        self.front = nn.Sequential(*list(model)[:front])
        self.head = nn.Sequential(*list(model)[front:]) if rank == 0 else None
        self.ops: list[list[RegionOp]] = []
        channels = settings.input_shape[0]
        for first, stop in zip(
            plan_layout.bounds[:-1], plan_layout.bounds[1:], strict=True
        ):
            group: list[RegionOp] = []
            for index in range(first, stop):
                for op, module in layer_ops(
                    index, model[index], channels, settings.norm
                ):
                    channels = op.channels(channels)
                    group.append(RegionOp(module, settings.norm))
            self.ops.append(group)
        self.front.train()
        if self.head is not None:
            self.head.train()
        self.stats = StepStats()
        self._head_macs: int | None = None
        self._param_storages: set[int] = set()

    # --- the modules this member trains -----------------------------------------
    def modules(self) -> nn.Module:
        """The layers this member holds, keeping their full-model names."""
        from collections import OrderedDict

        layers: OrderedDict[str, nn.Module] = OrderedDict(
            (str(i), layer) for i, layer in enumerate(self.front)
        )
        if self.head is not None:
            for i, layer in enumerate(self.head):
                layers[str(self.layout.front + i)] = layer
        return nn.Sequential(layers)

    # --- emulation and measurement ----------------------------------------------
    def _compute(self, seconds: float, macs: float, step: int, backward: bool) -> float:
        """Pad ``seconds`` of real compute up to the emulated device's time."""
        if self.speed is None:
            return seconds
        target = (
            self.speed.backward_s(macs, step)
            if backward
            else self.speed.forward_s(macs, step)
        )
        if target > seconds:
            time.sleep(target - seconds)
            return target
        self.stats.overrun_s += seconds - target
        return seconds

    def _link(self, busiest_bytes: float, ring: bool = False) -> None:
        if not self.settings.emulate_link or self.layout.ranks == 1:
            return
        model = (
            self.cluster.ring_s(busiest_bytes)
            if ring
            else self.cluster.transfer_s(busiest_bytes)
        )
        if model > 0:
            time.sleep(model)

    def _reduce(self, tensor: torch.Tensor) -> None:
        import torch.distributed as dist

        if self.layout.ranks > 1:
            dist.all_reduce(tensor)
            self._link(tensor.numel() * tensor.element_size(), ring=True)

    # --- one step -----------------------------------------------------------------
    def forward(self, x: torch.Tensor, step: int = 0) -> Forward:
        """The front's forward on this rank, group by group: returns every
        group's input region (a leaf, except the first) and output tile, with
        autograd's graph kept for :meth:`step`'s backward."""
        n = x.shape[0]
        lay, r = self.layout, self.rank
        fwd = Forward()
        region = lay.traces[0][r].input
        current = _cut(x, region, Rect(0, x.shape[2], 0, x.shape[3])).contiguous()
        for g, ops in enumerate(self.ops):
            trace = lay.traces[g][r]
            if g > 0:
                t0 = time.perf_counter()
                current, moved = self._halo(
                    g, fwd.outputs[-1].detach(), n, forward=True
                )
                fwd.sent_bytes += moved
                fwd.link_s += time.perf_counter() - t0
                current.requires_grad_(True)
            fwd.inputs.append(current)
            t0 = time.perf_counter()
            out = run_group(ops, trace.ops, current, self._reduce)
            fwd.compute_s += self._compute(
                time.perf_counter() - t0, n * trace.macs, step, backward=False
            )
            fwd.outputs.append(out)
        return fwd

    def step(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        optimizer: torch.optim.Optimizer,
        step: int,
    ) -> float | None:
        """One training step on the batch ``(x, y)``; returns the loss on rank 0."""
        n = x.shape[0]
        begin = time.perf_counter()
        saved: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key not in self._param_storages:
                saved[key] = storage.nbytes()
            return t

        optimizer.zero_grad()
        if not self._param_storages:
            self._param_storages = {
                p.untyped_storage().data_ptr() for p in self.modules().parameters()
            }
        lay, r = self.layout, self.rank
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fwd = self.forward(x, step)
            t0 = time.perf_counter()
            loss, grad, moved, head_s = self._head(fwd.outputs[-1], y, step)
            fwd.link_s += time.perf_counter() - t0 - head_s
            fwd.compute_s += head_s
            fwd.sent_bytes += moved
        self.stats.activation_bytes = max(
            self.stats.activation_bytes, sum(saved.values())
        )
        for g in range(len(self.ops) - 1, -1, -1):
            t0 = time.perf_counter()
            torch.autograd.backward(fwd.outputs[g], grad)
            fwd.compute_s += self._compute(
                time.perf_counter() - t0,
                n * lay.traces[g][r].macs,
                step,
                backward=True,
            )
            if g > 0:
                t0 = time.perf_counter()
                region_grad = fwd.inputs[g].grad
                assert region_grad is not None
                grad, moved = self._halo(g, region_grad, n, forward=False)
                fwd.sent_bytes += moved
                fwd.link_s += time.perf_counter() - t0
        t0 = time.perf_counter()
        self._allreduce_front()
        fwd.link_s += time.perf_counter() - t0
        optimizer.step()
        self.stats.step_s.append(time.perf_counter() - begin)
        self.stats.compute_s.append(fwd.compute_s)
        self.stats.link_s.append(fwd.link_s)
        self.stats.link_bytes.append(fwd.sent_bytes)
        if loss is not None:
            self.stats.losses.append(loss)
        return loss

    def step_macs(self, batch_size: int) -> float:
        """Forward MACs this rank computes per step: its tiles (halo included)
        and, on rank 0, the head."""
        tiles = sum(t[self.rank].macs for t in self.layout.traces)
        head = self._head_macs or 0
        return float(batch_size * (tiles + head))

    def _boundary(
        self, g: int
    ) -> tuple[Rect, Rect, int, list[tuple[int, Rect]], list[tuple[int, Rect]]]:
        """At group ``g``'s input: this rank's previous tile, its input region,
        the channels, the pieces of its tile others use (peer, piece) and the
        pieces of its region others own (peer, piece)."""
        lay, r = self.layout, self.rank
        lent = [(dst, p) for (src, dst), p in lay.pieces[g].items() if src == r]
        borrowed = [(src, p) for (src, dst), p in lay.pieces[g].items() if dst == r]
        return (
            lay.tiles[g - 1][r],
            lay.traces[g][r].input,
            lay.shapes[g][0],
            lent,
            borrowed,
        )

    def _halo(
        self, g: int, source: torch.Tensor, n: int, *, forward: bool
    ) -> tuple[torch.Tensor, float]:
        """One halo exchange at group ``g``'s boundary.

        Forward, ``source`` is this rank's tile of group ``g - 1``: it lends the
        pieces peers need and gathers its input region of group ``g`` from its own
        tile and the pieces it borrows. Backward, ``source`` is that region's
        gradient: the borrowed pieces' gradients go back to their owners and this
        rank's tile gradient is its own part plus what peers send (scatter-add).
        """
        mine, region, c, lent, borrowed = self._boundary(g)
        give, take = (lent, borrowed) if forward else (borrowed, lent)
        src, dst = (mine, region) if forward else (region, mine)
        sends = [(peer, _cut(source, piece, src)) for peer, piece in give]
        got = swap(sends, [(peer, (n, c, p.height, p.width)) for peer, p in take])
        self._link(self.layout.busiest_bytes(g, n * c * 4))
        shape = (n, c, dst.height, dst.width)
        out = torch.empty(shape) if forward else torch.zeros(shape)
        own = region.intersect(mine)
        parts = [(own, _cut(source, own, src))]
        parts += [(piece, t) for (_, piece), t in zip(take, got, strict=True)]
        for piece, tensor in parts:
            if forward:
                _cut(out, piece, dst).copy_(tensor)
            else:
                _cut(out, piece, dst).add_(tensor)
        return out, float(sum(t.numel() * 4 for _, t in sends))

    def _head(
        self, tile: torch.Tensor, y: torch.Tensor, step: int
    ) -> tuple[float | None, torch.Tensor, float, float]:
        """Gather the front's output on rank 0, run the head and the loss, send
        every rank its tile's gradient. Returns (loss, tile gradient, bytes sent,
        head compute seconds)."""
        lay, r = self.layout, self.rank
        tiles = lay.tiles[-1]
        n = tile.shape[0]
        c, h, w = lay.out_shape
        full = Rect(0, h, 0, w)
        if r != 0:
            swap([(0, tile.detach())], [])
            self._link(self._gather_bytes(n))
            (grad,) = swap([], [(0, tuple(tile.shape))])
            self._link(self._gather_bytes(n))
            return None, grad, float(tile.numel() * 4), 0.0
        got = swap(
            [], [(q, (n, c, t.height, t.width)) for q, t in enumerate(tiles) if q]
        )
        self._link(self._gather_bytes(n))
        fmap = torch.empty((n, c, h, w))
        _cut(fmap, tiles[0], full).copy_(tile.detach())
        for q, tensor in enumerate(got, start=1):
            _cut(fmap, tiles[q], full).copy_(tensor)
        fmap.requires_grad_(True)
        assert self.head is not None
        t0 = time.perf_counter()
        logits = self.head(fmap)
        loss = self.loss_fn(logits, y)
        forward = time.perf_counter() - t0
        macs = n * self._head_count(fmap)
        head_s = self._compute(forward, macs, step, backward=False)
        t0 = time.perf_counter()
        loss.backward()
        head_s += self._compute(time.perf_counter() - t0, macs, step, backward=True)
        assert fmap.grad is not None
        sends = [(q, _cut(fmap.grad, tiles[q], full)) for q in range(1, lay.ranks)]
        swap(sends, [])
        self._link(self._gather_bytes(n))
        grad = _cut(fmap.grad, tiles[0], full).clone()
        return (
            float(loss.detach()),
            grad,
            float(sum(t.numel() * 4 for _, t in sends)),
            head_s,
        )

    def _gather_bytes(self, n: int) -> float:
        c = self.layout.out_shape[0]
        return float(n * c * 4 * sum(t.area for t in self.layout.tiles[-1][1:]))

    def _head_count(self, fmap: torch.Tensor) -> int:
        if self._head_macs is None:
            assert self.head is not None
            self._head_macs = count_macs(self.head, fmap[:1].detach())
        return self._head_macs

    def _allreduce_front(self) -> None:
        import torch.distributed as dist

        if self.layout.ranks == 1:
            return
        params = [p for p in self.front.parameters() if p.requires_grad]
        if not params:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        self._link(flat.numel() * 4, ring=True)
        offset = 0
        for p in params:
            size = p.numel()
            p.grad = flat[offset : offset + size].view_as(p).clone()
            offset += size


def front_names(names: Sequence[str], front: int) -> list[str]:
    """The state names of the first ``front`` top-level layers."""
    return [n for n in names if int(n.split(".", 1)[0]) < front]
