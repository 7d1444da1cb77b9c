"""One training job across several devices: plans, groups, planners, workers.

Flower is the control plane, ``torch.distributed`` (gloo over TCP) the data plane
(docs/architecture.md, "Jobs that span devices"). A strategy
(:class:`flowerbed.strategies.span.SpanJobStrategy` and its subclasses) sends each
member a :class:`MemberPlan` and its weights per segment; the board's ClientApp
(:mod:`flowerbed.clients.span_app`) runs the plan's mode; members join a fresh
gloo group, run the segment peer-to-peer and reply with weights and measured
times. One Flower round = one segment of K steps.

Shared machinery (every kind of span job uses it), at this package's top level:

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
- :mod:`~flowerbed.parallel.setup_time` — :class:`SetupClock`: a member's
  set-up (its ClientApp process's start, the rendezvous, the rest until the
  first step), logged and reported in its reply.
- :mod:`~flowerbed.parallel.emulation` — :class:`DeviceSpeed`,
  :class:`TimedModule` (time forward/backward; on one machine also sleep up to an
  emulated device's time).
- :mod:`~flowerbed.parallel.store` — :class:`LayerStore` (a member's on-disk
  states: own snapshots, neighbour replicas).
- :mod:`~flowerbed.parallel.modes` — the table of runners by plan mode; a new
  kind of job registers its runner there.
- :mod:`~flowerbed.parallel.user_code` — :class:`Training` (a user's loss and
  ``torch.optim`` optimiser factory, by ``"package.module:function"`` name, an
  option of every span strategy), :func:`build_module` (any ``nn.Module``) and
  :func:`build_layers` (a model a pipeline or tile job can cut).
- :mod:`~flowerbed.parallel.reference` — :func:`single_device`: the weights
  one process reaches training a span job's :class:`ReferenceJob` (each span
  strategy's ``reference_job()``), to check a run's exactness.
- :mod:`~flowerbed.parallel.job_data` — job datasets and :func:`batch_indices`
  (the batch of a global step, the same on every retry).
- :mod:`~flowerbed.parallel.collectives` — what a ring all-reduce costs on a
  link (pure; the one formula the tile cost model and ``sims.links`` share).
- :mod:`~flowerbed.parallel.probe` — the ``probe`` mode: join a group, measure
  the ring's links (checks a cohort; tests the shared machinery).

One subpackage per kind of job, each with its pure planning modules and the
member's side (its mode's runner):

- :mod:`flowerbed.parallel.pipeline` — pipeline training (FTPipeHD, Chen et al.,
  arXiv 2110.02781): ``partition``, ``makespan``, ``planner``, ``recovery``
  (pure) and ``stage`` (the member).
- :mod:`flowerbed.parallel.large_batch` — large-batch synchronous training (S1;
  Goyal et al. 2017, LARS/LAMB): ``recipe``, ``optimizers`` (pure) and
  ``allreduce`` (the member).
- :mod:`flowerbed.parallel.tiles` — fused-tile training (S2; Rama, Threadgill,
  Gerstlauer, arXiv 2409.09083): ``regions``, ``layout``, ``grouping`` (pure),
  ``region_ops``, ``exact_step`` and ``runner`` (the member).

Pure modules (plan, collectives and the subpackages' planning modules) import
neither torch nor torch.distributed, so strategies, the virtual clock and the
benchmark share them. Nothing here imports :mod:`flowerbed.sims`. The facts
about gloo and ``torch.distributed`` the code relies on are collected, with
their sources, in docs/references.md.

Modules that moved in this layout keep their old paths for one release
(:data:`MOVED_MODULES`): importing one warns with a :class:`DeprecationWarning`
and gives the new module (:mod:`flowerbed.moved`).
"""

from __future__ import annotations

from flowerbed.lazy import lazy_names
from flowerbed.moved import alias_modules

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
    "Training": "flowerbed.parallel.user_code",
    "ReferenceJob": "flowerbed.parallel.reference",
    "single_device": "flowerbed.parallel.reference",
    "UserCodeError": "flowerbed.parallel.user_code",
    "build_module": "flowerbed.parallel.user_code",
    "build_layers": "flowerbed.parallel.user_code",
}

__all__ = sorted(_EXPORTS)


__getattr__ = lazy_names(__name__, _EXPORTS)


MOVED_MODULES = {
    "flowerbed.parallel.data": "flowerbed.parallel.job_data",
    "flowerbed.parallel.partition": "flowerbed.parallel.pipeline.partition",
    "flowerbed.parallel.makespan": "flowerbed.parallel.pipeline.makespan",
    "flowerbed.parallel.planner": "flowerbed.parallel.pipeline.planner",
    "flowerbed.parallel.recovery": "flowerbed.parallel.pipeline.recovery",
    "flowerbed.parallel.optim": "flowerbed.parallel.large_batch.optimizers",
    "flowerbed.parallel.allreduce": "flowerbed.parallel.large_batch.allreduce",
    "flowerbed.parallel.tile_layout": "flowerbed.parallel.tiles.layout",
    "flowerbed.parallel.tile_groups": "flowerbed.parallel.tiles.grouping",
    "flowerbed.parallel.tile_model": "flowerbed.parallel.tiles.region_ops",
    "flowerbed.parallel.tile_member": "flowerbed.parallel.tiles.exact_step",
    "flowerbed.parallel.tiled": "flowerbed.parallel.tiles.runner",
}
"""Old module path -> its new home (deprecated aliases, for one release). The
former modules ``pipeline``, ``large_batch`` and ``tiles`` are packages now; their
names resolve from the packages (see each package's docstring)."""

alias_modules(MOVED_MODULES)
