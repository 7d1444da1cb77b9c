"""A ready Flower ClientApp for boards (Raspberry Pi, Jetson): train, evaluate, query.

Point a Flower App's ``clientapp`` component at ``flowerbed.clients.board_app:app``
and start each board's SuperNode with its own data::

    flower-supernode --superlink SERVER:8000 \\
        --node-config "dataset-path='/data/digits' device='rpi4'"

node_config (per board):

- ``dataset-path`` (required): image folder or ``.npz``; see
  :mod:`flowerbed.clients.local_data`.
- ``eval-dataset-path``: held-out data for ``evaluate`` (default: ``dataset-path``,
  which then measures fit to the local training data).
- ``device``: a label for the board (``rpi4``, ``jetson-nano``), echoed by ``query``.
- ``slowdown-s``: test aid, seconds slept before each training step (turns a fast
  machine into a slow board); leave unset on real boards.

Run config (``[tool.flwr.app.config]``, same for every board): ``model`` (lenet),
``num-classes`` (10), ``batch-size`` (32), ``learning-rate`` (0.05),
``local-steps`` (10), ``seed`` (0), ``profile-steps`` (5), and optionally
``image-size``, ``in-channels``, ``class-names`` (comma-separated folder order).
The server's train ConfigRecord overrides ``local-steps``, ``batch-size`` and the
learning rate (``lr``) per round and may set ``deadline-s`` and ``proximal-mu``
(FedProx's proximal term, as Flower's FedProx sends it).

Training runs until ``local-steps`` are done or ``deadline-s`` seconds have passed
since the server sent the task, whichever comes first (partial work; see
:func:`deadline_origin`), and replies with
``num-examples``, ``num-steps``, ``train-time-s``, ``samples-per-s``,
``train-loss`` and, where the board can measure them, ``power-w``, ``energy-j`` and
``temp-c``. Missing, empty or corrupt data or a mismatched model give an error
reply naming the path and problem; the SuperNode keeps running.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from logging import ERROR
from typing import Any, TypeVar

import numpy as np
import torch
from flowerbed import keys
from flowerbed.clients import telemetry
from flowerbed.clients.local_data import LocalData, load_local_data
from flowerbed.clients.timed import TrainingMeter, timed_train
from flowerbed.clients.training import evaluate as evaluate_model
from flowerbed.clients.training import train_steps
from flowerbed.data import DataError
from flowerbed.models import build_model
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    ConfigRecordValues,
    Context,
    Error,
    Message,
    MetricRecord,
    MetricRecordValues,
    RecordDict,
)
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode
from flwr.supercore import log
from torch import nn

T = TypeVar("T")
"""What a training loop returns."""

# node_config keys -------------------------------------------------------------------
DATASET_PATH = "dataset-path"
EVAL_DATASET_PATH = "eval-dataset-path"
DEVICE = "device"
SLOWDOWN_S = "slowdown-s"
"""Test aid: seconds slept before each training step."""

# run config keys and their defaults ---------------------------------------------------
MODEL = "model"
NUM_CLASSES = "num-classes"
LEARNING_RATE = "learning-rate"
SEED = "seed"
IMAGE_SIZE = "image-size"
IN_CHANNELS = "in-channels"
CLASS_NAMES = "class-names"
DEFAULTS: dict[str, str | int | float] = {
    MODEL: "lenet",
    NUM_CLASSES: 10,
    keys.BATCH_SIZE: 32,
    LEARNING_RATE: 0.05,
    keys.LOCAL_STEPS: 10,
    SEED: 0,
    keys.PROFILE_STEPS: 5,
}

EVAL_CHUNK = 256
"""Samples per forward pass in ``evaluate`` (bounds activation memory on boards)."""

ERROR_CODE = ErrorCode.CLIENT_APP_RAISED_EXCEPTION
"""Code of the error replies this app sends (Flower's "ClientApp raised exception")."""


class BoardError(ValueError):
    """A problem the board's operator or the run's author can fix; becomes the
    reason of an error reply."""


@dataclass(frozen=True)
class Setup:
    """A board's model and data for one message."""

    model: nn.Module
    data: LocalData
    batch_size: int
    lr: float
    seed: int

    def train(self, loop: Callable[..., T], steps: int, **options: Any) -> T:
        """``loop`` (:func:`train_steps` or :func:`timed_train`) on this model and
        data with this batch size and learning rate; ``options`` go to ``loop``."""
        return loop(
            self.model,
            self.data.x,
            self.data.y,
            steps=steps,
            batch_size=self.batch_size,
            lr=self.lr,
            **options,
        )


def _number(
    source: str,
    values: Mapping[str, Any],
    key: str,
    kind: type[int] | type[float],
) -> float:
    """Read a number from a run config, node_config or ConfigRecord.

    Falls back to :data:`DEFAULTS`; a missing key without default or a value of
    the wrong type raises :class:`BoardError` naming the source and key.
    """
    raw = values[key] if key in values else DEFAULTS.get(key)
    if raw is None:
        raise BoardError(f"{source} has no '{key}'")
    if isinstance(raw, bool) or not isinstance(raw, int | float):
        raise BoardError(f"{source} '{key}' must be a number, got {raw!r}")
    if kind is int and float(raw) != int(raw):
        raise BoardError(f"{source} '{key}' must be a whole number, got {raw!r}")
    return kind(raw)


def _from_config_or_run(
    config: ConfigRecord,
    run_config: Mapping[str, Any],
    config_key: str,
    run_key: str,
    kind: type[int] | type[float],
) -> float:
    """The server's per-message value if it sent one, else the run config's."""
    if config_key in config:
        return _number("message config", config, config_key, kind)
    return _number("run config", run_config, run_key, kind)


def _optional_int(run_config: Mapping[str, Any], key: str) -> int | None:
    if key not in run_config or run_config[key] in (0, ""):
        return None
    return int(_number("run config", run_config, key, int))


def _seed(base: int, server_round: int, node_id: int) -> int:
    """A per-round, per-node seed, stable across processes (unlike ``hash``)."""
    digest = hashlib.sha256(f"{base}:{server_round}:{node_id}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


def _load(context: Context, message: Message, path_key: str = DATASET_PATH) -> Setup:
    node_config = dict(context.node_config)
    run_config = dict(context.run_config)
    path = node_config.get(path_key) or node_config.get(DATASET_PATH)
    if not isinstance(path, str) or not path:
        raise BoardError(
            f"node_config has no '{DATASET_PATH}': start the SuperNode with "
            f"--node-config \"{DATASET_PATH}='/path/to/data'\" (an image folder "
            "with one subfolder per class, or an .npz with x and y)"
        )
    num_classes = int(_number("run config", run_config, NUM_CLASSES, int))
    class_names = run_config.get(CLASS_NAMES, "")
    if not isinstance(class_names, str):
        raise BoardError(
            f"run config '{CLASS_NAMES}' must be a comma-separated string of folder "
            f"names, got {class_names!r}"
        )
    data = load_local_data(
        path,
        image_size=_optional_int(run_config, IMAGE_SIZE),
        in_channels=_optional_int(run_config, IN_CHANNELS),
        class_names=[n.strip() for n in class_names.split(",")]
        if class_names
        else None,
        num_classes=num_classes,
    )
    model_name = run_config.get(MODEL, DEFAULTS[MODEL])
    try:
        model = build_model(
            str(model_name), data.in_channels, data.image_size, num_classes
        )
    except ValueError as err:
        raise BoardError(f"run config '{MODEL}': {err}") from err
    if keys.ARRAYS in message.content.array_records:
        state = message.content.array_records[keys.ARRAYS].to_torch_state_dict()
        try:
            model.load_state_dict(state)
        except RuntimeError as err:
            raise BoardError(
                f"the server's model does not fit {model_name} on this board's "
                f"data ({data.in_channels}x{data.image_size}x{data.image_size}, "
                f"{num_classes} classes from {data.path}); check run config "
                f"'{MODEL}', '{NUM_CLASSES}', '{IMAGE_SIZE}', '{IN_CHANNELS}': {err}"
            ) from err
    config = message.content.config_records.get(keys.CONFIG, ConfigRecord())
    batch_size = int(
        _from_config_or_run(config, run_config, keys.BATCH_SIZE, keys.BATCH_SIZE, int)
    )
    lr = _from_config_or_run(
        config, run_config, keys.LEARNING_RATE, LEARNING_RATE, float
    )
    if batch_size < 1 or lr <= 0:
        raise BoardError(f"batch size must be >= 1 and lr > 0, got {batch_size}, {lr}")
    server_round = config.get(keys.SERVER_ROUND, 0)
    seed = _seed(
        int(_number("run config", run_config, SEED, int)),
        int(server_round) if isinstance(server_round, int | float) else 0,
        context.node_id,
    )
    torch.manual_seed(seed)
    return Setup(model, data, batch_size, float(lr), seed)


def _slowdown(context: Context) -> float:
    if SLOWDOWN_S not in context.node_config:
        return 0.0
    value = _number("node_config", dict(context.node_config), SLOWDOWN_S, float)
    if value < 0:
        raise BoardError(f"node_config '{SLOWDOWN_S}' must be >= 0, got {value}")
    return value


def deadline_origin(message: Message, arrived: float) -> float:
    """The ``time.monotonic()`` instant a message's ``deadline-s`` counts from.

    The server's deadline runs from when it created the task, so the board's does
    too: ``arrived - (time.time() - created_at)``, which subtracts the time the
    task spent queued and in transit (SuperNode polling, ClientApp start-up). Flower
    already compares server and board timestamps for message TTLs, so boards
    should keep their clocks synchronised (NTP). When the gap is implausible
    (negative beyond 1 s, or longer than the message's TTL) the clocks disagree and
    the deadline counts from arrival instead.
    """
    waited = time.time() - message.metadata.created_at
    if -1.0 <= waited <= message.metadata.ttl:
        return arrived - max(0.0, waited)
    return arrived


def _error_reply(message: Message, err: Exception) -> Message:
    reason = f"flowerbed board client: {err}"
    log(ERROR, "%s reply is an error: %s", message.metadata.message_type, reason)
    return Message(Error(code=ERROR_CODE, reason=reason), reply_to=message)


def _guarded(
    handler: Callable[[Message, Context], Message],
) -> Callable[[Message, Context], Message]:
    """Turn data, config and model mismatches into error replies."""

    def run(message: Message, context: Context) -> Message:
        try:
            return handler(message, context)
        except (BoardError, DataError) as err:
            return _error_reply(message, err)

    run.__name__ = handler.__name__
    run.__doc__ = handler.__doc__
    return run


def train(message: Message, context: Context) -> Message:
    """Train the received model on local data until local-steps or deadline-s."""
    arrived = time.monotonic()
    setup = _load(context, message)
    config = message.content.config_records.get(keys.CONFIG, ConfigRecord())
    run_config = dict(context.run_config)
    steps = int(
        _from_config_or_run(config, run_config, keys.LOCAL_STEPS, keys.LOCAL_STEPS, int)
    )
    deadline = (
        _number("train config", config, keys.DEADLINE_S, float)
        if keys.DEADLINE_S in config
        else None
    )
    if steps < 0:
        raise BoardError(f"local-steps must be >= 0, got {steps}")
    mu = (
        _number("train config", config, keys.PROXIMAL_MU, float)
        if keys.PROXIMAL_MU in config
        else 0.0
    )
    if mu < 0:
        raise BoardError(f"{keys.PROXIMAL_MU} must be >= 0, got {mu}")
    done = setup.train(
        timed_train,
        steps,
        seed=setup.seed,
        deadline_s=deadline,
        started_at=deadline_origin(message, arrived),
        slowdown_s=_slowdown(context),
        proximal_mu=mu,
    )
    content = RecordDict(
        {
            keys.ARRAYS: ArrayRecord(setup.model.state_dict()),
            keys.METRICS: MetricRecord(done.metrics()),
        }
    )
    return Message(content, reply_to=message)


def chunked_evaluate(
    model: nn.Module, x: np.ndarray, y: np.ndarray, chunk: int = EVAL_CHUNK
) -> tuple[float, float]:
    """Mean loss and accuracy over (x, y), ``chunk`` samples per forward pass.

    Each chunk's mean is weighted by its size, so the result equals one pass over
    all samples while memory stays bounded on a board.
    """
    loss_sum = correct = 0.0
    for begin in range(0, len(x), chunk):
        xs, ys = x[begin : begin + chunk], y[begin : begin + chunk]
        loss, acc = evaluate_model(model, xs, ys)
        loss_sum += loss * len(xs)
        correct += acc * len(xs)
    return loss_sum / len(x), correct / len(x)


def evaluate(message: Message, context: Context) -> Message:
    """Loss and accuracy of the received model on the board's evaluation data."""
    setup = _load(context, message, EVAL_DATASET_PATH)
    start = time.monotonic()
    loss, acc = chunked_evaluate(setup.model, setup.data.x, setup.data.y)
    metrics: dict[str, MetricRecordValues] = {
        keys.NUM_EXAMPLES: len(setup.data),
        keys.EVAL_LOSS: loss,
        keys.EVAL_ACC: acc,
        keys.EVAL_TIME_S: time.monotonic() - start,
    }
    if not math.isfinite(loss):
        raise BoardError(f"evaluation loss is {loss} on {setup.data.path}")
    return Message(RecordDict({keys.METRICS: MetricRecord(metrics)}), reply_to=message)


def profile(message: Message, context: Context) -> Message:
    """Time a few training steps of the current model on local data.

    One untimed warm-up step first (first-call allocations), then
    ``profile-steps`` timed steps (query config, else run config). Replies with a
    MetricRecord (``samples-per-s``, ``num-steps``, ``num-examples``,
    ``train-time-s``, and ``power-w``/``energy-j``/``temp-c`` where measurable) and
    a ConfigRecord ``device`` with the board's telemetry and its node_config label.
    """
    setup = _load(context, message)
    config = message.content.config_records.get(keys.CONFIG, ConfigRecord())
    steps = int(
        _from_config_or_run(
            config,
            dict(context.run_config),
            keys.PROFILE_STEPS,
            keys.PROFILE_STEPS,
            int,
        )
    )
    if steps < 1:
        raise BoardError(f"{keys.PROFILE_STEPS} must be >= 1, got {steps}")
    setup.train(train_steps, 1, seed=setup.seed)
    with TrainingMeter(slowdown_s=_slowdown(context)) as meter:
        stats = setup.train(
            train_steps,
            steps,
            seed=setup.seed + 1,
            should_stop=meter.should_stop,
        )
        meter.num_steps, meter.num_examples = stats.num_steps, stats.num_examples
    metrics = meter.result(stats.mean_loss).metrics()
    device: dict[str, ConfigRecordValues] = dict(telemetry.read_telemetry())
    label = context.node_config.get(DEVICE)
    if isinstance(label, str) and label:
        device[DEVICE] = label
    content = RecordDict(
        {
            keys.METRICS: MetricRecord(metrics),
            keys.DEVICE_RECORD: ConfigRecord(device),
        }
    )
    return Message(content, reply_to=message)


app = ClientApp()
app.train()(_guarded(train))
app.evaluate()(_guarded(evaluate))
app.query()(_guarded(profile))
