"""One training job across several devices: plans, groups, planners, workers.

Flower is the control plane, ``torch.distributed`` (gloo over TCP) the data plane
(docs/architecture.md, "Jobs that span devices"). A strategy
(:class:`flowerbed.strategies.span.SpanJobStrategy` and its subclasses) sends each
member a :class:`MemberPlan` and its weights per segment; the board's ClientApp
(:mod:`flowerbed.clients.span_app`) runs the plan's mode; members join a fresh
gloo group, run the segment peer-to-peer and reply with weights and measured
times. One Flower round = one segment of K steps.

Shared machinery (every kind of span job uses it):

- :mod:`~flowerbed.parallel.plan` — :class:`MemberPlan` (pure data, JSON in a
  ConfigRecord: rank, world size, rendezvous, layers / batch share / tile, steps,
  micro-batches, replication period), :class:`LayerSource`, :class:`PlanError`,
  :func:`check_address`.
- :mod:`~flowerbed.parallel.group` — :func:`joined_group` (fresh gloo group on the
  plan's rendezvous, bound to the member's advertised address, join and
  operation timeouts), :class:`PeerFailure` (a lost peer: the runner reports it,
  never hangs), :class:`RendezvousError` (port in use, foreign address),
  :func:`segment_port`, :func:`free_port`.
- :mod:`~flowerbed.parallel.member` — :class:`MemberContext` (what a board knows
  about itself), :class:`MemberResult` (what it hands back),
  :func:`exchange_ring`, :func:`send_state`, :func:`recv_state`.
- :mod:`~flowerbed.parallel.emulation` — :class:`DeviceSpeed`,
  :class:`TimedModule` (time forward/backward; on one machine also sleep up to an
  emulated device's time).
- :mod:`~flowerbed.parallel.store` — :class:`LayerStore` (a member's on-disk
  states: own snapshots, neighbour replicas).
- :mod:`~flowerbed.parallel.modes` — the table of runners by plan mode; a new
  kind of job registers its runner there.
- :mod:`~flowerbed.parallel.data` — job datasets and :func:`batch_indices` (the
  batch of a global step, the same on every retry).
- :mod:`~flowerbed.parallel.collectives` — what a ring all-reduce costs on a
  link (pure; the one formula the tile cost model and ``sims.links`` share).

Pipeline training (FTPipeHD, Chen et al., arXiv 2110.02781):

- :mod:`~flowerbed.parallel.partition` — the partition DP (pure).
- :mod:`~flowerbed.parallel.makespan` — the 1F1B/GPipe makespan model with links,
  replication and recovery (pure; the virtual clock).
- :mod:`~flowerbed.parallel.recovery` — which step to restart from and where each
  layer comes from after a loss (pure).
- :mod:`~flowerbed.parallel.pipeline` — the member's side: profile, run a segment.

Large-batch synchronous training (S1; Goyal et al. 2017, LARS/LAMB):

- :mod:`~flowerbed.parallel.large_batch` — batch shares proportional to speed,
  the loss scale that makes unequal shares one large batch, the linear-scaling
  and warm-up schedule (pure).
- :mod:`~flowerbed.parallel.optim` — momentum SGD, LARS and LAMB on named NumPy
  arrays (pure).

Fused-tile training (S2; Rama, Threadgill, Gerstlauer, arXiv 2409.09083):

- :mod:`~flowerbed.parallel.tiles` — the tracer: the input region each output
  tile needs, tile grids sized to device speed (pure).
- :mod:`~flowerbed.parallel.tile_layout` — a model's geometry, every rank's
  regions and the pieces exchanged at group boundaries (pure).
- :mod:`~flowerbed.parallel.tile_groups` — the step's cost model and the
  grouping DP under memory (pure).
- :mod:`~flowerbed.parallel.tile_model` — torch layers as ops, ops on regions,
  normalisation statistics shared across boards.
- :mod:`~flowerbed.parallel.tile_member` — one member's exact tiled step;
  :mod:`~flowerbed.parallel.tiled` — the mode's runner, profiler, evaluator.

Pure modules (plan, collectives, partition, makespan, recovery, large_batch,
optim, tiles, tile_layout, tile_groups) import neither torch nor
torch.distributed, so strategies, the virtual clock and the benchmark share
them. Nothing here imports :mod:`flowerbed.sims`.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "MemberPlan": "flowerbed.parallel.plan",
    "LayerSource": "flowerbed.parallel.plan",
    "PlanError": "flowerbed.parallel.plan",
    "check_address": "flowerbed.parallel.plan",
    "joined_group": "flowerbed.parallel.group",
    "PeerFailure": "flowerbed.parallel.group",
    "RendezvousError": "flowerbed.parallel.group",
    "segment_port": "flowerbed.parallel.group",
    "free_port": "flowerbed.parallel.group",
    "MemberContext": "flowerbed.parallel.member",
    "MemberResult": "flowerbed.parallel.member",
    "exchange_ring": "flowerbed.parallel.member",
    "DeviceSpeed": "flowerbed.parallel.emulation",
    "TimedModule": "flowerbed.parallel.emulation",
    "LayerStore": "flowerbed.parallel.store",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
