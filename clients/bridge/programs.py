"""Training programs the gateway serves to phones (protocol revision 2).

A program is an ExecuTorch ``.pte`` written by ``flowerbed export-android`` with its
metadata beside it (``<file>.pte.json``): model name, the parameters in the order the
program takes them (name and shape), the state it carries (batch-norm running
statistics, also name and shape), its training and evaluation methods, the program's
SHA-256 and the oldest ExecuTorch runtime that can run it. The gateway checks the
hash when it loads the program, describes it in every task that needs it, and serves
its bytes (resumable with ``Range``) at ``/v1/program/<sha256>``. A phone downloads it
once, checks the hash and caches it by hash, so a new program reaches every phone
without ``adb push`` and a phone can never train an old program against a new model.

Before a task is offered, the message's arrays are checked against the program's
parameters and state; a mismatch becomes an error reply to Flower naming the arrays
at fault.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flowerbed.clients.bridge.codec import Layout

PROGRAM_CONFIG_KEY = "program"
"""Config key naming the program a task needs (absent: the gateway's default)."""
METADATA_SUFFIX = ".json"
"""The metadata file of ``model.pte`` is ``model.pte.json``."""
_VERSION_RE = re.compile(r"^\d+(\.\d+){0,3}$")


class ProgramError(ValueError):
    """A program or its metadata that cannot be served; the message says why."""


def metadata_path(program: str | Path) -> Path:
    """Where the metadata of ``program`` lives: ``<program>.json``."""
    path = Path(program)
    return path.with_name(path.name + METADATA_SUFFIX)


def version_tuple(version: str) -> tuple[int, ...]:
    """``"1.5.1"`` -> ``(1, 5, 1)``; raises ValueError for anything else."""
    if not _VERSION_RE.match(version):
        raise ValueError(f"version {version!r} is not dotted numbers such as 1.5.1")
    return tuple(int(part) for part in version.split("."))


@dataclass(frozen=True)
class Program:
    """One training program and what a phone needs to know about it."""

    name: str
    sha256: str
    data: bytes = field(repr=False)
    parameters: Layout
    """Parameter names and shapes, in the program's own order."""
    min_runtime: str
    """Oldest ExecuTorch runtime version that runs it (e.g. ``"1.5.1"``)."""
    metadata: dict[str, Any] = field(default_factory=dict, repr=False)
    state: Layout = field(default_factory=list)
    """Arrays the training method carries from step to step (batch-norm running
    statistics), in the program's order; sent and returned with the parameters."""
    evaluate_method: str | None = None
    """The method that evaluates without a backward pass (None: an older export)."""

    @property
    def url(self) -> str:
        return f"/v1/program/{self.sha256}"

    def describe(self) -> dict[str, Any]:
        """The program as a task shows it to a phone."""
        described: dict[str, Any] = {
            "name": self.name,
            "sha256": self.sha256,
            "bytes": len(self.data),
            "min_runtime": self.min_runtime,
            "url": self.url,
            "parameters": [
                {"name": name, "shape": list(shape)} for name, shape in self.parameters
            ],
        }
        if self.state:
            described["state"] = [
                {"name": name, "shape": list(shape)} for name, shape in self.state
            ]
        if self.evaluate_method is not None:
            described["evaluate_method"] = self.evaluate_method
        # What the app needs to feed the program: one sample's shape, batch bounds.
        for key in ("input", "min_batch_size", "max_batch_size"):
            if key in self.metadata:
                described[key] = self.metadata[key]
        return described

    def check_arrays(self, layout: Layout) -> None:
        """Raise :class:`ProgramError` unless ``layout`` is exactly its parameters
        and state."""
        want = dict(self.parameters + self.state)
        got = dict(layout)
        missing = [n for n in want if n not in got]
        extra = [n for n in got if n not in want]
        shapes = [
            f"{n} {list(got[n])} (program: {list(want[n])})"
            for n in want
            if n in got and tuple(got[n]) != tuple(want[n])
        ]
        if missing or extra or shapes:
            raise ProgramError(
                f"arrays do not match program {self.name!r} "
                f"(sha256 {self.sha256[:12]}): missing {missing or 'none'}, "
                f"unexpected {extra or 'none'}, other shapes {shapes or 'none'}"
            )


def load_program(path: str | Path) -> Program:
    """Read a ``.pte`` and its ``.pte.json`` metadata; check the hash and fields.

    Raises
    ------
    ProgramError
        If a file is missing or unreadable, the metadata lacks a field or has the
        wrong type, or the program's SHA-256 differs from the metadata's (the file
        changed after export).
    """
    pte = Path(path).expanduser()
    meta_file = metadata_path(pte)
    try:
        data = pte.read_bytes()
        meta = json.loads(meta_file.read_text(encoding="utf-8"))
    except OSError as err:
        raise ProgramError(
            f"cannot read program {pte} or its metadata {meta_file.name}: "
            f"{err.strerror} (export-android writes both)"
        ) from err
    except ValueError as err:
        raise ProgramError(f"{meta_file} is not JSON: {err}") from err
    if not isinstance(meta, dict):
        raise ProgramError(f"{meta_file} must hold a JSON object")
    digest = hashlib.sha256(data).hexdigest()
    try:
        name = meta["model"]
        params = meta["parameters"]
        min_runtime = meta["min_runtime"]
        declared = meta["sha256"]
        if not isinstance(name, str) or not isinstance(declared, str):
            raise TypeError("model and sha256 must be strings")
        version_tuple(min_runtime)
        layout = _layout(params)
        state = _layout(meta.get("state", []))
        evaluate = meta.get("evaluate_method")
        if evaluate is not None and not isinstance(evaluate, str):
            raise TypeError("evaluate_method must be a string")
        for key in ("min_batch_size", "max_batch_size"):
            if key in meta and (type(meta[key]) is not int or meta[key] < 1):
                raise TypeError(f"{key} must be an integer >= 1")
    except (KeyError, TypeError, ValueError) as err:
        raise ProgramError(
            f"{meta_file}: needs model, sha256, min_runtime (dotted version) and "
            f"parameters [{{name, shape}}], optionally state [{{name, shape}}], "
            f"evaluate_method and integer batch sizes: {err}"
        ) from err
    clash = sorted({n for n, _ in layout} & {n for n, _ in state})
    if clash or len({n for n, _ in layout + state}) != len(layout + state):
        raise ProgramError(
            f"{meta_file}: every parameter and state name must appear once "
            f"({clash or 'a name is repeated'})"
        )
    if declared != digest:
        raise ProgramError(
            f"{pte} has sha256 {digest}, its metadata says {declared}: the program "
            "changed after export; export it again"
        )
    return Program(name, digest, data, layout, min_runtime, meta, state, evaluate)


def _layout(entries: Any) -> Layout:
    """``[{name, shape}, ...]`` -> ``[(name, shape), ...]``; raises TypeError or
    ValueError for anything else."""
    if not isinstance(entries, list):
        raise TypeError("parameters and state are lists")
    return [(str(p["name"]), tuple(int(d) for d in p["shape"])) for p in entries]
