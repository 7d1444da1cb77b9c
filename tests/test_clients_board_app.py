"""The board ClientApp called in-process with the messages a SuperLink would send."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from flowerbed import keys
from flowerbed.clients import board_app
from flowerbed.clients.board_app import deadline_origin
from flowerbed.clients.training import evaluate
from flowerbed.models import build_model
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    MessageType,
    RecordDict,
)
from flwr.supercore.task_identity import TaskIdentity

NODE_ID = 7


@pytest.fixture(autouse=True)
def task_identity() -> Iterator[None]:
    """Messages can only be built inside a task; pretend to be one."""
    saved = (TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id)
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 0
    yield
    TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id = saved


@pytest.fixture
def npz(tmp_path: Path) -> Path:
    """40 random 8x8 grayscale samples with labels 0..9."""
    rng = np.random.default_rng(0)
    path = tmp_path / "local.npz"
    np.savez(
        path,
        x=rng.integers(0, 256, (40, 8, 8), dtype=np.uint8),
        y=rng.integers(0, 10, 40),
    )
    return path


def context(node_config: dict, run_config: dict | None = None) -> Context:
    return Context(
        run_id=1,
        node_id=NODE_ID,
        node_config=node_config,
        state=RecordDict(),
        run_config={"batch-size": 8, **(run_config or {})},
    )


def message(kind: str, config: dict | None = None, num_classes: int = 10) -> Message:
    model = build_model("lenet", 1, 8, num_classes)
    content = RecordDict(
        {
            keys.ARRAYS: ArrayRecord(model.state_dict()),
            keys.CONFIG: ConfigRecord(config or {}),
        }
    )
    return Message(content, dst_node_id=NODE_ID, message_type=kind)


def test_train_does_the_assigned_steps_and_reports_wire_keys(npz: Path) -> None:
    sent = message(MessageType.TRAIN, {keys.LOCAL_STEPS: 3, keys.SERVER_ROUND: 1})
    reply = board_app.app(sent, context({"dataset-path": str(npz)}))
    assert not reply.has_error()
    metrics = reply.content[keys.METRICS]
    assert metrics[keys.NUM_STEPS] == 3  # the server's local-steps, not the default
    assert metrics[keys.NUM_EXAMPLES] == 24  # 3 steps x batch 8
    assert metrics[keys.TRAIN_TIME_S] > 0
    assert metrics[keys.SAMPLES_PER_S] == pytest.approx(24 / metrics[keys.TRAIN_TIME_S])
    before = sent.content[keys.ARRAYS].to_numpy_ndarrays()
    after = reply.content[keys.ARRAYS].to_numpy_ndarrays()
    assert [a.shape for a in after] == [b.shape for b in before]
    assert any(not np.array_equal(a, b) for a, b in zip(after, before, strict=True))


def test_train_uses_run_config_steps_when_server_sends_none(npz: Path) -> None:
    reply = board_app.app(
        message(MessageType.TRAIN),
        context({"dataset-path": str(npz)}, {"local-steps": 2}),
    )
    assert reply.content[keys.METRICS][keys.NUM_STEPS] == 2


def test_task_sent_after_its_deadline_does_no_work(npz: Path) -> None:
    sent = message(MessageType.TRAIN, {keys.LOCAL_STEPS: 50, keys.DEADLINE_S: 5.0})
    sent.metadata.created_at = time.time() - 6.0  # queued 6 s: deadline gone
    reply = board_app.app(sent, context({"dataset-path": str(npz)}))
    metrics = reply.content[keys.METRICS]
    assert metrics[keys.NUM_STEPS] == 0 and metrics[keys.NUM_EXAMPLES] == 0
    assert keys.TRAIN_LOSS not in metrics


def test_slowed_node_stops_at_the_deadline(npz: Path) -> None:
    sent = message(MessageType.TRAIN, {keys.LOCAL_STEPS: 1000, keys.DEADLINE_S: 0.5})
    reply = board_app.app(sent, context({"dataset-path": str(npz), "slowdown-s": 0.05}))
    # Each step waits 0.05 s first, and no step starts after 0.5 s: at most 10.
    assert reply.content[keys.METRICS][keys.NUM_STEPS] <= 10


def test_deadline_origin_subtracts_queueing_time() -> None:
    sent = message(MessageType.TRAIN)
    sent.metadata.created_at = time.time() - 3.0
    assert deadline_origin(sent, 100.0) == pytest.approx(97.0, abs=0.1)


@pytest.mark.parametrize("offset", [+60.0, -1e6])
def test_deadline_origin_ignores_implausible_clock_gaps(offset: float) -> None:
    # Created "in the future", or longer ago than the message's TTL (12 h).
    sent = message(MessageType.TRAIN)
    sent.metadata.created_at = time.time() + offset
    assert deadline_origin(sent, 100.0) == 100.0


@pytest.mark.parametrize(
    ("node_config", "run_config", "fragments"),
    [
        ({"dataset-path": "/nonexistent/d.npz"}, {}, ["/nonexistent/d.npz", "exist"]),
        ({}, {}, ["dataset-path", "--node-config"]),
        ({"dataset-path": "NPZ"}, {"model": "resnet"}, ["resnet", "lenet, mobilenet"]),
        ({"dataset-path": "NPZ"}, {"batch-size": "big"}, ["batch-size", "number"]),
        ({"dataset-path": "NPZ", "slowdown-s": -1.0}, {}, ["slowdown-s", ">= 0"]),
        ({"dataset-path": "NPZ"}, {"num-classes": 5}, ["num-classes=5"]),
    ],
)
def test_bad_setup_gives_an_error_reply_naming_the_problem(
    npz: Path, node_config: dict, run_config: dict, fragments: list[str]
) -> None:
    if node_config.get("dataset-path") == "NPZ":
        node_config = {**node_config, "dataset-path": str(npz)}
    reply = board_app.app(message(MessageType.TRAIN), context(node_config, run_config))
    assert reply.has_error()
    assert reply.error.code == board_app.ERROR_CODE
    for fragment in fragments:
        assert fragment in (reply.error.reason or "")


def test_corrupt_data_gives_an_error_reply(tmp_path: Path) -> None:
    bad = tmp_path / "broken.npz"
    bad.write_bytes(b"\x00" * 10)
    reply = board_app.app(
        message(MessageType.TRAIN), context({"dataset-path": str(bad)})
    )
    assert reply.has_error()
    assert str(bad) in (reply.error.reason or "")


def test_server_model_that_does_not_fit_gives_an_error_reply(npz: Path) -> None:
    sent = message(MessageType.TRAIN, num_classes=5)  # run config says 10 classes
    reply = board_app.app(sent, context({"dataset-path": str(npz)}))
    assert reply.has_error()
    assert "does not fit" in (reply.error.reason or "")


def test_evaluate_prefers_the_eval_dataset(npz: Path, tmp_path: Path) -> None:
    held_out = tmp_path / "eval.npz"
    np.savez(held_out, x=np.zeros((6, 8, 8), dtype=np.uint8), y=np.arange(6))
    reply = board_app.app(
        message(MessageType.EVALUATE),
        context({"dataset-path": str(npz), "eval-dataset-path": str(held_out)}),
    )
    metrics = reply.content[keys.METRICS]
    assert metrics[keys.NUM_EXAMPLES] == 6
    assert 0.0 <= metrics[keys.EVAL_ACC] <= 1.0
    assert metrics[keys.EVAL_LOSS] > 0


def test_evaluate_falls_back_to_training_data(npz: Path) -> None:
    reply = board_app.app(
        message(MessageType.EVALUATE), context({"dataset-path": str(npz)})
    )
    assert reply.content[keys.METRICS][keys.NUM_EXAMPLES] == 40


def test_profiling_query_times_steps_and_describes_the_device(npz: Path) -> None:
    sent = message(MessageType.QUERY, {keys.PROFILE_STEPS: 4})
    reply = board_app.app(sent, context({"dataset-path": str(npz), "device": "rpi4"}))
    assert not reply.has_error()
    metrics = reply.content[keys.METRICS]
    assert metrics[keys.NUM_STEPS] == 4
    assert metrics[keys.NUM_EXAMPLES] == 32  # 4 timed steps x batch 8
    assert metrics[keys.SAMPLES_PER_S] == pytest.approx(32 / metrics[keys.TRAIN_TIME_S])
    device = reply.content[keys.DEVICE_RECORD]
    assert device["device"] == "rpi4"
    assert keys.ARRAYS not in reply.content.array_records


def test_profiling_query_refuses_zero_steps(npz: Path) -> None:
    sent = message(MessageType.QUERY, {keys.PROFILE_STEPS: 0})
    reply = board_app.app(sent, context({"dataset-path": str(npz)}))
    assert reply.has_error()
    assert keys.PROFILE_STEPS in (reply.error.reason or "")


def test_chunked_evaluation_equals_one_pass() -> None:
    rng = np.random.default_rng(1)
    x = rng.random((10, 1, 8, 8), dtype=np.float32)
    y = rng.integers(0, 10, 10)
    model = build_model("lenet", 1, 8, 10)
    whole = evaluate(model, x, y)
    # chunks of 3, 3, 3 and 1 samples, weighted by their sizes
    assert board_app.chunked_evaluate(model, x, y, chunk=3) == pytest.approx(whole)


def test_fedprox_mu_from_the_server_holds_weights_near_the_global_model(
    npz: Path,
) -> None:
    def drift(config: dict) -> float:
        sent = message(MessageType.TRAIN, {keys.LOCAL_STEPS: 5, **config})
        reply = board_app.app(sent, context({"dataset-path": str(npz)}))
        before = sent.content[keys.ARRAYS].to_numpy_ndarrays()
        after = reply.content[keys.ARRAYS].to_numpy_ndarrays()
        pairs = zip(after, before, strict=True)
        return sum(float(((a - b) ** 2).sum()) for a, b in pairs)

    # Same seed and data; only the proximal term differs. With lr 0.05 and
    # mu = 10 each step also moves the weights 0.05 x 10 = half-way back towards
    # the weights the server sent.
    assert drift({keys.PROXIMAL_MU: 10.0}) < drift({})


def test_negative_fedprox_mu_is_refused(npz: Path) -> None:
    sent = message(MessageType.TRAIN, {keys.PROXIMAL_MU: -1.0})
    reply = board_app.app(sent, context({"dataset-path": str(npz)}))
    assert reply.has_error()
    assert keys.PROXIMAL_MU in (reply.error.reason or "")
