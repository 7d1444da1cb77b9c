"""Plans: what one member of a job that spans devices does in one segment.

A plan is pure data (no torch): the strategy builds one :class:`MemberPlan` per
member per segment, puts it into the train message's ``ConfigRecord`` with
:meth:`MemberPlan.to_config` and the member reads it back with
:meth:`MemberPlan.from_config`, which checks every field (a plan is input from
the network, so it is validated like any reply).

Fields common to every mode (pipeline, large-batch all-reduce, fused tiles):

- who: ``mode`` (the runner, see :mod:`flowerbed.parallel.modes`), ``job`` (one id
  per job, names the member's on-disk store), ``segment`` (a counter, one per
  attempt), ``rank`` and ``world_size``;
- where: ``host``/``port``, the rendezvous (rank 0's advertised address and the
  port its TCP store listens on; a new port per segment, since a gloo group cannot
  shrink after a loss), ``join_timeout_s`` (how long to wait for every member to
  arrive) and ``timeout_s`` (how long any one collective or send/receive may take
  before the peer counts as lost);
- what: ``start_step`` and ``steps`` (global step numbers; the data order and any
  speed schedule are functions of the global step, so a retried segment repeats
  exactly what it lost), ``batch_size`` (global, per step), ``micro_batches``,
  ``replicate_every`` (R: every R steps each member copies its state to its ring
  successor), the model (``model``, ``model_args``), the data (``dataset``), the
  optimiser (``lr``, ``momentum``, ``weight_decay``) and ``seed``.

Mode-specific shares, unused ones left empty:

- ``partition``: pipeline stage boundaries over the model's top-level layers,
  ``world_size + 1`` increasing integers from 0 to the layer count; rank ``r``
  holds layers ``partition[r] .. partition[r+1] - 1`` (:meth:`MemberPlan.layers`);
- ``sources``: where each layer this member holds comes from at the segment start
  (:class:`LayerSource`);
- ``batch_share``: ``(first, stop)`` sample indices of the global batch (data
  parallel, large batch);
- ``tile``: ``(row0, row1, col0, col1)`` output region (fused tiles);
- ``options``: any further scalar settings a mode needs (str, int, float, bool).
"""

from __future__ import annotations

import ipaddress
import itertools
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

PLAN_KEY = "span-plan"
"""ConfigRecord key holding the JSON plan."""
PLAN_VERSION = 1

SCHEDULES = ("1f1b", "gpipe")
"""Pipeline schedules (torch.distributed.pipelining's Schedule1F1B, ScheduleGPipe)."""

SOURCE_SELF = "self"
"""The member already holds the layer at the wanted step (its own disk store)."""
SOURCE_PEER = "peer"
"""Another member holds it (the old owner, or the owner's successor's replica) and
sends it over torch.distributed at the segment start."""
SOURCE_CENTRAL = "central"
"""The ServerApp's copy (the last segment's replies) travels in the message."""
SOURCE_KINDS = (SOURCE_SELF, SOURCE_PEER, SOURCE_CENTRAL)

_HOSTNAME = re.compile(
    r"^(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?)*$"
)


class PlanError(ValueError):
    """A plan that cannot be carried out; the message names the field and why."""


def check_address(address: object, where: str = "address") -> str:
    """Return ``address`` if it is an IPv4/IPv6 address or a host name.

    Raises :class:`PlanError` naming ``where`` otherwise (empty, wildcard or
    malformed), since peers must be able to connect to it.
    """
    if not isinstance(address, str) or not address.strip():
        raise PlanError(
            f"{where} is missing or empty: each member must advertise the address "
            "its peers reach, e.g. --node-config \"address='192.168.1.12'\""
        )
    text = address.strip()
    try:
        ip = ipaddress.ip_address(text)
    except ValueError:
        if not _HOSTNAME.match(text):
            raise PlanError(
                f"{where} {address!r} is neither an IP address nor a host name"
            ) from None
        return text
    if ip.is_unspecified:
        raise PlanError(
            f"{where} {address!r} is a wildcard; give the address peers connect to"
        )
    return text


@dataclass(frozen=True)
class LayerSource:
    """Where one layer's state (weights and optimiser state) comes from.

    ``kind`` is one of :data:`SOURCE_KINDS`; ``rank`` is the sending member's rank
    in this segment for ``peer`` (-1 otherwise); ``step`` is the global step the
    state belongs to (the segment's ``start_step``).
    """

    layer: int
    kind: str
    rank: int = -1
    step: int = 0

    def check(self, world_size: int) -> None:
        if self.kind not in SOURCE_KINDS:
            raise PlanError(
                f"layer {self.layer} source kind {self.kind!r}; valid: "
                f"{', '.join(SOURCE_KINDS)}"
            )
        if self.kind == SOURCE_PEER and not 0 <= self.rank < world_size:
            raise PlanError(
                f"layer {self.layer} comes from rank {self.rank}, outside 0.."
                f"{world_size - 1}"
            )
        if self.layer < 0 or self.step < 0:
            raise PlanError(f"layer source {self} has a negative layer or step")


@dataclass(frozen=True)
class MemberPlan:
    """One member's plan for one segment (see the module docstring)."""

    mode: str
    job: str
    segment: int
    rank: int
    world_size: int
    host: str
    port: int
    start_step: int
    steps: int
    batch_size: int
    seed: int = 0
    micro_batches: int = 1
    schedule: str = "1f1b"
    replicate_every: int = 0
    join_timeout_s: float = 60.0
    timeout_s: float = 60.0
    model: str = ""
    model_args: dict[str, Any] = field(default_factory=dict)
    dataset: str = ""
    lr: float = 0.05
    momentum: float = 0.0
    weight_decay: float = 0.0
    partition: tuple[int, ...] = ()
    sources: tuple[LayerSource, ...] = ()
    batch_share: tuple[int, ...] = ()
    tile: tuple[int, ...] = ()
    options: dict[str, Any] = field(default_factory=dict)

    # --- derived ------------------------------------------------------------------
    @property
    def layers(self) -> range:
        """Top-level layer indices this member holds (pipeline plans)."""
        if not self.partition:
            return range(0)
        return range(self.partition[self.rank], self.partition[self.rank + 1])

    def layers_of(self, rank: int) -> range:
        """Layer indices rank ``rank`` holds."""
        return range(self.partition[rank], self.partition[rank + 1])

    @property
    def successor(self) -> int:
        """Ring successor: receives this member's replica every R steps."""
        return (self.rank + 1) % self.world_size

    @property
    def predecessor(self) -> int:
        """Ring predecessor: this member holds its replica."""
        return (self.rank - 1) % self.world_size

    @property
    def end_step(self) -> int:
        return self.start_step + self.steps

    def with_changes(self, **changes: Any) -> MemberPlan:
        """A copy with some fields replaced, checked again."""
        plan = replace(self, **changes)
        plan.check()
        return plan

    # --- validation ---------------------------------------------------------------
    def check(self) -> None:
        """Raise :class:`PlanError` naming the first field out of range."""
        ints = {
            "segment": (self.segment, 0),
            "rank": (self.rank, 0),
            "world_size": (self.world_size, 1),
            "port": (self.port, 1),
            "start_step": (self.start_step, 0),
            "steps": (self.steps, 0),
            "batch_size": (self.batch_size, 1),
            "micro_batches": (self.micro_batches, 1),
            "replicate_every": (self.replicate_every, 0),
        }
        for name, (value, low) in ints.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise PlanError(
                    f"plan field {name!r} must be an integer >= {low}, got {value!r}"
                )
        if self.port > 65535:
            raise PlanError(f"plan field 'port' must be <= 65535, got {self.port}")
        if self.rank >= self.world_size:
            raise PlanError(
                f"rank {self.rank} is outside the group of {self.world_size}"
            )
        floats = {
            "join_timeout_s": self.join_timeout_s,
            "timeout_s": self.timeout_s,
            "lr": self.lr,
        }
        for name, positive in floats.items():
            if not _positive(positive):
                raise PlanError(
                    f"plan field {name!r} must be > 0 and finite, got {positive!r}"
                )
        for name, rate in (
            ("momentum", self.momentum),
            ("weight_decay", self.weight_decay),
        ):
            if not _number(rate) or rate < 0:
                raise PlanError(f"plan field {name!r} must be >= 0, got {rate!r}")
        if not isinstance(self.mode, str) or not self.mode:
            raise PlanError("plan field 'mode' is empty")
        if not isinstance(self.job, str) or not re.fullmatch(
            r"[A-Za-z0-9_.-]{1,64}", self.job
        ):
            raise PlanError(
                "plan field 'job' must be 1-64 letters, digits, '.', '_' or '-', "
                f"got {self.job!r}"
            )
        if self.schedule not in SCHEDULES:
            raise PlanError(
                f"schedule {self.schedule!r}; valid choices: {', '.join(SCHEDULES)}"
            )
        check_address(self.host, "rendezvous host")
        if self.partition:
            self._check_partition()
        for source in self.sources:
            source.check(self.world_size)
        if self.batch_share and (
            len(self.batch_share) != 2
            or not 0 <= self.batch_share[0] <= self.batch_share[1] <= self.batch_size
        ):
            raise PlanError(
                f"batch_share {self.batch_share} must be (first, stop) within the "
                f"global batch of {self.batch_size}"
            )
        if self.tile and len(self.tile) != 4:
            raise PlanError(f"tile {self.tile} must be (row0, row1, col0, col1)")

    def _check_partition(self) -> None:
        bounds = self.partition
        if len(bounds) != self.world_size + 1 or bounds[0] != 0:
            raise PlanError(
                f"partition {list(bounds)} must list {self.world_size + 1} stage "
                "boundaries starting at 0"
            )
        if any(not isinstance(b, int) or b <= a for a, b in itertools.pairwise(bounds)):
            raise PlanError(
                f"partition {list(bounds)} must increase strictly: every stage holds "
                "at least one layer"
            )

    # --- wire format ----------------------------------------------------------------
    def to_json(self) -> str:
        data = asdict(self)
        data["version"] = PLAN_VERSION
        return json.dumps(data, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> MemberPlan:
        try:
            data = json.loads(text)
        except (TypeError, ValueError) as err:
            raise PlanError(f"plan is not valid JSON: {err}") from None
        if not isinstance(data, dict):
            raise PlanError("plan JSON must be an object")
        version = data.pop("version", None)
        if version != PLAN_VERSION:
            raise PlanError(
                f"plan version {version!r}; this member understands {PLAN_VERSION} "
                "(update flowerbed on the board or the server)"
            )
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise PlanError(f"plan has unknown fields {unknown}")
        try:
            data["sources"] = tuple(LayerSource(**s) for s in data.get("sources", ()))
            for name in ("partition", "batch_share", "tile"):
                data[name] = tuple(data.get(name, ()))
            plan = cls(**data)
        except TypeError as err:
            raise PlanError(f"malformed plan: {err}") from None
        plan.check()
        return plan

    def to_config(self) -> dict[str, str]:
        """ConfigRecord entries carrying this plan."""
        return {PLAN_KEY: self.to_json()}

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> MemberPlan:
        """Read and check a plan from a ConfigRecord (or any mapping)."""
        if PLAN_KEY not in config:
            raise PlanError(f"the message's config has no {PLAN_KEY!r}: not a span job")
        raw = config[PLAN_KEY]
        if not isinstance(raw, str):
            raise PlanError(
                f"{PLAN_KEY!r} must be a JSON string, got {type(raw).__name__}"
            )
        return cls.from_json(raw)


def _number(value: object) -> bool:
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
    )


def _positive(value: object) -> bool:
    return _number(value) and float(value) > 0  # type: ignore[arg-type]


def boundaries(sizes: Sequence[int]) -> tuple[int, ...]:
    """Stage sizes ``[4, 4, 4]`` -> boundaries ``(0, 4, 8, 12)``."""
    out = [0]
    for size in sizes:
        out.append(out[-1] + int(size))
    return tuple(out)


def stage_sizes(bounds: Sequence[int]) -> list[int]:
    """Boundaries ``(0, 4, 8, 12)`` -> stage sizes ``[4, 4, 4]``."""
    return [b - a for a, b in itertools.pairwise(bounds)]
