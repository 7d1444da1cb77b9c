"""A member's on-disk store of layer states: its own snapshots and its replicas.

Flower starts a fresh ClientApp process for every message, so whatever a member
must still hold when the next segment starts lives on its disk, under
``<root>/<job>/``. Three kinds of entries, each a state at one global step:

- ``own``: the layers the member held, saved at every replication step and at
  the segment's end (FTPipeHD's local copy);
- ``replica``: its ring predecessor's layers, received every R steps over
  torch.distributed (FTPipeHD's neighbour replica);
- ``moved``: layers received at a segment start.

A state is a flat mapping of full-model names (``"3.weight"``, as in the whole
model's ``state_dict``) to tensors, with the optimiser's state under
``"momentum:" + name``. Files are written atomically (temporary file, then
rename), so a board that loses power mid-write keeps the previous entry.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

OWN = "own"
REPLICA = "replica"
MOVED = "moved"
KINDS = (OWN, REPLICA, MOVED)
MOMENTUM_PREFIX = "momentum:"
_NAME = re.compile(r"^(own|replica|moved)-s(\d+)-l(\d+)-(\d+)\.pt$")

State = dict[str, torch.Tensor]


def layer_of(name: str) -> int:
    """Top-level layer index of a full-model state name (``"3.0.weight"`` -> 3)."""
    base = name[len(MOMENTUM_PREFIX) :] if name.startswith(MOMENTUM_PREFIX) else name
    head = base.split(".", 1)[0]
    if not head.isdigit():
        raise ValueError(
            f"state name {name!r} does not start with a layer index: the model must "
            "be an nn.Sequential whose top-level children are the layers"
        )
    return int(head)


def split_by_layer(state: Mapping[str, torch.Tensor]) -> dict[int, State]:
    """Group a state's entries by top-level layer."""
    out: dict[int, State] = {}
    for name, tensor in state.items():
        out.setdefault(layer_of(name), {})[name] = tensor
    return out


@dataclass(frozen=True)
class Entry:
    kind: str
    step: int
    first: int
    stop: int
    path: Path

    @property
    def layers(self) -> range:
        return range(self.first, self.stop)


class LayerStore:
    """Layer states of one job on this member's disk (see the module docstring)."""

    def __init__(self, root: str | os.PathLike[str], job: str) -> None:
        self.dir = Path(root) / job
        self.dir.mkdir(parents=True, exist_ok=True)

    def entries(self) -> list[Entry]:
        found = []
        for path in self.dir.iterdir():
            match = _NAME.match(path.name)
            if match:
                kind, step, first, stop = match.groups()
                found.append(Entry(kind, int(step), int(first), int(stop), path))
        return sorted(found, key=lambda e: (e.step, e.kind, e.first))

    def save(
        self, kind: str, step: int, layers: range, state: Mapping[str, torch.Tensor]
    ) -> Path:
        """Write ``state`` (the layers ``layers``) as ``kind`` at ``step``."""
        if kind not in KINDS:
            raise ValueError(f"kind {kind!r}; valid: {', '.join(KINDS)}")
        stray = sorted({layer_of(n) for n in state} - set(layers))
        if stray:
            raise ValueError(f"state holds layers {stray} outside {layers}")
        path = self.dir / f"{kind}-s{step}-l{layers.start}-{layers.stop}.pt"
        fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as fh:
                torch.save({k: v.detach().clone() for k, v in state.items()}, fh)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return path

    def holds(self, layer: int, step: int) -> bool:
        return any(e.step == step and layer in e.layers for e in self.entries())

    def load(self, layers: Iterable[int], step: int) -> State:
        """The entries of ``layers`` at ``step`` (own copies preferred).

        Raises ``KeyError`` naming the layers this member does not hold at ``step``.
        """
        wanted = set(layers)
        out: State = {}
        order = {OWN: 0, MOVED: 1, REPLICA: 2}
        for entry in sorted(self.entries(), key=lambda e: order[e.kind]):
            if entry.step != step or not wanted & set(entry.layers):
                continue
            saved = torch.load(entry.path, weights_only=True)
            for name, tensor in saved.items():
                layer = layer_of(name)
                if layer in wanted and name not in out:
                    out[name] = tensor
            wanted -= set(entry.layers)
            if not wanted:
                break
        if wanted:
            raise KeyError(
                f"this member holds no state of layers {sorted(wanted)} at step {step}"
            )
        return out

    def consistent_steps(self) -> list[int]:
        """Steps at which both an own and a replica entry exist, newest last."""
        kinds: dict[int, set[str]] = {}
        for entry in self.entries():
            kinds.setdefault(entry.step, set()).add(entry.kind)
        return sorted(s for s, k in kinds.items() if {OWN, REPLICA} <= k)

    def prune(self, keep_steps: Iterable[int]) -> None:
        """Delete every entry whose step is not in ``keep_steps``."""
        keep = set(keep_steps)
        for entry in self.entries():
            if entry.step not in keep:
                entry.path.unlink(missing_ok=True)

    def newest_steps(self, count: int) -> list[int]:
        """The ``count`` newest steps with any entry."""
        steps = sorted({e.step for e in self.entries()})
        return steps[-count:] if count > 0 else []
