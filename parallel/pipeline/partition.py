"""Where to cut the model: FTPipeHD's partition dynamic programme (pure).

FTPipeHD (Chen, Yang, He, Shi, Chen, "FTPipeHD: A Fault-Tolerant Pipeline-Parallel
Distributed Training Framework for Heterogeneous Edge Devices", arXiv 2110.02781,
Sec. 4, partition algorithm) profiles, on a reference device, every layer's
forward and backward time and output size, measures each worker's *computing
power* (its time over the reference's for the same layers) and the bandwidth
between consecutive workers, and then chooses contiguous layer ranges that
minimise the slowest stage or cut::

    dp[j][s] = min_{i<j} max( dp[i][s-1],
                              2 * out_bytes[i] / bw[s-1],
                              (T_fwd(i+1..j) + T_bwd(i+1..j)) * power[s] )

``dp[j][s]``: the best bottleneck when stages ``0..s`` hold layers ``1..j``;
``out_bytes[i]``: bytes of layer ``i``'s output for one micro-batch (it crosses the
cut forward and its gradient crosses back: the factor 2); ``bw[s-1]``: bytes/s of
the link between stages ``s-1`` and ``s``; ``power[s]``: stage ``s``'s device time
per reference second. In a synchronous pipeline a step takes about
``(m + p - 1) x`` the bottleneck (:mod:`flowerbed.parallel.pipeline.makespan`), so
minimising it maximises throughput.

Many partitions share the optimal bottleneck (e.g. every split of the fast
devices' layers that keeps each under the slow device's time). Among them
:func:`partition` takes the one with the smallest sum of squared stage times (the
most even spread, least sensitive to timing noise), by a second pass restricted
to stages and cuts within the optimal bottleneck; remaining ties go to the
earliest cut. Every stage holds at least one layer.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ..plan import PlanError, boundaries, stage_sizes


@dataclass(frozen=True)
class LayerCosts:
    """Per-layer costs of one micro-batch on the reference device.

    Attributes
    ----------
    forward_s, backward_s : tuple[float, ...]
        Seconds of layer ``l``'s forward and backward pass on one micro-batch.
    out_bytes : tuple[float, ...]
        Bytes of layer ``l``'s output for one micro-batch (what crosses a cut
        after ``l``).
    state_bytes : tuple[float, ...]
        Bytes of layer ``l``'s weights and optimiser state (what moves when the
        layer changes owner, and what replication copies).
    """

    forward_s: tuple[float, ...]
    backward_s: tuple[float, ...]
    out_bytes: tuple[float, ...]
    state_bytes: tuple[float, ...]

    def __post_init__(self) -> None:
        n = len(self.forward_s)
        for name in ("backward_s", "out_bytes", "state_bytes"):
            if len(getattr(self, name)) != n:
                raise ValueError(
                    f"{name} has {len(getattr(self, name))} entries, expected {n}"
                )
        for name in ("forward_s", "backward_s", "out_bytes", "state_bytes"):
            for value in getattr(self, name):
                if not (math.isfinite(value) and value >= 0):
                    raise ValueError(
                        f"{name} holds {value}: costs must be finite and >= 0"
                    )

    @property
    def num_layers(self) -> int:
        return len(self.forward_s)

    def compute_s(self, first: int, stop: int) -> float:
        """Reference forward + backward seconds of layers ``first .. stop-1``."""
        return sum(self.forward_s[first:stop]) + sum(self.backward_s[first:stop])


@dataclass(frozen=True)
class Partition:
    """A partition and its predicted per-micro-batch times.

    ``bounds``: stage boundaries (stage ``s`` holds ``bounds[s] .. bounds[s+1]-1``);
    ``stage_s``: each stage's forward + backward seconds per micro-batch on its
    device; ``cut_s``: each cut's activation + gradient transfer seconds;
    ``bottleneck_s``: the largest of them (the DP's objective).
    """

    bounds: tuple[int, ...]
    stage_s: tuple[float, ...]
    cut_s: tuple[float, ...]

    @property
    def bottleneck_s(self) -> float:
        return max((*self.stage_s, *self.cut_s))

    @property
    def sizes(self) -> list[int]:
        return stage_sizes(self.bounds)


def _check(
    costs: LayerCosts, power: Sequence[float], bandwidth: Sequence[float]
) -> None:
    stages = len(power)
    if stages < 1:
        raise PlanError("a pipeline needs at least one stage")
    if stages > costs.num_layers:
        raise PlanError(
            f"{stages} stages but the model has only {costs.num_layers} layers: every "
            f"stage needs at least one layer; use at most {costs.num_layers} members "
            "(or a model with more top-level layers)"
        )
    if len(bandwidth) != stages - 1:
        raise PlanError(
            f"{stages} stages need {stages - 1} link bandwidths, got {len(bandwidth)}"
        )
    for value in power:
        if not (math.isfinite(value) and value > 0):
            raise PlanError(f"stage power {value} must be finite and > 0")
    for value in bandwidth:
        if not value > 0:
            raise PlanError(
                f"link bandwidth {value} must be > 0 (math.inf for free links)"
            )


def evaluate(
    bounds: Sequence[int],
    costs: LayerCosts,
    power: Sequence[float],
    bandwidth: Sequence[float],
) -> Partition:
    """Predicted stage and cut times of a given partition."""
    _check(costs, power, bandwidth)
    bounds = tuple(bounds)
    if (
        len(bounds) != len(power) + 1
        or bounds[0] != 0
        or bounds[-1] != costs.num_layers
    ):
        raise PlanError(
            f"partition {list(bounds)} must run from 0 to {costs.num_layers} in "
            f"{len(power)} stages"
        )
    if any(size < 1 for size in stage_sizes(bounds)):
        raise PlanError(
            f"partition {list(bounds)}: every stage needs at least one layer"
        )
    stage = tuple(
        costs.compute_s(bounds[s], bounds[s + 1]) * power[s] for s in range(len(power))
    )
    cuts = tuple(
        2 * costs.out_bytes[bounds[s + 1] - 1] / bandwidth[s]
        for s in range(len(power) - 1)
    )
    return Partition(bounds, stage, cuts)


def partition(
    costs: LayerCosts,
    power: Sequence[float],
    bandwidth: Sequence[float] | None = None,
) -> Partition:
    """The FTPipeHD partition of ``costs`` over stages of ``power`` (module doc).

    ``bandwidth[s]`` is the link between stages ``s`` and ``s+1`` in bytes/s
    (default: free links). Raises :class:`PlanError` when there are more stages
    than layers.
    """
    p = len(power)
    bw = list(bandwidth) if bandwidth is not None else [math.inf] * (p - 1)
    _check(costs, power, bw)
    n = costs.num_layers
    prefix = [0.0]
    for f, b in zip(costs.forward_s, costs.backward_s, strict=True):
        prefix.append(prefix[-1] + f + b)

    def stage_cost(i: int, j: int, s: int) -> float:  # layers i .. j-1 on stage s
        return (prefix[j] - prefix[i]) * power[s]

    def cut_cost(i: int, s: int) -> float:  # cut after layer i-1, link s-1 -> s
        return 2 * costs.out_bytes[i - 1] / bw[s - 1]

    inf = math.inf
    # Pass 1 (FTPipeHD): best bottleneck. dp[s][j]: stages 0..s hold layers 0..j-1.
    dp = [[inf] * (n + 1) for _ in range(p)]
    for j in range(1, n + 1):
        dp[0][j] = stage_cost(0, j, 0)
    for s in range(1, p):
        for j in range(s + 1, n + 1):
            dp[s][j] = min(
                max(dp[s - 1][i], cut_cost(i, s), stage_cost(i, j, s))
                for i in range(s, j)
            )
    best = dp[p - 1][n]
    # Pass 2: among partitions within the best bottleneck, the least sum of
    # squared stage times; ties to the earliest cut.
    limit = best * (1 + 1e-9) + 1e-15
    sq = [[inf] * (n + 1) for _ in range(p)]
    back = [[-1] * (n + 1) for _ in range(p)]
    for j in range(1, n + 1):
        c = stage_cost(0, j, 0)
        if c <= limit:
            sq[0][j] = c * c
    for s in range(1, p):
        for j in range(s + 1, n + 1):
            for i in range(s, j):
                if sq[s - 1][i] == inf or cut_cost(i, s) > limit:
                    continue
                c = stage_cost(i, j, s)
                if c > limit:
                    continue
                total = sq[s - 1][i] + c * c
                if total < sq[s][j] * (1 - 1e-12):
                    sq[s][j], back[s][j] = total, i
    cuts = [n]
    j = n
    for s in range(p - 1, 0, -1):
        j = back[s][j]
        cuts.append(j)
    bounds = tuple([0, *reversed(cuts)])
    return evaluate(bounds, costs, power, bw)


def even_partition(num_layers: int, stages: int) -> tuple[int, ...]:
    """Equal layer counts per stage (the homogeneous assumption), first stages
    taking the remainder: 11 layers on 3 stages -> sizes 4, 4, 3."""
    if stages > num_layers:
        raise PlanError(f"{stages} stages but only {num_layers} layers")
    base, extra = divmod(num_layers, stages)
    return boundaries([base + (1 if s < extra else 0) for s in range(stages)])


def moved_layers(
    old: Sequence[int],
    old_owner: Sequence[int],
    new: Sequence[int],
    new_owner: Sequence[int],
) -> list[int]:
    """Layers whose owner (a member id) differs between two partitions.

    ``old``/``new`` are boundaries, ``old_owner``/``new_owner`` the member id of
    each stage.
    """

    def owner(bounds: Sequence[int], owners: Sequence[int], layer: int) -> int:
        for s, member in enumerate(owners):
            if bounds[s] <= layer < bounds[s + 1]:
                return member
        raise ValueError(f"layer {layer} outside {list(bounds)}")

    return [
        layer
        for layer in range(new[-1])
        if owner(old, old_owner, layer) != owner(new, new_owner, layer)
    ]
