"""Recovering from a lost member: which step to restart from, where layers come
from (pure).

FTPipeHD (Chen et al., arXiv 2110.02781, Sec. 4.3-4.4) replicates each stage's
weights to the next stage and, less often, to the central node; after a failure
it re-partitions over the survivors and each new stage takes each layer from
itself, the old owner, the old owner's successor (its replica) or the central
copy. Here, in a synchronous pipeline, the restored model must be one
consistent step for every layer, so recovery picks the **newest step at which
every layer has a surviving copy**:

- every R steps each member saves its own layers and receives its ring
  predecessor's (:mod:`flowerbed.parallel.store`), so after one loss every layer
  exists at the last replication step: at most R steps are lost;
- two *adjacent* losses (a stage and its successor, which held its replica) leave
  a layer with no surviving copy at that step; recovery then falls back to an
  older step that still has one, at worst the central copy (the last completed
  segment, held by the ServerApp), losing up to a segment;
- non-adjacent losses still find every layer at the last replication step.

:class:`Holdings` records who holds which layer at which step (from the members'
replies, which list their store); :func:`restart_step` and
:func:`layer_sources` are pure functions of it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from ..plan import SOURCE_CENTRAL, SOURCE_PEER, SOURCE_SELF, LayerSource


@dataclass
class Holdings:
    """Who holds which layer at which step: ``steps[step][layer] = {member ids}``.

    ``central_step`` is the step of the ServerApp's copy (all layers);
    ``num_layers`` the model's layer count.
    """

    num_layers: int
    central_step: int = 0
    steps: dict[int, dict[int, set[int]]] = field(default_factory=dict)

    def add(self, member: int, step: int, layers: Iterable[int]) -> None:
        per_layer = self.steps.setdefault(step, {})
        for layer in layers:
            per_layer.setdefault(layer, set()).add(member)

    def add_report(self, member: int, flat: Sequence[int]) -> None:
        """Add a member's store listing: ``[step, first, stop]`` triples, flat."""
        if len(flat) % 3:
            raise ValueError(f"a holdings report has triples, got {len(flat)} numbers")
        for k in range(0, len(flat), 3):
            step, first, stop = (int(v) for v in flat[k : k + 3])
            if not 0 <= first < stop <= self.num_layers or step < 0:
                raise ValueError(
                    f"holdings entry step {step} layers {first}..{stop - 1} is outside "
                    f"the model's {self.num_layers} layers"
                )
            self.add(member, step, range(first, stop))

    def forget_member(self, member: int) -> None:
        for per_layer in self.steps.values():
            for holders in per_layer.values():
                holders.discard(member)

    def set_central(self, step: int) -> None:
        """The ServerApp now holds every layer at ``step``; older steps are dropped."""
        self.central_step = step
        self.steps = {s: v for s, v in self.steps.items() if s >= step}

    def holders(self, layer: int, step: int, among: Iterable[int]) -> set[int]:
        pool = set(among)
        return set(self.steps.get(step, {}).get(layer, set())) & pool


def restart_step(holdings: Holdings, survivors: Iterable[int], not_after: int) -> int:
    """The newest step ``<= not_after`` at which every layer has a surviving holder,
    or the central copy's step when there is none (see the module doc)."""
    pool = set(survivors)
    for step in sorted(holdings.steps, reverse=True):
        if step > not_after or step < holdings.central_step:
            continue
        if all(
            holdings.holders(layer, step, pool) for layer in range(holdings.num_layers)
        ):
            return step
    return holdings.central_step


@dataclass(frozen=True)
class MemberReport:
    """What a member said about a failed segment.

    ``ok``: it finished; ``steps``: steps it completed; ``failed_step``: the step
    in progress when it stopped (-1 if it finished); ``holds``: its store listing.
    """

    ok: bool
    steps: int
    failed_step: int
    holds: Sequence[int]


@dataclass(frozen=True)
class Recovery:
    """Where a job resumes after a failed segment."""

    holdings: Holdings
    reached: int
    restart: int

    @property
    def lost_steps(self) -> int:
        return max(0, self.reached - self.restart)

    @property
    def from_central(self) -> bool:
        return (
            self.restart == self.holdings.central_step and self.restart < self.reached
        )


def recover(
    before: Holdings,
    start_step: int,
    reports: Mapping[int, MemberReport],
    erred: Iterable[int],
    survivors: Iterable[int],
) -> Recovery:
    """The restart point after a segment that began at ``start_step`` failed.

    ``reports`` are the surviving members' replies; ``erred`` the members that
    answered with an error before reporting (alive; their stores kept
    ``start_step``, as ``before`` records); ``survivors`` every member still
    usable. ``reached`` is the furthest step any member got to.
    """
    alive = set(survivors)
    holdings = Holdings(before.num_layers, central_step=before.central_step)
    reached = start_step
    for member, report in reports.items():
        if member in alive:
            holdings.add_report(member, report.holds)
        done = start_step + report.steps if report.ok else report.failed_step
        reached = max(reached, done)
    for member in erred:
        if member in alive:
            for layer, holders in before.steps.get(start_step, {}).items():
                if member in holders:
                    holdings.add(member, start_step, [layer])
    restart = restart_step(holdings, alive, not_after=reached)
    return Recovery(holdings, reached, restart)


def layer_sources(
    holdings: Holdings,
    bounds: Sequence[int],
    members: Sequence[int],
    step: int,
    previous_owner: Mapping[int, int] | None = None,
) -> tuple[LayerSource, ...]:
    """Where each layer of the new partition comes from at ``step``.

    ``members[r]`` is the member id of rank ``r``, holding layers
    ``bounds[r] .. bounds[r+1]-1``. A layer comes from its new owner itself if it
    holds it, else from a member of the new group that holds it (the layer's
    previous owner first, then the lowest rank), else from the central copy (only
    valid when ``step`` is the central copy's step).
    """
    previous_owner = previous_owner or {}
    rank_of = {member: rank for rank, member in enumerate(members)}
    out = []
    for rank, member in enumerate(members):
        for layer in range(bounds[rank], bounds[rank + 1]):
            holders = holdings.holders(layer, step, rank_of)
            if member in holders:
                out.append(LayerSource(layer, SOURCE_SELF, -1, step))
            elif holders:
                old = previous_owner.get(layer)
                giver = old if old in holders else min(holders, key=rank_of.__getitem__)
                out.append(LayerSource(layer, SOURCE_PEER, rank_of[giver], step))
            elif step == holdings.central_step:
                out.append(LayerSource(layer, SOURCE_CENTRAL, -1, step))
            else:
                raise ValueError(
                    f"layer {layer} has no copy at step {step} among members "
                    f"{list(members)} and the central copy is at step "
                    f"{holdings.central_step}"
                )
    return tuple(out)
