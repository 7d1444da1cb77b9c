"""Training programs the gateway serves to phones (protocol revision 2).

A program is an ExecuTorch ``.pte`` written by ``flowerbed export-android`` with its
metadata beside it (``<file>.pte.json``): model name, the parameters in the order the
program takes them (name and shape), the program's SHA-256 and the oldest ExecuTorch
runtime that can run it. The gateway checks the hash when it loads the program,
describes it in every task that needs it, and serves its bytes (resumable with
``Range``) at ``/v1/program/<sha256>``. A phone downloads it once, checks the hash and
caches it by hash, so a new program reaches every phone without ``adb push`` and a
phone can never train an old program against a new model.

Before a task is offered, the message's arrays are checked against the program's
parameters; a mismatch becomes an error reply to Flower naming the arrays at fault.
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
        # What the app needs to feed the program: one sample's shape, largest batch.
        for key in ("input", "max_batch_size"):
            if key in self.metadata:
                described[key] = self.metadata[key]
        return described

    def check_arrays(self, layout: Layout) -> None:
        """Raise :class:`ProgramError` unless ``layout`` is exactly its parameters."""
        want = dict(self.parameters)
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
        layout: Layout = [
            (str(p["name"]), tuple(int(d) for d in p["shape"])) for p in params
        ]
    except (KeyError, TypeError, ValueError) as err:
        raise ProgramError(
            f"{meta_file}: needs model, sha256, min_runtime (dotted version) and "
            f"parameters [{{name, shape}}]: {err}"
        ) from err
    if declared != digest:
        raise ProgramError(
            f"{pte} has sha256 {digest}, its metadata says {declared}: the program "
            "changed after export; export it again"
        )
    return Program(name, digest, data, layout, min_runtime, meta)
