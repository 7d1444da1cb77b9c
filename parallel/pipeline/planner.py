"""The pipeline's planning state: computing powers, links, layouts (pure).

:class:`PipelinePlanner` keeps what FTPipeHD's central node knows between
segments — the reference per-layer times, every member's computing power, the
measured link bandwidths — and decides each segment's layout: the first
partition, a re-plan when members come or go, and a **dynamic re-partition**
when the measured powers make a better partition worth its cost:

    gain = (t_now - t_new) * steps_left      (predicted step times, makespan model)
    cost = sum(state bytes of moved layers) / link bandwidth
    re-partition  iff  t_new < (1 - threshold) * t_now  and  gain > cost

(FTPipeHD, arXiv 2110.02781, Sec. 4.2: re-partition from the latest measured
capacities; the gain/cost test is ours, so that noise does not move layers for
nothing.) Every decision carries its reason for the log. No Flower, no torch:
the strategy, the virtual clock and the benchmark share it.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..plan import PlanError, boundaries, stage_sizes
from .makespan import step_s
from .partition import LayerCosts, Partition, evaluate, moved_layers, partition

MIN_MEASURED_SHARE = 0.1
"""Least share of the model's compute a stage needs for its measured time to
update its member's computing power."""

INITIAL = "initial"
REPLAN = "re-plan"
REPARTITION = "re-partition"
KEEP = "keep"


@dataclass(frozen=True)
class Layout:
    """Members in stage order and their layer boundaries."""

    members: tuple[int, ...]
    bounds: tuple[int, ...]

    def owner(self) -> dict[int, int]:
        """Layer -> member id."""
        out = {}
        for rank, member in enumerate(self.members):
            for layer in range(self.bounds[rank], self.bounds[rank + 1]):
                out[layer] = member
        return out

    @property
    def sizes(self) -> list[int]:
        return stage_sizes(self.bounds)


@dataclass(frozen=True)
class Decision:
    """The layout of the next segment and why."""

    layout: Layout
    kind: str
    step_s: float
    reason: str
    moved: tuple[int, ...] = ()


@dataclass
class PipelinePlanner:
    """Planning state of one pipeline job (see the module docstring).

    Parameters
    ----------
    out_bytes, state_bytes : sequence of float
        Per layer: activation bytes of one micro-batch, weight+optimiser bytes.
    micro_batches : int
        Micro-batches per step.
    schedule : str
        ``"1f1b"`` or ``"gpipe"``.
    link_bandwidth : float
        Bytes/s assumed for links not measured yet.
    repartition : bool
        Allow dynamic re-partitioning.
    threshold : float
        Least relative step-time improvement worth a re-partition.
    fixed_sizes : sequence of int, optional
        A fixed partition (layers per stage) used instead of the DP.

    Attributes
    ----------
    reference_forward, reference_backward : tuple of float
        Per layer: forward and backward seconds of one micro-batch on the
        reference member (the fastest at the first profile; empty until then).
    power : dict of int to float
        Member -> computing power: its time over the reference's for the same
        layers (FTPipeHD Sec. 4.1), profiled, then updated from segments.
    links : dict of (int, int) to float
        Measured bytes/s from one member to the next.
    """

    out_bytes: Sequence[float]
    state_bytes: Sequence[float]
    micro_batches: int
    schedule: str = "1f1b"
    link_bandwidth: float = 12.5e6
    repartition: bool = True
    threshold: float = 0.1
    fixed_sizes: Sequence[int] | None = None
    reference_forward: tuple[float, ...] = ()
    reference_backward: tuple[float, ...] = ()
    power: dict[int, float] = field(default_factory=dict)
    links: dict[tuple[int, int], float] = field(default_factory=dict)

    @property
    def num_layers(self) -> int:
        return len(self.out_bytes)

    # --- knowledge ----------------------------------------------------------------
    def profiled(
        self, profiles: dict[int, tuple[Sequence[float], Sequence[float]]]
    ) -> None:
        """Add members' per-layer (forward, backward) seconds.

        The first call's fastest member becomes the reference (power 1); every
        member's power is its total time over the reference's total (FTPipeHD
        Sec. 4.1's computing power).
        """
        if not profiles:
            return
        totals = {m: sum(f) + sum(b) for m, (f, b) in profiles.items()}
        if not self.reference_forward:
            ref = min(totals, key=lambda m: (totals[m], m))
            self.reference_forward = tuple(max(v, 1e-9) for v in profiles[ref][0])
            self.reference_backward = tuple(max(v, 1e-9) for v in profiles[ref][1])
        reference = self.costs().compute_s(0, self.num_layers)
        for member, total in totals.items():
            self.power[member] = max(total, 1e-9) / reference

    def measured(
        self,
        layout: Layout,
        compute_s: dict[int, float],
        link_bytes_per_s: dict[int, float],
    ) -> None:
        """Update powers from measured per-micro-batch stage times (forward +
        backward) and links from measured bandwidths (member -> its successor).

        A stage holding less than :data:`MIN_MEASURED_SHARE` of the model's
        reference compute is not measured: its time is mostly fixed per-call
        costs, and the ratio would make a slow device look fast. Such a member
        keeps its power (from profiling, every layer timed)."""
        costs = self.costs()
        total = costs.compute_s(0, self.num_layers)
        for rank, member in enumerate(layout.members):
            predicted = costs.compute_s(layout.bounds[rank], layout.bounds[rank + 1])
            seconds = compute_s.get(member, 0.0)
            if seconds > 0 and predicted >= MIN_MEASURED_SHARE * total:
                self.power[member] = seconds / predicted
            rate = link_bytes_per_s.get(member, 0.0)
            if rate > 0:
                successor = layout.members[(rank + 1) % len(layout.members)]
                self.links[(member, successor)] = rate

    def forget(self, member: int) -> None:
        self.power.pop(member, None)
        self.links = {k: v for k, v in self.links.items() if member not in k}

    def costs(self) -> LayerCosts:
        if not self.reference_forward:
            raise PlanError("no member has been profiled yet")
        return LayerCosts(
            self.reference_forward,
            self.reference_backward,
            tuple(self.out_bytes),
            tuple(self.state_bytes),
        )

    def link(self, a: int, b: int) -> float:
        """Bytes/s of the link ``a -> b`` (measured, else assumed)."""
        return self.links.get((a, b), self.link_bandwidth)

    # --- prediction ---------------------------------------------------------------
    def _bandwidths(self, members: Sequence[int]) -> list[float]:
        return [self.link(a, b) for a, b in itertools.pairwise(members)]

    def stage_times(
        self, part: Partition, members: Sequence[int]
    ) -> tuple[list[float], list[float]]:
        """Per-stage forward and backward seconds per micro-batch."""
        costs = self.costs()
        fwd, bwd = [], []
        for s, member in enumerate(members):
            a, b = part.bounds[s], part.bounds[s + 1]
            fwd.append(sum(costs.forward_s[a:b]) * self.power[member])
            bwd.append(sum(costs.backward_s[a:b]) * self.power[member])
        return fwd, bwd

    def step_seconds(self, part: Partition, members: Sequence[int]) -> float:
        """Predicted seconds per step (makespan model; one-way cut transfers)."""
        fwd, bwd = self.stage_times(part, members)
        cuts = [c / 2 for c in part.cut_s]
        return step_s(fwd, bwd, self.micro_batches, cuts, self.schedule)

    def predict(self, layout: Layout) -> tuple[Partition, float]:
        power = [self.power[m] for m in layout.members]
        part = evaluate(
            layout.bounds, self.costs(), power, self._bandwidths(layout.members)
        )
        return part, self.step_seconds(part, layout.members)

    def best(self, members: Sequence[int]) -> tuple[Layout, float]:
        """The DP's layout over ``members`` in that order (or the fixed sizes)."""
        power = [self.power[m] for m in members]
        bw = self._bandwidths(members)
        if self.fixed_sizes is not None:
            if len(self.fixed_sizes) != len(members):
                raise PlanError(
                    f"stage_sizes has {len(self.fixed_sizes)} stages but "
                    f"{len(members)} members are available"
                )
            part = evaluate(boundaries(self.fixed_sizes), self.costs(), power, bw)
        else:
            part = partition(self.costs(), power, bw)
        return Layout(tuple(members), part.bounds), self.step_seconds(part, members)

    def best_subset(
        self, candidates: Sequence[int], required: Sequence[int] = ()
    ) -> tuple[Layout, float]:
        """The best layout over the ``k`` fastest candidates, for the best ``k``.

        FTPipeHD gives every worker a stage; but a device so slow that even one
        layer on it paces the pipeline below what the others reach without it is
        better left out (on standby: it takes over when a member is lost). The
        candidates keep their order; ``required`` ones are always in.
        """
        if self.fixed_sizes is not None:
            return self.best(list(candidates)[: len(self.fixed_sizes)])
        must = [m for m in candidates if m in set(required)]
        others = sorted(
            (m for m in candidates if m not in set(required)),
            key=lambda m: (self.power[m], m),
        )
        found: tuple[Layout, float] | None = None
        for k in range(max(1, len(must)) - len(must), len(others) + 1):
            chosen = set(must) | set(others[:k])
            if not chosen or len(chosen) > self.num_layers:
                continue
            layout, seconds = self.best([m for m in candidates if m in chosen])
            if found is None or seconds < found[1] * (1 - 1e-9):
                found = (layout, seconds)
        if found is None:
            raise PlanError("no member left to train on")
        return found

    # --- decisions ----------------------------------------------------------------
    def decide(
        self,
        current: Layout | None,
        members: Sequence[int],
        steps_left: int,
        required: Sequence[int] = (),
    ) -> Decision:
        """The next segment's layout among ``members`` (see the module docstring).

        A member of the current layout that is no longer among ``members`` (lost)
        forces a re-plan; anything else (new members, changed powers) changes the
        layout only when the gain over ``steps_left`` beats the cost of moving
        layers.
        """
        if not members:
            raise PlanError("no member left to train on")
        layout, seconds = self.best_subset(members, required)
        standby = [m for m in members if m not in layout.members]
        powers = [round(self.power[m], 2) for m in layout.members]
        where = f"members {list(layout.members)}" + (
            f" (standby {standby})" if standby else ""
        )
        if current is None:
            return Decision(
                layout,
                INITIAL,
                seconds,
                f"partition {layout.sizes} over {where} (computing power {powers}), "
                f"predicted {seconds:.3f} s/step",
            )
        if any(m not in members for m in current.members):
            moved = moved_layers(
                current.bounds, current.members, layout.bounds, layout.members
            )
            return Decision(
                layout,
                REPLAN,
                seconds,
                f"members {list(current.members)} -> {list(layout.members)}"
                + (f" (standby {standby})" if standby else "")
                + f": partition {current.sizes} -> {layout.sizes} (computing power "
                f"{powers}), predicted {seconds:.3f} s/step",
                tuple(moved),
            )
        _, now = self.predict(current)
        if not self.repartition or layout == current:
            return Decision(current, KEEP, now, f"{current.sizes} is still the best")
        moved = moved_layers(
            current.bounds, current.members, layout.bounds, layout.members
        )
        moved_bytes = sum(self.state_bytes[layer] for layer in moved)
        bw = min(self._bandwidths(layout.members), default=math.inf)
        cost = moved_bytes / bw if moved_bytes else 0.0
        gain = (now - seconds) * steps_left
        worth = seconds < (1 - self.threshold) * now and gain > cost
        change = (
            f"members {list(current.members)} -> {list(layout.members)}, "
            if layout.members != current.members
            else ""
        )
        reason = (
            f"{change}{current.sizes} predicted {now:.3f} s/step, {layout.sizes} "
            f"{seconds:.3f} s/step (computing power {powers}): gain {gain:.2f} s "
            f"over {steps_left} steps vs {cost:.3f} s to move {len(moved)} layers "
            f"({moved_bytes / 1e6:.2f} MB)"
        )
        if worth:
            return Decision(layout, REPARTITION, seconds, reason, tuple(moved))
        return Decision(current, KEEP, now, reason)
