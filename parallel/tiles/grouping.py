"""Where to fuse and where to exchange: the layer-grouping cost model and DP (pure).

The tiled *front* of a CNN (its first ``F`` top-level layers) is cut into fused
groups ``[b0, b1), [b1, b2), ...``. Inside a group every device computes its
tile from its own input region, recomputing the halo; at a group boundary the
devices exchange the overlaps of their next input regions with each other's
output tiles (and the gradients of those overlaps back), then start the next
group with a small halo again. The weight-heavy rest of the model (the *head*)
runs on one device, rank 0 (:mod:`flowerbed.parallel.tiles.exact_step` says why).

Deeper groups recompute more halo (it grows by ``d*(k-1)/2`` input pixels per
window layer and doubles back through every stride-2 layer); more boundaries move
more bytes and add a synchronisation each. Rama, Threadgill, Gerstlauer (arXiv
2409.09083, "layer grouping") choose the grouping by this trade-off; DeepThings
(Zhao et al., TCAD 2018, Sec. III) fuses for the same reason. Here the choice is
a dynamic programme over the cost of one training step.

Cost of one step (``N`` samples; ``bw`` link bytes/s; ``a`` per-message latency;
``q`` bytes per element; ``v_r`` rank ``r``'s training speed in forward
multiply-accumulates per second of forward + backward, as measured by the
profiler)::

    T = sum over groups g = [i, j) of
          max_r  N * MACs_r(i, j) / v_r                   compute, halo included
        + [i > 0] 2 * (max_r max(in_r, out_r) / bw + a)   halo exchange, fwd + bwd
        + norms(i, j) * 2 * ring(stats)                   normalisation sums
      + 2 * (gather_0 / bw + a)                           to rank 0 and back
      + N * MACs_head(F) / v_0                            the head on rank 0
      + ring(q * params_front)                            all-reduce of grads

    MACs_r(i, j) = sum over ops of area(out region_r) * MACs per output pixel
    in_r  = N q C_i * sum_{s != r} area(input_r(i, j)  intersect  tile_s(i))
    out_s = N q C_i * sum_{r != s} area(input_r(i, j)  intersect  tile_s(i))
    ring(B) = 2 (D - 1) / D * B / bw + 2 (D - 1) a

(``ring``: the ring all-reduce, Thakur, Rabenseifner, Gropp, "Optimization of
collective communication operations in MPICH", IJHPCA 2005; one home for the
formula: :mod:`flowerbed.parallel.collectives`.) Each device's link to the
switch is full duplex, so a phase lasts as long as the busiest port's larger
direction. ``tile_s(i)`` is the tile grid of map ``i``
(:func:`flowerbed.parallel.tiles.regions.tile_grid`), which depends only on the map, so
the cost of a group depends only on ``(i, j)``.

Memory per device (bytes; activations kept for backward, weights, gradients
and momentum)::

    M_r = N q sum_g act_r(g) + 3 q params_front
          + [r = 0] (N q (C_F H_F W_F + act_head(F)) + 3 q params_head)

The programme: ``best[j]`` is the set of Pareto-optimal (time, memory vector)
labels of groupings of layers ``0..j-1``; ``best[j] = prune(best[i] + group(i, j)
for i < j)``; the plan is the fastest label at a front end ``F`` whose memory fits
every device (a label-setting DP for a resource-constrained shortest path, since
memory is a second additive cost; Irnich and Desaulniers, "Shortest path problems
with resource constraints", 2005). Groups whose tiles are empty or smaller than
their halo are infeasible and skipped.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..collectives import ring_allreduce_seconds
from ..plan import PlanError
from .layout import (
    FrontGeometry,
    check_bounds,
    exchange_pieces,
    group_traces,
    map_tiles,
    port_bytes,
)
from .regions import NORM, TileError, auto_bands

MAX_LABELS = 128
"""Labels kept per layer in the DP (the fastest ones; plenty for <= 30 layers)."""
STATS_BYTES = 8
"""Bytes per normalisation statistic on the wire (float64 sums)."""


@dataclass(frozen=True)
class Cluster:
    """The devices of one tile job, in rank order (rank 0 runs the head).

    Attributes
    ----------
    speeds : tuple of float
        Training speed of each rank: forward MACs per second of forward +
        backward (the profiler's measure; > 0).
    memory : tuple of float
        Bytes each rank may use for this job (``math.inf``: no limit known).
    link_bytes_per_s : float
        Bytes/s of each device's link to the switch (100 Mb/s = 12.5e6).
    latency_s : float
        Seconds per message (gloo over TCP on a LAN: ~1 ms).
    bands : int or None
        Bands of rows of the tile grid (None:
        :func:`~flowerbed.parallel.tiles.regions.auto_bands`).
    bytes_per_element : int
        4 (float32).
    """

    speeds: tuple[float, ...]
    memory: tuple[float, ...] = ()
    link_bytes_per_s: float = 12.5e6
    latency_s: float = 1e-3
    bands: int | None = None
    bytes_per_element: int = 4

    def __post_init__(self) -> None:
        if not self.speeds:
            raise PlanError("a tile job needs at least one device")
        for speed in self.speeds:
            if not (math.isfinite(speed) and speed > 0):
                raise PlanError(f"device speeds must be finite and > 0, got {speed}")
        if self.memory and len(self.memory) != len(self.speeds):
            raise PlanError(
                f"{len(self.memory)} memory budgets for {len(self.speeds)} devices"
            )
        for memory in self.memory:
            if not memory > 0:
                raise PlanError(f"memory budgets must be > 0 bytes, got {memory}")
        if not (math.isfinite(self.link_bytes_per_s) and self.link_bytes_per_s > 0):
            raise PlanError(f"link bandwidth must be > 0, got {self.link_bytes_per_s}")
        if not (math.isfinite(self.latency_s) and self.latency_s >= 0):
            raise PlanError(f"link latency must be >= 0, got {self.latency_s}")

    @property
    def size(self) -> int:
        return len(self.speeds)

    @property
    def budgets(self) -> tuple[float, ...]:
        return self.memory or (math.inf,) * self.size

    def bands_for(self, height: int, width: int) -> int:
        return self.bands or auto_bands(height, width, self.size)

    def ring_s(self, nbytes: float) -> float:
        """Seconds of a ring all-reduce of ``nbytes`` among the cluster's devices
        (:func:`~flowerbed.parallel.collectives.ring_allreduce_seconds`)."""
        return ring_allreduce_seconds(
            self.size, nbytes, self.link_bytes_per_s * 8e-6, self.latency_s
        )

    def transfer_s(self, nbytes: float) -> float:
        """Seconds of one phase whose busiest port moves ``nbytes`` one way."""
        return nbytes / self.link_bytes_per_s + self.latency_s if nbytes > 0 else 0.0


def weights_of(cluster: Cluster) -> tuple[float, ...]:
    """Tile weights: each device's share of the map is its share of the speed."""
    return cluster.speeds


# --------------------------------------------------------------------------------
# Costs
# --------------------------------------------------------------------------------


@dataclass(frozen=True)
class GroupCost:
    """Cost of one fused group of layers ``first..stop-1`` in one step."""

    first: int
    stop: int
    compute_s: float
    exchange_s: float
    norm_s: float
    macs: tuple[int, ...]
    """Per rank, per sample, halo included."""
    exchange_bytes: float
    """Bytes crossing the links at the group's input, forward and backward."""
    activation_bytes: tuple[float, ...]

    @property
    def seconds(self) -> float:
        return self.compute_s + self.exchange_s + self.norm_s


def group_cost(
    geometry: FrontGeometry,
    cluster: Cluster,
    batch_size: int,
    first: int,
    stop: int,
) -> GroupCost:
    """Cost of the group ``first..stop-1`` (module docstring); TileError if its
    tiles are empty or smaller than their halo."""
    shapes = geometry.shapes()
    bands = cluster.bands_for(shapes[0][1], shapes[0][2])
    weights = weights_of(cluster)
    traces = group_traces(geometry, first, stop, weights, bands)
    n, q = batch_size, cluster.bytes_per_element
    compute = max(n * t.macs / v for t, v in zip(traces, cluster.speeds, strict=True))
    exchange_s, exchange_bytes = 0.0, 0.0
    if first > 0:
        owners = map_tiles(shapes[first], weights, bands)
        pieces = exchange_pieces(owners, [t.input for t in traces])
        sent, received = port_bytes(pieces, cluster.size, n * q * shapes[first][0])
        busiest = max(max(s, r) for s, r in zip(sent, received, strict=True))
        exchange_s = 2 * cluster.transfer_s(busiest)
        exchange_bytes = 2 * sum(sent)
    norm_s = 0.0
    for region in traces[0].ops:
        if region.op.kind == NORM:
            stats = 2 * region.op.statistics(n)  # a sum and a sum of squares each
            norm_s += 2 * cluster.ring_s(STATS_BYTES * stats)
    activations = tuple(n * q * t.activation_elements() for t in traces)
    return GroupCost(
        first,
        stop,
        compute,
        exchange_s,
        norm_s,
        tuple(t.macs for t in traces),
        exchange_bytes,
        activations,
    )


@dataclass(frozen=True)
class TailCost:
    """What follows the front: gather to rank 0, the head, the all-reduce."""

    gather_s: float
    gather_bytes: float
    head_s: float
    allreduce_s: float
    allreduce_bytes: float
    fixed_bytes: tuple[float, ...]
    """Memory beyond the front's activations, per rank (states, head)."""

    @property
    def seconds(self) -> float:
        return self.gather_s + self.head_s + self.allreduce_s


def tail_cost(
    geometry: FrontGeometry, cluster: Cluster, batch_size: int, front: int
) -> TailCost:
    shapes = geometry.shapes()
    n, q = batch_size, cluster.bytes_per_element
    c, h, w = shapes[front]
    bands = cluster.bands_for(shapes[0][1], shapes[0][2])
    tiles = map_tiles(shapes[front], weights_of(cluster), bands)
    gathered = n * q * c * sum(t.area for t in tiles[1:])
    head_s = n * geometry.head_macs[front] / cluster.speeds[0]
    front_bytes = q * geometry.front_params(front)
    fixed = [3.0 * front_bytes] * cluster.size
    fixed[0] += n * q * (c * h * w + geometry.head_elements[front]) + 3.0 * q * (
        geometry.head_params(front)
    )
    return TailCost(
        gather_s=2 * cluster.transfer_s(gathered),
        gather_bytes=2 * gathered,
        head_s=head_s,
        allreduce_s=cluster.ring_s(front_bytes),
        allreduce_bytes=(
            2 * (cluster.size - 1) * front_bytes if cluster.size > 1 else 0.0
        ),
        fixed_bytes=tuple(fixed),
    )


@dataclass(frozen=True)
class StepCost:
    """Predicted cost of one training step of a plan (module docstring)."""

    groups: tuple[GroupCost, ...]
    tail: TailCost
    total_s: float
    memory_bytes: tuple[float, ...]
    activation_bytes: tuple[float, ...]
    """Per rank: front activations (halo included), plus for rank 0 the gathered
    map and the head's activations."""

    @property
    def compute_s(self) -> float:
        return sum(g.compute_s for g in self.groups) + self.tail.head_s

    @property
    def link_s(self) -> float:
        """Seconds spent moving data (exchanges, norms, gather, all-reduce)."""
        return self.total_s - self.compute_s

    @property
    def link_bytes(self) -> float:
        """Bytes crossing links per step (all exchanges, gather, all-reduce)."""
        return (
            sum(g.exchange_bytes for g in self.groups)
            + self.tail.gather_bytes
            + self.tail.allreduce_bytes
        )

    @property
    def front_macs(self) -> tuple[int, ...]:
        """Per rank, per sample: the front's MACs including redundant halo work."""
        ranks = len(self.memory_bytes)
        return tuple(sum(g.macs[r] for g in self.groups) for r in range(ranks))


@dataclass(frozen=True)
class TilePlan:
    """A chosen tiling: front end, group boundaries, grid and predicted cost."""

    front: int
    bounds: tuple[int, ...]
    bands: int
    weights: tuple[float, ...]
    batch_size: int
    cost: StepCost
    alternatives: int = 0
    notes: tuple[str, ...] = field(default=())

    @property
    def groups(self) -> list[tuple[int, int]]:
        return list(zip(self.bounds[:-1], self.bounds[1:], strict=True))


def evaluate(
    geometry: FrontGeometry,
    cluster: Cluster,
    batch_size: int,
    bounds: Sequence[int],
) -> StepCost:
    """The cost of a given grouping (raises TileError/PlanError if infeasible)."""
    bounds = check_bounds(geometry, bounds)
    groups = tuple(
        group_cost(geometry, cluster, batch_size, a, b)
        for a, b in itertools.pairwise(bounds)
    )
    return _step(geometry, cluster, batch_size, groups, bounds[-1])


def _step(
    geometry: FrontGeometry,
    cluster: Cluster,
    batch_size: int,
    groups: Sequence[GroupCost],
    front: int,
) -> StepCost:
    tail = tail_cost(geometry, cluster, batch_size, front)
    acts = [sum(g.activation_bytes[r] for g in groups) for r in range(cluster.size)]
    memory = tuple(a + f for a, f in zip(acts, tail.fixed_bytes, strict=True))
    q, n = cluster.bytes_per_element, batch_size
    c, h, w = geometry.shapes()[front]
    acts[0] += n * q * (c * h * w + geometry.head_elements[front])
    return StepCost(
        groups=tuple(groups),
        tail=tail,
        total_s=sum(g.seconds for g in groups) + tail.seconds,
        memory_bytes=memory,
        activation_bytes=tuple(acts),
    )


def check_memory(cost: StepCost, cluster: Cluster, bounds: Sequence[int]) -> None:
    """Raise :class:`PlanError` naming the first device whose memory is short."""
    for rank, (need, have) in enumerate(
        zip(cost.memory_bytes, cluster.budgets, strict=True)
    ):
        if need > have:
            raise PlanError(
                f"the group plan {list(bounds)} does not fit memory: rank {rank} "
                f"needs {size_text(need)}, has {size_text(have)}; use more "
                "devices, a smaller batch, fewer tiled layers, or a device with more "
                "memory as rank 0 (it holds the head)"
            )


def size_text(nbytes: float) -> str:
    """``1536 -> '1.5 KiB'``: bytes for messages."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes:.0f} B"


@dataclass
class _Label:
    seconds: float
    memory: tuple[float, ...]
    groups: tuple[GroupCost, ...]


def _prune(labels: list[_Label]) -> list[_Label]:
    """Pareto-optimal labels (no other is as fast and as small everywhere)."""
    kept: list[_Label] = []
    for label in sorted(labels, key=lambda lb: (lb.seconds, sum(lb.memory))):
        dominated = any(
            k.seconds <= label.seconds
            and all(a <= b for a, b in zip(k.memory, label.memory, strict=True))
            for k in kept
        )
        if not dominated:
            kept.append(label)
        if len(kept) >= MAX_LABELS:
            break
    return kept


def plan_tiles(
    geometry: FrontGeometry,
    cluster: Cluster,
    batch_size: int,
    *,
    front: int | None = None,
    bounds: Sequence[int] | None = None,
) -> TilePlan:
    """The fastest grouping that fits every device's memory (module docstring).

    ``bounds`` fixes the grouping (checked and costed); ``front`` fixes how many
    layers are tiled and lets the DP choose the groups; neither: the DP also
    chooses the front's end among ``1..geometry.tileable``.
    """
    if batch_size < 1:
        raise PlanError(f"batch size must be >= 1, got {batch_size}")
    shapes = geometry.shapes()
    bands = cluster.bands_for(shapes[0][1], shapes[0][2])
    weights = weights_of(cluster)
    if bounds is not None:
        chosen = check_bounds(geometry, bounds)
        if front is not None and chosen[-1] != front:
            raise PlanError(f"bounds {list(chosen)} end at {chosen[-1]}, not {front}")
        given = evaluate(geometry, cluster, batch_size, chosen)
        check_memory(given, cluster, chosen)
        return TilePlan(chosen[-1], chosen, bands, weights, batch_size, given, 1)
    if geometry.tileable < 1:
        raise TileError(f"no layer of the model can be tiled: {geometry.stop}")
    if front is not None and not 1 <= front <= geometry.tileable:
        raise TileError(
            f"front of {front} layers: choose 1..{geometry.tileable} "
            f"({geometry.stop or 'every layer can be tiled'})"
        )
    last = front if front is not None else geometry.tileable
    best: list[list[_Label]] = [[_Label(0.0, (0.0,) * cluster.size, ())]]
    reasons: list[str] = []
    for stop in range(1, last + 1):
        labels: list[_Label] = []
        for first in range(stop):
            if not best[first]:
                continue
            try:
                group = group_cost(geometry, cluster, batch_size, first, stop)
            except TileError as err:
                reasons.append(str(err))
                continue
            for label in best[first]:
                labels.append(
                    _Label(
                        label.seconds + group.seconds,
                        tuple(
                            m + a
                            for m, a in zip(
                                label.memory, group.activation_bytes, strict=True
                            )
                        ),
                        (*label.groups, group),
                    )
                )
        best.append(_prune(labels))
    fronts = [front] if front is not None else list(range(1, last + 1))
    candidates: list[tuple[float, StepCost, tuple[int, ...]]] = []
    tried = 0
    for end in fronts:
        for label in best[end]:
            step = _step(geometry, cluster, batch_size, label.groups, end)
            grouping = (0, *(g.stop for g in label.groups))
            candidates.append((step.total_s, step, grouping))
            tried += 1
    if not candidates:
        raise TileError(
            "no grouping of the front can be tiled on "
            f"{cluster.size} devices: {reasons[0] if reasons else geometry.stop}"
        )
    budgets = cluster.budgets
    fitting = [
        c
        for c in candidates
        if all(m <= b for m, b in zip(c[1].memory_bytes, budgets, strict=True))
    ]
    if not fitting:
        # the plan that comes closest, for the message
        closest = min(
            candidates,
            key=lambda c: max(
                m / b for m, b in zip(c[1].memory_bytes, budgets, strict=True)
            ),
        )
        check_memory(closest[1], cluster, closest[2])
    _, chosen_cost, grouping = min(fitting, key=lambda c: (c[0], len(c[2])))
    return TilePlan(
        grouping[-1], grouping, bands, weights, batch_size, chosen_cost, tried
    )
