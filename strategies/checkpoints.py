"""Atomic checkpoints of a strategy's model and state, verified on load."""

from __future__ import annotations

import hashlib
import io
import json
import os
import tempfile
import zipfile
from collections.abc import Mapping
from logging import WARNING
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import (
    ArrayRecord,
    MetricRecord,
)
from flwr.supercore import log

CHECKPOINT_FORMAT = "flowerbed-checkpoint/1"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used (corrupt, or from a different run)."""


def _digest(arrays: Mapping[str, np.ndarray], state_json: bytes) -> str:
    h = hashlib.sha256(state_json)
    for name in sorted(arrays):
        value = np.ascontiguousarray(arrays[name])
        h.update(name.encode())
        h.update(str(value.dtype).encode())
        h.update(str(value.shape).encode())
        h.update(value.tobytes())
    return h.hexdigest()


def save_checkpoint(
    path: str | Path, arrays: Mapping[str, np.ndarray], state: Mapping[str, Any]
) -> None:
    """Write arrays and JSON-able state atomically (temp file, fsync, os.replace)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(path)
    state_json = json.dumps(
        {"format": CHECKPOINT_FORMAT, "state": state}, sort_keys=True
    ).encode()
    header = json.dumps(
        {"names": list(arrays), "sha256": _digest(arrays, state_json)}
    ).encode()
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            with zipfile.ZipFile(f, "w", compression=zipfile.ZIP_STORED) as z:
                z.writestr("state.json", state_json)
                z.writestr("header.json", header)
                for i, value in enumerate(arrays.values()):
                    buf = io.BytesIO()
                    np.save(buf, np.ascontiguousarray(value), allow_pickle=False)
                    z.writestr(f"arrays/{i}.npy", buf.getvalue())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def remove_stale_temporaries(path: str | Path) -> list[Path]:
    """Delete temporary files a killed :func:`save_checkpoint` left beside ``path``.

    They are named ``<name>.<random>.tmp``; the checkpoint itself is only ever
    replaced whole, so they hold nothing worth keeping. Returns what was removed.
    """
    path = Path(path)
    removed = []
    for stale in path.parent.glob("*.tmp"):
        if not stale.name.startswith(path.name + "."):
            continue
        stale.unlink(missing_ok=True)
        removed.append(stale)
    if removed:
        log(WARNING, "removed %d stale checkpoint temporary file(s)", len(removed))
    return removed


def _checkpoint_error(path: Path, what: str) -> CheckpointError:
    return CheckpointError(
        f"checkpoint {path} is unreadable or corrupt ({what}); delete it to start "
        "afresh or point checkpoint_path elsewhere"
    )


def load_checkpoint(
    path: str | Path, reference: ArrayRecord
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Read a checkpoint whole, verify it, and return ``(arrays, state)``.

    Raises
    ------
    CheckpointError
        When the file is unreadable or corrupt, or its arrays do not match
        ``reference`` (names, shapes, dtypes). Nothing is returned half-loaded.
    """
    path = Path(path)
    try:
        with zipfile.ZipFile(path) as z:
            state_json = z.read("state.json")
            header = json.loads(z.read("header.json"))
            if not (
                isinstance(header, dict)
                and isinstance(header.get("names"), list)
                and all(isinstance(n, str) for n in header["names"])
                and isinstance(header.get("sha256"), str)
            ):
                raise _checkpoint_error(path, "header.json is not {names, sha256}")
            arrays = {
                name: np.load(io.BytesIO(z.read(f"arrays/{i}.npy")), allow_pickle=False)
                for i, name in enumerate(header["names"])
            }
        payload = json.loads(state_json)
    except CheckpointError:
        raise
    except (OSError, KeyError, ValueError, TypeError, zipfile.BadZipFile) as err:
        raise _checkpoint_error(path, str(err)) from err
    if not isinstance(payload, dict) or not isinstance(payload.get("state"), dict):
        raise _checkpoint_error(path, "state.json is not {format, state}")
    if payload.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(
            f"checkpoint {path} has format {payload.get('format')!r}, "
            f"expected {CHECKPOINT_FORMAT!r}"
        )
    if _digest(arrays, state_json) != header.get("sha256"):
        raise CheckpointError(f"checkpoint {path} fails its checksum: corrupt")
    expected = {n: (tuple(a.shape), a.dtype) for n, a in reference.items()}
    found = {n: (tuple(a.shape), str(a.dtype)) for n, a in arrays.items()}
    if expected != found:
        raise CheckpointError(
            f"checkpoint {path} holds arrays {found}, but the model has {expected}: "
            "it belongs to a different model"
        )
    return arrays, payload["state"]


def metricrecord_to_json(record: MetricRecord) -> dict[str, Any]:
    """A MetricRecord as a plain dict (values are numbers or lists of numbers)."""
    return dict(record)


def metric_history_to_json(history: Mapping[int, MetricRecord]) -> dict[str, Any]:
    """``{round: MetricRecord}`` as JSON-able data."""
    return {str(r): metricrecord_to_json(m) for r, m in history.items()}


def metric_history_from_json(data: Mapping[str, Any]) -> dict[int, MetricRecord]:
    """Inverse of :func:`metric_history_to_json`."""
    return {int(r): MetricRecord(m) for r, m in data.items()}
