"""Round records of a simulated run, taken by watching the Grid.

``RecordingGrid`` wraps any Flower ``Grid`` (the in-process engine, or Flower's own
grid under ``flwr run``) and notes every train message pushed and every reply pulled;
``RunRecorder.evaluate_fn`` -- called by Flower strategies after each round -- closes
the round: central accuracy on the held-out test set, virtual time, participants,
failures, stragglers and energy. It never changes what the strategy sees.

Virtual time: on the in-process engine, its clock. On a grid without a virtual clock
(Flower's simulation engine), each round is charged its slowest successful reply's
reported duration, i.e. what a round that waits for all its nodes costs.
"""

from __future__ import annotations

import functools
import re
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np
import torch
from flowerbed import keys
from flowerbed.arrays import record_views, torch_state_dict
from flowerbed.clients.training import evaluate, onednn, scores
from flowerbed.data import Dataset
from flowerbed.grid import GridWrapper
from flowerbed.models import build_model
from flowerbed.sims.engine import VirtualClock, metric_records, reply_duration
from flowerbed.sims.grouped import evaluation_logits
from flowerbed.sims.kernel_inference import kernel_pass
from flwr.app import ArrayRecord, Message, MetricRecord
from flwr.serverapp import Grid
from torch import nn


@dataclass
class RoundRecord:
    """What happened in one round (or, for asynchronous strategies, model version)."""

    round: int
    virtual_time_s: float
    accuracy: float
    loss: float
    participants: list[int]
    failed: list[int]
    stragglers: int
    energy_j: float
    wall_time_s: float


@dataclass
class _Sent:
    node_id: int
    round: int


@dataclass
class _Bucket:
    participants: list[int] = field(default_factory=list)
    """Partition ids of the nodes whose update arrived (the same on every engine)."""
    failed: list[int] = field(default_factory=list)
    """Node ids (the grid's, as Flower's log names them) of the failed tasks."""
    energy_j: float = 0.0
    slowest_s: float = 0.0


@dataclass
class FailureKind:
    """Failed train tasks of one kind: how many, on which nodes, in which rounds.

    ``kind`` is the error's reason with its numbers replaced by ``#``; the
    example is the first such failure, in full. Node ids are the grid's
    (``message.metadata.dst_node_id``): the ids Flower's own log names.
    """

    kind: str
    example_node: int
    example_round: int
    example_reason: str
    tasks: int = 0
    nodes: Counter[int] = field(default_factory=Counter)
    """Failed tasks of each node."""
    rounds: set[int] = field(default_factory=set)

    def add(self, node: int, round_: int) -> None:
        self.tasks += 1
        self.nodes[node] += 1
        self.rounds.add(round_)

    def as_dict(self) -> dict[str, object]:
        """The kind as results.json's ``errors`` hold it."""
        return {
            "kind": self.kind,
            "count": self.tasks,
            "nodes": {str(n): c for n, c in sorted(self.nodes.items())},
            "rounds": sorted(self.rounds),
            "example": {
                "node": self.example_node,
                "round": self.example_round,
                "reason": self.example_reason,
            },
        }


class RecordingGrid(GridWrapper):
    """A transparent Grid wrapper that reports pushes and replies to a recorder."""

    def __init__(self, inner: Grid, recorder: RunRecorder) -> None:
        super().__init__(inner)
        self.recorder = recorder

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        messages = list(messages)
        ids = list(self.inner.push_messages(messages))
        for message, message_id in zip(messages, ids, strict=True):
            self.recorder.sent(message_id, message)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        replies = list(self.inner.pull_messages(message_ids))
        for reply in replies:
            self.recorder.received(reply)
        return replies


class RunRecorder:
    """Collects :class:`RoundRecord` s; see the module docstring."""

    def __init__(
        self,
        grid: Grid,
        model_name: str,
        data: Dataset,
        on_round: Callable[[RoundRecord], None] | None = None,
    ) -> None:
        self.grid = RecordingGrid(grid, self)
        self.model_name = model_name
        self.data = data
        self.on_round = on_round
        self.records: list[RoundRecord] = []
        self.initial_accuracy = float("nan")
        self._sent: dict[str, _Sent] = {}
        self._bucket = _Bucket()
        self._round = 1
        self._virtual_s = 0.0
        self._wall_start = time.monotonic()
        self.errors: dict[str, FailureKind] = {}
        """Failed train tasks by kind of error, in the order each kind first
        failed."""

    def sent(self, message_id: str, message: Message) -> None:
        if message.metadata.message_type.startswith("train"):
            self._sent[message_id] = _Sent(message.metadata.dst_node_id, self._round)

    def received(self, reply: Message) -> None:
        sent = self._sent.pop(reply.metadata.reply_to_message_id, None)
        if sent is None:
            return  # not a train reply
        bucket = self._bucket
        if reply.has_error():
            bucket.failed.append(sent.node_id)
            reason = reply.error.reason or f"code {reply.error.code}"
            kind = _error_kind(reason)
            if kind not in self.errors:
                self.errors[kind] = FailureKind(kind, sent.node_id, sent.round, reason)
            self.errors[kind].add(sent.node_id, sent.round)
            return
        metrics = next(iter(metric_records(reply)), MetricRecord())
        pid = int(metrics.get(keys.PARTITION_ID, sent.node_id))  # type: ignore[arg-type]
        bucket.participants.append(pid)
        energy = metrics.get(keys.ENERGY_J, 0.0)
        bucket.energy_j += float(energy) if isinstance(energy, (int, float)) else 0.0
        bucket.slowest_s = max(bucket.slowest_s, reply_duration(reply))

    def error_summary(self) -> list[dict[str, object]]:
        """Failed train tasks grouped by kind of error, most tasks first
        (:meth:`FailureKind.as_dict`)."""
        kinds = sorted(self.errors.values(), key=lambda k: -k.tasks)
        return [kind.as_dict() for kind in kinds]

    def evaluate_fn(self, server_round: int, arrays: ArrayRecord) -> MetricRecord:
        """Central evaluation on the held-out test set; closes the round's record."""
        d = self.data
        model, state = _evaluation_model(
            self.model_name, d.in_channels, d.image_size, d.num_classes
        )
        _load(model, state, arrays)
        loss, acc = _scores(model, d)
        if server_round == 0:
            self.initial_accuracy = acc
            return MetricRecord({"accuracy": acc, "loss": loss})
        clock = getattr(self.grid, "clock", None)
        if isinstance(clock, VirtualClock):
            self._virtual_s = clock.now()
        else:
            self._virtual_s += self._bucket.slowest_s
        stragglers = sum(1 for s in self._sent.values() if s.round == self._round)
        record = RoundRecord(
            round=server_round,
            virtual_time_s=self._virtual_s,
            accuracy=acc,
            loss=loss,
            participants=sorted(self._bucket.participants),
            failed=sorted(self._bucket.failed),
            stragglers=stragglers,
            energy_j=self._bucket.energy_j,
            wall_time_s=time.monotonic() - self._wall_start,
        )
        self.records.append(record)
        self._bucket = _Bucket()
        self._round = server_round + 1
        if self.on_round is not None:
            self.on_round(record)
        return MetricRecord({"accuracy": acc, "loss": loss})


def _scores(model: nn.Module, data: Dataset) -> tuple[float, float]:
    """Loss and accuracy of ``model`` on the test set, for the central evaluation.

    The forward pass is the layer library's, as batched training runs it
    (:func:`~flowerbed.sims.grouped.evaluation_logits`, one node), on oneDNN
    whatever the process's nodes use (:func:`flowerbed.sims.node.single_threaded`
    turns it off for their small batches); opted in to the compiled kernels,
    their pass where the model allows it
    (:func:`~flowerbed.sims.kernel_inference.kernel_pass`: LeNet). Measured here
    on digits' 360 test images (one thread), LeNet's two convolutions take ~0.04
    and ~0.08 ms on the kernels, ~0.2 and ~0.17 ms on oneDNN, ~0.32 and ~0.33 ms
    on PyTorch's own kernels. Each sums in its own order: losses and accuracies
    agree within float tolerance, not bit for bit. Models the library does not
    run are scored by :func:`~flowerbed.clients.training.evaluate`, as a node
    scores them.
    """
    x = torch.from_numpy(np.ascontiguousarray(data.x_test))
    forward = kernel_pass(model)
    if forward is not None:
        logits = forward(x)
        if logits is not None:
            return scores(logits, data.y_test)
    with onednn():
        logits = evaluation_logits(model, x)
        if logits is not None:
            return scores(logits, data.y_test)
        return evaluate(model, data.x_test, data.y_test)


@functools.lru_cache(maxsize=4)
def _evaluation_model(
    name: str, in_channels: int, image_size: int, classes: int
) -> tuple[nn.Module, dict[str, np.ndarray] | None]:
    """One model per process and architecture for the central evaluation, and
    its state's elements by name (NumPy views of its tensors) when :func:`_load`
    may copy into them directly.

    Each round loads its weights into the model, and its trace
    (:func:`flowerbed.sims.layers.trace`, ~3.5 ms for LeNet) is made once, not
    once per run.
    """
    model = build_model(name, in_channels, image_size, classes)
    plain = all(
        type(m)._load_from_state_dict is nn.Module._load_from_state_dict
        and not m._load_state_dict_pre_hooks
        and not m._load_state_dict_post_hooks
        for m in model.modules()
    )
    state = model.state_dict(keep_vars=True)
    views = {name: t.detach().numpy() for name, t in state.items()}
    return model, views if plain else None


def _load(
    model: nn.Module, state: dict[str, np.ndarray] | None, arrays: ArrayRecord
) -> None:
    """``model.load_state_dict(torch_state_dict(arrays))``: each array's
    elements copied from the record's bytes (:func:`~flowerbed.arrays.array_view`,
    no decoded copy) into its tensor's memory (``state``), without
    ``load_state_dict``'s walk over the modules (~85 us of LeNet's ~115);
    anything else (other names, shapes or dtypes, a model with load hooks)
    through ``load_state_dict``, which says what is wrong."""
    if state is not None and arrays.keys() == state.keys():
        views = record_views(arrays)
        if all(
            v.shape == state[k].shape and v.dtype == state[k].dtype
            for k, v in views.items()
        ):
            for name, view in views.items():
                np.copyto(state[name], view)
            return
    model.load_state_dict(torch_state_dict(arrays))


def _error_kind(reason: str) -> str:
    """``reason`` with its numbers (node ids, rounds, seconds) replaced by ``#``;
    numbers inside names stay (``rpi3b``, ``galaxy-s10``)."""
    first = reason.strip().splitlines()[-1] if reason.strip() else reason
    return re.sub(r"(?<![\w.])\d+(\.\d+)?(e[-+]?\d+)?", "#", first)[:300]
