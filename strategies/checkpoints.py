"""Atomic checkpoints of a strategy's model and state, verified on load.

A checkpoint is input like a node's reply: :func:`load_checkpoint` refuses arrays
that do not match the model or are not finite, and every ``load_state`` reads its
fields through a :class:`StateReader`, which refuses a field outside its valid
range with one :class:`StateFieldError` naming the field, its value and the range.
:func:`check_writable` tells before round 1 whether a checkpoint can be written.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import math
import os
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from logging import WARNING
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
from flowerbed.replies import (
    MAX_METRIC_MAGNITUDE,
    MAX_NUM_EXAMPLES,
    MAX_STEPS,
    MIN_TIME_S,
)
from flwr.app import (
    ArrayRecord,
    MetricRecord,
)
from flwr.serverapp.strategy import Result
from flwr.supercore import log

CHECKPOINT_FORMAT = "flowerbed-checkpoint/1"
MAX_ROUND = 10**9
"""Largest round (FedBuff: model version) or step count a checkpoint may hold."""
MAX_NODE_ID = 2**64 - 1
"""Largest node id: Flower's node ids are unsigned 64-bit integers."""
MAX_NORM = math.sqrt(sys.float_info.max)
"""Longest update norm a strategy can have recorded: a longer update's sum of
squares is not finite, and such a reply is rejected as NaN/Inf."""
_ADVICE = "delete it to start afresh or point checkpoint_path elsewhere"
_SHOWN_CHARS = 80
"""Longest value shown in an error message (longer ones are cut)."""

T = TypeVar("T")
Histories = tuple[
    dict[int, MetricRecord], dict[int, MetricRecord], dict[int, MetricRecord]
]
"""A Result's train, federated-evaluation and server-evaluation histories."""


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used (corrupt, or from a different run), or a
    checkpoint path where none can be written."""


_MISSING = object()


def _shown(value: object) -> str:
    text = "missing" if value is _MISSING else repr(value)
    return text if len(text) <= _SHOWN_CHARS else text[: _SHOWN_CHARS - 3] + "..."


class StateFieldError(CheckpointError):
    """One field of a checkpoint's state is missing, of the wrong type or out of
    range; the message names the field, its value and what is valid."""

    def __init__(self, field: str, value: object, valid: str) -> None:
        super().__init__(f"{field} is {_shown(value)}; valid: {valid}")
        self.field = field
        self.value = value
        self.valid = valid

    def within(self, section: str) -> StateFieldError:
        """The same error for a state that sits under ``section``."""
        return StateFieldError(f"{section}.{self.field}", self.value, self.valid)


@dataclass(frozen=True)
class Bounds:
    """The valid range of a number in a checkpoint's state; it must be finite too."""

    low: float = -math.inf
    high: float = math.inf
    low_open: bool = False
    """True: ``low`` itself is not valid."""
    whole: bool = False
    """True: a whole number (a JSON integer)."""

    def describe(self, noun: str) -> str:
        """``"<noun> in [low, high]"`` and the like, e.g. ``"finite numbers >= 0"``."""
        if self.whole:
            return f"{noun} in [{int(self.low)}, {int(self.high)}]"
        if self.high == math.inf:
            if self.low == -math.inf:
                return noun
            return f"{noun} {'>' if self.low_open else '>='} {self.low:g}"
        opening = "(" if self.low_open else "["
        return f"{noun} in {opening}{self.low:g}, {self.high:g}]"

    def __str__(self) -> str:
        return self.describe("a whole number" if self.whole else "a finite number")

    def check(self, field: str, value: Any) -> float:
        """``value`` if it is a number in range; StateFieldError otherwise."""
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise StateFieldError(field, value, str(self))
        if self.whole and not isinstance(value, int):
            raise StateFieldError(field, value, str(self))
        if isinstance(value, float) and not math.isfinite(value):
            raise StateFieldError(field, value, str(self))
        too_low = value <= self.low if self.low_open else value < self.low
        if too_low or value > self.high:
            raise StateFieldError(field, value, str(self))
        return value


ROUNDS = Bounds(0, MAX_ROUND, whole=True)
"""Rounds, versions, steps and counts."""
FINITE = Bounds()
"""Any finite number (an optimiser's momentum)."""
NON_NEGATIVE = Bounds(0)
"""Seconds, second moments."""
NODE_IDS = Bounds(0, MAX_NODE_ID, whole=True)
NORMS = Bounds(0, MAX_NORM)
"""Update norms: 0 is a node that sent the model back unchanged."""
STEPS_PER_SECOND = Bounds(0, MAX_STEPS / MIN_TIME_S, low_open=True)
"""Speeds: the most steps a reply may report over the shortest time."""
METRIC_VALUES = Bounds(-MAX_METRIC_MAGNITUDE, MAX_METRIC_MAGNITUDE)
"""Metric values (as :func:`flowerbed.replies.check_metrics` bounds a reply's)."""


def samples_per_second(max_num_examples: float) -> Bounds:
    """Reply weights and sample rates: > 0, and at most the most samples a
    reply may report (``max_num_examples``, or the default ceiling of
    ``samples-per-s``'s) over the shortest time it may report. Every weighting
    stays below: ``num-examples``, ``1/t``, ``num-examples/t``, ``samples-per-s``.
    """
    most = max(max_num_examples, MAX_NUM_EXAMPLES)
    return Bounds(0, most / MIN_TIME_S, low_open=True)


class StateReader(Mapping[str, Any]):
    """A JSON mapping from a checkpoint, read field by field against valid ranges.

    Every reading method raises :class:`StateFieldError` naming the field by its
    path (``influence.weights[2]``), its value and the valid range; it reads
    into new objects, so a ``load_state`` that reads everything before it
    assigns anything loads nothing half. ``where`` is this mapping's own path.
    """

    def __init__(self, data: object, where: str = "") -> None:
        if not isinstance(data, Mapping):
            raise StateFieldError(
                where or "state", data, "a mapping of names to values"
            )
        self._data: Mapping[str, Any] = data
        self.where = where

    @classmethod
    def of(cls, state: Mapping[str, Any]) -> StateReader:
        """``state`` as a reader (itself if it already is one, keeping its path)."""
        return state if isinstance(state, StateReader) else cls(state)

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def _name(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else key

    def _get(self, key: str, valid: str) -> Any:
        if key not in self._data:
            raise StateFieldError(self._name(key), _MISSING, valid)
        return self._data[key]

    def _list(self, key: str, valid: str, item: Callable[[str, Any], T]) -> list[T]:
        value = self._get(key, f"a list of {valid}")
        if not isinstance(value, list):
            raise StateFieldError(self._name(key), value, f"a list of {valid}")
        return [item(f"{self._name(key)}[{i}]", v) for i, v in enumerate(value)]

    def _by_node(self, key: str, item: Callable[[str, Any], T]) -> dict[int, T]:
        section = self.section(key)
        return {
            _whole_key(f"{section.where} key", k, NODE_IDS, "a node id, "): item(
                f"{section.where}.{k}", v
            )
            for k, v in section.items()
        }

    def section(self, key: str) -> StateReader:
        """The mapping under ``key``, as a reader."""
        return StateReader(
            self._get(key, "a mapping of names to values"), self._name(key)
        )

    def number(self, key: str, bounds: Bounds) -> float:
        """A number in ``bounds``."""
        return float(bounds.check(self._name(key), self._get(key, str(bounds))))

    def whole(self, key: str) -> int:
        """A round, model version, step or count: :data:`ROUNDS`."""
        return int(ROUNDS.check(self._name(key), self._get(key, str(ROUNDS))))

    def numbers(self, key: str, bounds: Bounds) -> list[float]:
        """A list of numbers, each in ``bounds``."""
        return self._list(
            key,
            bounds.describe("finite numbers"),
            lambda field, v: float(bounds.check(field, v)),
        )

    def by_node(self, key: str, bounds: Bounds) -> dict[int, float]:
        """``{node id: number in bounds}`` (JSON keys are the ids as text)."""
        return self._by_node(key, lambda field, v: float(bounds.check(field, v)))

    def counts_by_node(self, key: str, bounds: Bounds = ROUNDS) -> dict[int, int]:
        """``{node id: whole number in bounds}``."""
        return self._by_node(key, lambda field, v: int(bounds.check(field, v)))

    def rows(self, key: str, *columns: Bounds | type[bool]) -> list[tuple[Any, ...]]:
        """A list of rows, each a list with one value per column: a number in
        the column's :class:`Bounds`, or a true/false for ``bool``."""
        valid = ", ".join("true or false" if c is bool else str(c) for c in columns)

        def row(field: str, value: Any) -> tuple[Any, ...]:
            if not isinstance(value, list) or len(value) != len(columns):
                raise StateFieldError(field, value, f"a list of [{valid}]")
            return tuple(
                _column(f"{field}[{j}]", v, c)
                for j, (v, c) in enumerate(zip(value, columns, strict=True))
            )

        return self._list(key, f"[{valid}]", row)

    def array(
        self, key: str, shape: tuple[int, ...] | None, bounds: Bounds = FINITE
    ) -> np.ndarray:
        """A (nested) list of numbers in ``bounds`` as a float64 array of
        ``shape`` (any shape when None)."""
        valid = bounds.describe("finite numbers") + (
            "" if shape is None else f", shape {shape}"
        )
        value = self._get(key, valid)
        try:
            array = np.asarray(value, dtype=np.float64)
        except (TypeError, ValueError, OverflowError):
            raise StateFieldError(self._name(key), value, valid) from None
        with np.errstate(invalid="ignore"):
            inside = np.isfinite(array) & (array <= bounds.high)
            inside &= array > bounds.low if bounds.low_open else array >= bounds.low
        if (shape is not None and array.shape != shape) or not inside.all():
            raise StateFieldError(self._name(key), value, valid)
        return array

    def histories(self) -> Histories:
        """A Result's three metric histories (:func:`result_histories`)."""
        return (
            self.history("train_metrics"),
            self.history("evaluate_metrics"),
            self.history("server_metrics"),
        )

    def history(self, key: str) -> dict[int, MetricRecord]:
        """``{round: MetricRecord}`` (see :func:`metric_history_to_json`)."""
        section = self.section(key)
        valid = "a record of numbers or lists of numbers"
        history: dict[int, MetricRecord] = {}
        for r, record in section.items():
            server_round = _whole_key(f"{section.where} key", r, ROUNDS, "a round, ")
            try:
                if not isinstance(record, dict):
                    raise TypeError(record)
                history[server_round] = MetricRecord(record)
            except (TypeError, ValueError):
                raise StateFieldError(f"{section.where}.{r}", record, valid) from None
        return history


def _column(field: str, value: Any, column: Bounds | type[bool]) -> Any:
    if column is bool:
        if not isinstance(value, bool):
            raise StateFieldError(field, value, "true or false")
        return value
    assert isinstance(column, Bounds)
    return column.check(field, value)


def _whole_key(field: str, key: str, bounds: Bounds, what: str) -> int:
    """A JSON key that holds a whole number (a node id, a round) as that number."""
    digits = len(str(int(bounds.high)))
    if not (
        isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= digits
    ):
        raise StateFieldError(field, key, what + str(bounds))
    return int(bounds.check(field, int(key)))


def _digest(arrays: Mapping[str, np.ndarray], state_json: bytes) -> str:
    h = hashlib.sha256(state_json)
    for name in sorted(arrays):
        value = np.ascontiguousarray(arrays[name])
        h.update(name.encode())
        h.update(str(value.dtype).encode())
        h.update(str(value.shape).encode())
        h.update(value.tobytes())
    return h.hexdigest()


def _target(path: Path) -> Path:
    """The file a write to ``path`` replaces: a symbolic link's target (the link
    stays a link), otherwise ``path`` itself."""
    if not path.is_symlink():
        return path
    try:
        return path.resolve()
    except (OSError, RuntimeError) as err:  # a loop of links
        raise CheckpointError(
            f"checkpoint {path} is a symbolic link that cannot be followed ({err})"
        ) from None


def _write_error(path: Path, target: Path, err: OSError, what: str) -> CheckpointError:
    """One line naming the checkpoint path and why the OS refused."""
    where = str(path) if target == path else f"{path} (a link to {target})"
    reason = str(err)
    if isinstance(err, FileExistsError | NotADirectoryError):
        blocker = next(
            (p for p in target.parents if p.exists() and not p.is_dir()), None
        )
        if blocker is not None:
            reason = f"{blocker} is a file, not a folder"
    return CheckpointError(f"checkpoint {where} {what}: {reason}")


def check_writable(path: str | Path) -> None:
    """Create and remove a temporary file where ``path`` will be written.

    Raises
    ------
    CheckpointError
        In one line naming the path and the OS error (a read-only folder, a
        parent that is a file, a full disk) or when ``path`` is a folder.
    """
    path = Path(path)
    target = _target(path)
    if target.is_dir():
        raise CheckpointError(
            f"checkpoint {path} cannot be written: it is a folder, not a file"
        )
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(
            prefix=target.name + ".", suffix=".tmp", dir=target.parent
        )
        os.close(fd)
        os.unlink(tmp)
    except OSError as err:
        raise _write_error(
            path, target, err, "cannot be written (choose another checkpoint_path)"
        ) from None


def save_checkpoint(
    path: str | Path, arrays: Mapping[str, np.ndarray], state: Mapping[str, Any]
) -> None:
    """Write arrays and JSON-able state atomically (temp file, fsync, os.replace).

    A symbolic link at ``path`` is written through: its target is replaced in the
    target's folder and the link stays.

    Raises
    ------
    CheckpointError
        In one line naming the path and the OS error when the file cannot be
        written; the checkpoint there before, if any, is left as it was.
    """
    path = Path(path)
    target = _target(path)
    state_json = json.dumps(
        {"format": CHECKPOINT_FORMAT, "state": state}, sort_keys=True
    ).encode()
    header = json.dumps(
        {"names": list(arrays), "sha256": _digest(arrays, state_json)}
    ).encode()
    try:
        _replace(target, state_json, header, arrays)
    except OSError as err:
        raise _write_error(
            path,
            target,
            err,
            "could not be written (the checkpoint there before, if any, is unchanged)",
        ) from None


def _replace(
    target: Path, state_json: bytes, header: bytes, arrays: Mapping[str, np.ndarray]
) -> None:
    """Write the checkpoint to a temporary file beside ``target``, then rename it."""
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(target)
    fd, tmp = tempfile.mkstemp(
        prefix=target.name + ".", suffix=".tmp", dir=target.parent
    )
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
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(target.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def remove_stale_temporaries(path: str | Path) -> list[Path]:
    """Delete temporary files a killed :func:`save_checkpoint` left beside ``path``
    (beside its target when ``path`` is a symbolic link).

    They are named ``<name>.<random>.tmp``; the checkpoint itself is only ever
    replaced whole, so they hold nothing worth keeping. One that cannot be
    deleted is logged and left. Returns what was removed.
    """
    path = _target(Path(path))
    removed = []
    for stale in path.parent.glob("*.tmp"):
        if not stale.name.startswith(path.name + "."):
            continue
        try:
            stale.unlink(missing_ok=True)
        except OSError as err:
            log(WARNING, "cannot remove stale checkpoint temporary file: %s", err)
            continue
        removed.append(stale)
    if removed:
        log(WARNING, "removed %d stale checkpoint temporary file(s)", len(removed))
    return removed


def _checkpoint_error(path: Path, what: str) -> CheckpointError:
    return CheckpointError(
        f"checkpoint {path} is unreadable or corrupt ({what}); {_ADVICE}"
    )


def load_checkpoint(
    path: str | Path, reference: ArrayRecord
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Read a checkpoint whole, verify it, and return ``(arrays, state)``.

    Raises
    ------
    CheckpointError
        When the file is unreadable or corrupt, or its arrays do not match
        ``reference`` (names, shapes, dtypes) or hold NaN or infinite values.
        Nothing is returned half-loaded. The state's fields are checked by the
        strategy that reads them (:class:`StateReader`).
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
    for name, value in arrays.items():
        if value.dtype.kind in "fc" and not np.isfinite(value).all():
            bad = np.flatnonzero(~np.isfinite(value))
            at = tuple(int(i) for i in np.unravel_index(bad[0], value.shape))
            raise CheckpointError(
                f"checkpoint {path}: array {name!r} holds {value[at]} at {at} "
                f"({bad.size} value(s) not finite); valid: finite numbers; {_ADVICE}"
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


def result_histories(result: Result) -> dict[str, Any]:
    """A Result's metric histories as JSON-able data, by their checkpoint keys
    (read back by :meth:`StateReader.histories`)."""
    return {
        "train_metrics": metric_history_to_json(result.train_metrics_clientapp),
        "evaluate_metrics": metric_history_to_json(result.evaluate_metrics_clientapp),
        "server_metrics": metric_history_to_json(result.evaluate_metrics_serverapp),
    }


def restore_histories(result: Result, histories: Histories) -> None:
    """Set the metric histories :meth:`StateReader.histories` read on ``result``."""
    (
        result.train_metrics_clientapp,
        result.evaluate_metrics_clientapp,
        result.evaluate_metrics_serverapp,
    ) = histories


def read_checkpoint(
    path: Path, strategy: str, reference: ArrayRecord
) -> tuple[dict[str, np.ndarray], dict[str, Any]] | None:
    """:func:`load_checkpoint` of ``path`` after removing stale temporaries;
    None when there is no file. Raises CheckpointError when another strategy
    than ``strategy`` (a class name) wrote it."""
    remove_stale_temporaries(path)
    if not path.exists():
        return None
    arrays, saved = load_checkpoint(path, reference)
    if saved.get("strategy") != strategy:
        raise CheckpointError(
            f"checkpoint {path} was written by {saved.get('strategy')!r}, "
            f"not {strategy!r}; {_ADVICE}"
        )
    return arrays, saved
