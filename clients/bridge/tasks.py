"""Phone tasks: one Flower message turned into work for one phone, and back.

A :class:`Task` is built from a Flower train/evaluate ``Message`` (arrays -> FBT1
blob, config -> JSON), lives while the phone downloads, trains and uploads, and ends
in exactly one way: accepted (the reply carries the phone's arrays and metrics),
failed (the reply carries an error), or expired (nothing is relayed; the strategy
sees a straggler). The first outcome is final: once a phone has been told its result
is accepted, nothing it (or anyone) sends later changes that. See
android_client/PROTOCOL.md for the phone's side.
"""

from __future__ import annotations

import math
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from flowerbed import keys
from flowerbed.clients.bridge.codec import (
    Layout,
    TensorCodecError,
    arrayrecord_to_tensors,
    decode_tensors,
    encode_tensors,
    layout_of,
    tensors_to_arrayrecord,
)
from flowerbed.clients.bridge.programs import Program, ProgramError
from flowerbed.replies import ReplyRejected
from flowerbed.replies import check_metrics as check_reply_metrics
from flwr.app import ConfigRecord, Error, Message, MetricRecord, RecordDict
from flwr.app.message_type import MessageType
from flwr.common.constant import ErrorCode

TASK_TYPES = (MessageType.TRAIN, MessageType.EVALUATE)
PHONE_ERROR_CODE = ErrorCode.CLIENT_APP_RAISED_EXCEPTION
"""Error code of replies for failed or malformed phone tasks (the phone is the app)."""


class ProtocolError(Exception):
    """A request the gateway refuses: HTTP status, reason, optional extra JSON.

    ``close`` asks the server to close the connection after the answer (the rest of
    the request cannot be told from the next one).
    """

    def __init__(
        self, status: int, reason: str, *, close: bool = False, **extra: Any
    ) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason
        self.close = close
        self.extra = extra

    def body(self) -> dict[str, Any]:
        return {"error": self.reason, **self.extra}


class TaskBuildError(ValueError):
    """A Flower message that cannot become a phone task; relayed as an error reply."""


@dataclass(frozen=True)
class TaskOutcome:
    """How a task ended: ``accepted`` with tensors and metrics, or ``failed``."""

    status: str
    reason: str = ""
    tensors: list[tuple[str, np.ndarray]] | None = None
    metrics: dict[str, int | float] = field(default_factory=dict)


@dataclass
class Task:
    """One message's work for one phone, with its upload buffer and outcome.

    Thread-safe: HTTP handler threads and the node's relay thread share it.
    """

    kind: str
    config: dict[str, Any]
    arrays_blob: bytes
    layout: Layout
    expires_at: float
    """Monotonic time after which the task is expired."""
    arrays_key: str = keys.ARRAYS
    program: Program | None = None
    """The training program the phone must run it with (protocol revision 2)."""
    task_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    clock: Callable[[], float] = time.monotonic
    outcome: TaskOutcome | None = None
    expired: bool = False
    _upload: bytearray = field(default_factory=bytearray)
    _total: int | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _done: threading.Event = field(default_factory=threading.Event)

    # -- state ----------------------------------------------------------------
    def expires_in_s(self) -> float:
        return max(0.0, self.expires_at - self.clock())

    def is_open(self) -> bool:
        """True while the phone may still work on it (not ended, not expired)."""
        with self._lock:
            return self._open_locked()

    def _open_locked(self) -> bool:
        if self.outcome is not None or self.expired:
            return False
        if self.clock() >= self.expires_at:
            self.expired = True
            self._done.set()
            return False
        return True

    def _require_open(self) -> None:
        if self.outcome is not None and self.outcome.status == "failed":
            raise ProtocolError(400, f"task already failed: {self.outcome.reason}")
        if self.outcome is not None:
            raise ProtocolError(409, "task already accepted; nothing more to send")
        if not self._open_locked() and self.outcome is None:
            raise ProtocolError(404, f"task {self.task_id} expired")

    def wait(self) -> TaskOutcome | None:
        """Block until the task ends; ``None`` when it expired without an outcome."""
        while not self._done.wait(timeout=max(0.05, self.expires_in_s())):
            self.is_open()
        return self.outcome

    def cancel(self) -> None:
        """End the task as expired (gateway shutdown); nothing will be relayed."""
        with self._lock:
            if self.outcome is None:
                self.expired = True
                self._done.set()

    def _finish(self, outcome: TaskOutcome) -> None:
        if self.outcome is not None:  # the first outcome is final
            return
        self.outcome = outcome
        self._upload = bytearray()
        self._done.set()

    @property
    def result_bytes(self) -> int:
        """Exact size of a valid result blob: the arrays sent, same names and shapes."""
        return len(self.arrays_blob)

    def describe(self) -> dict[str, Any]:
        """The task as the phone sees it (``GET /v1/task``)."""
        described = {
            "task_id": self.task_id,
            "type": self.kind,
            "config": self.config,
            "arrays_bytes": len(self.arrays_blob),
            "expires_in_s": round(self.expires_in_s(), 3),
        }
        if self.program is not None:
            described["program"] = self.program.describe()
        return described

    # -- phone actions ------------------------------------------------------------
    def receive_chunk(
        self,
        offset: int,
        total: int,
        data: bytes,
        max_upload_bytes: int,
        chunk_bytes: int,
    ) -> int:
        """Append bytes ``[offset, offset+len(data))`` of a ``total``-byte upload.

        Returns the bytes received so far. Raises :class:`ProtocolError` with 409
        (and ``received``) when ``offset`` is not where the upload stands, 413 (and
        fails the task) when ``total`` exceeds ``max_upload_bytes``, 409 once the
        task is accepted (it stays accepted), 400 otherwise (a ``total`` other than
        :attr:`result_bytes` included: the result has the layout of the arrays
        sent, so its size is known before the first byte).
        """
        with self._lock:
            self._require_open()
            if self.kind != MessageType.TRAIN:
                raise ProtocolError(400, f"{self.kind} tasks upload no tensors")
            if total > max_upload_bytes:
                self._refuse_locked(total, max_upload_bytes)
            if total != self.result_bytes or offset < 0:
                raise ProtocolError(
                    400,
                    f"total must be {self.result_bytes} (the size of the arrays "
                    f"sent) and offset >= 0; got total={total}, offset={offset}",
                )
            if len(data) > chunk_bytes:
                raise ProtocolError(
                    400, f"chunk of {len(data)} bytes exceeds chunk_bytes={chunk_bytes}"
                )
            if offset == 0:
                self._upload = bytearray()
                self._total = total
            elif total != self._total:
                raise ProtocolError(
                    400, f"total={total} differs from the upload's total={self._total}"
                )
            if offset != len(self._upload):
                raise ProtocolError(
                    409,
                    f"offset {offset} is not the bytes received so far",
                    received=len(self._upload),
                )
            if offset + len(data) > total:
                raise ProtocolError(
                    400, f"chunk ends at {offset + len(data)}, past total={total}"
                )
            self._upload += data
            return len(self._upload)

    def refuse_upload(self, total: int, max_upload_bytes: int) -> None:
        """Fail the task for an upload of ``total`` bytes over the limit: 413.

        An accepted task stays accepted (409); a failed one answers 400.
        """
        with self._lock:
            self._require_open()
            self._refuse_locked(total, max_upload_bytes)

    def _refuse_locked(self, total: int, max_upload_bytes: int) -> None:
        reason = f"upload of {total} bytes exceeds the limit of {max_upload_bytes}"
        self._finish(TaskOutcome("failed", reason))
        raise ProtocolError(413, reason)

    def complete(self, metrics: Any) -> TaskOutcome:
        """Validate the upload and metrics; accept, or fail and raise 400.

        The blob is decoded outside the task's lock, so the lock is never held for
        longer than a copy; when two completes race, the first outcome stands.
        """
        with self._lock:
            if self.outcome is not None and self.outcome.status == "accepted":
                return self.outcome  # a repeated complete (lost answer) is harmless
            self._require_open()
            blob = bytes(self._upload) if self._total == len(self._upload) else None
            received = len(self._upload)
        try:
            clean = check_metrics(metrics, train=self.kind == MessageType.TRAIN)
            tensors = None
            if self.kind == MessageType.TRAIN:
                if blob is None:
                    raise TensorCodecError(
                        f"upload incomplete: {received} of {self.result_bytes} bytes"
                    )
                tensors = self._decoded(blob)
            outcome = TaskOutcome("accepted", tensors=tensors, metrics=clean)
        except (TensorCodecError, ValueError) as err:
            outcome = TaskOutcome("failed", f"malformed result: {err}")
        with self._lock:
            if self.outcome is None and not self._open_locked():
                raise ProtocolError(404, f"task {self.task_id} expired")
            self._finish(outcome)
            final = self.outcome
        assert final is not None
        if final.status != "accepted":
            raise ProtocolError(400, final.reason)
        return final

    def _decoded(self, blob: bytes) -> list[tuple[str, np.ndarray]]:
        tensors = decode_tensors(blob, expected=self.layout)
        bad = [n for n, a in tensors if not np.all(np.isfinite(a))]
        if bad:
            raise TensorCodecError(f"tensors {bad} hold NaN or infinite values")
        return tensors

    def fail(self, reason: str) -> TaskOutcome:
        """The phone gives up; the node relays an error reply (409 once accepted)."""
        with self._lock:
            self._require_open()
            outcome = TaskOutcome("failed", f"phone gave up: {reason}")
            self._finish(outcome)
            return outcome


def check_metrics(metrics: Any, train: bool) -> dict[str, int | float]:
    """Validate a phone's metrics as the flowerbed strategies will, before relaying.

    First the JSON shape: an object of finite numbers (no booleans, integers within
    64 bits, what a Flower ``MetricRecord`` holds). Then the strategies' own check,
    :func:`flowerbed.replies.check_metrics` (one implementation for both):
    ``num-examples`` present, finite and > 0 for train tasks (FedAvg weights by
    it), times and step counts finite and non-negative, and whatever ranges the
    strategies enforce. Evaluate tasks may omit ``num-examples`` or report 0.
    Raises ``ValueError`` naming the offending key.
    """
    if not isinstance(metrics, dict):
        raise ValueError("'metrics' must be a JSON object of numbers")
    clean: dict[str, int | float] = {}
    for key, value in metrics.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"metric {key!r} must be a number, got {value!r}")
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"metric {key!r} is not finite")
        if isinstance(value, int) and not -(2**63) <= value < 2**63:
            raise ValueError(f"metric {key!r} does not fit in 64 bits")
        clean[key] = value
    if train and keys.NUM_EXAMPLES not in clean:
        raise ValueError(f"train metrics need '{keys.NUM_EXAMPLES}' > 0")
    if keys.NUM_EXAMPLES in clean:
        try:
            check_reply_metrics(MetricRecord(dict(clean)), keys.NUM_EXAMPLES)
        except ReplyRejected as err:
            if train or err.fault:
                raise ValueError(err.reason) from None
    return clean


def config_to_json(config: ConfigRecord) -> tuple[dict[str, Any], list[str]]:
    """JSON-ready config values, and the keys dropped because they hold bytes."""
    out: dict[str, Any] = {}
    dropped: list[str] = []
    for key, value in config.items():
        items = value if isinstance(value, list) else [value]
        if any(isinstance(v, bytes) for v in items):
            dropped.append(key)
        else:
            out[key] = value
    return out, dropped


def task_from_message(
    message: Message,
    deadline_slack_s: float,
    clock: Callable[[], float] = time.monotonic,
    wall: Callable[[], float] = time.time,
    program_for: Callable[[dict[str, Any]], Program | None] | None = None,
) -> Task:
    """Turn a Flower train/evaluate message into a phone task.

    The task expires when the message's TTL runs out or, when the config sets
    ``deadline-s``, ``deadline_slack_s`` after that deadline (whichever is first).
    ``program_for(config)`` picks the training program the task needs, if any; the
    arrays must then be exactly that program's parameters.
    Raises :class:`TaskBuildError` for other message types, a missing or repeated
    ArrayRecord, non-float32 arrays, arrays that do not match the program, or a
    message already past its TTL.
    """
    meta = message.metadata
    kind = meta.message_type.split(".")[0]
    if kind not in TASK_TYPES:
        raise TaskBuildError(
            f"phones run {' and '.join(TASK_TYPES)} messages, not {meta.message_type!r}"
        )
    content = message.content
    if len(content.array_records) != 1:
        raise TaskBuildError(
            f"expected exactly one ArrayRecord, found {len(content.array_records)}"
        )
    arrays_key, record = next(iter(content.array_records.items()))
    config: dict[str, Any] = {}
    for cfg in content.config_records.values():
        values, dropped = config_to_json(cfg)
        if dropped:
            raise TaskBuildError(f"config keys {dropped} hold bytes; phones take JSON")
        config.update(values)
    tensors = arrayrecord_to_tensors(record)
    try:
        blob = encode_tensors(tensors)
    except TensorCodecError as err:
        raise TaskBuildError(str(err)) from err
    program = program_for(config) if program_for is not None else None
    if program is not None:
        try:
            program.check_arrays(layout_of(tensors))
        except ProgramError as err:
            raise TaskBuildError(str(err)) from err
    expires_in = meta.created_at + meta.ttl - wall()
    deadline = config.get(keys.DEADLINE_S)
    if isinstance(deadline, int | float) and not isinstance(deadline, bool):
        expires_in = min(expires_in, float(deadline) + deadline_slack_s)
    if expires_in <= 0:
        raise TaskBuildError("message TTL ran out before the phone could start")
    return Task(
        kind=kind,
        config=config,
        arrays_blob=blob,
        layout=layout_of(tensors),
        expires_at=clock() + expires_in,
        arrays_key=arrays_key,
        clock=clock,
        program=program,
    )


def reply_for(message: Message, task: Task, outcome: TaskOutcome) -> Message:
    """Flower's reply to ``message``: arrays + metrics, metrics only, or an error."""
    if outcome.status != "accepted":
        return Message(Error(PHONE_ERROR_CODE, outcome.reason), reply_to=message)
    content = RecordDict({keys.METRICS: MetricRecord(dict(outcome.metrics))})
    if outcome.tensors is not None:
        content[task.arrays_key] = tensors_to_arrayrecord(outcome.tensors)
    return Message(content, reply_to=message)


def error_reply(message: Message, reason: str) -> Message:
    """An error reply for a message that never became a task."""
    return Message(Error(PHONE_ERROR_CODE, reason), reply_to=message)
