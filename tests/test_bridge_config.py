"""Token files, CLI settings and the message -> task conversion of the bridge."""

from __future__ import annotations

import argparse

import numpy as np
import pytest
from flowerbed.clients.bridge import cli
from flowerbed.clients.bridge.tasks import (
    TaskBuildError,
    check_metrics,
    task_from_message,
)
from flowerbed.clients.bridge.tokens import TokenFileError, load_tokens, parse_tokens
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.supercore.task_identity import TaskIdentity


def test_token_file_maps_tokens_to_phone_names(tmp_path):
    path = tmp_path / "tokens.txt"
    path.write_text("# lab phones\nAAAAAAAAAAAAAAAA pixel-7\n\nBBBBBBBBBBBBBBBB a52\n")
    assert load_tokens(path) == {
        "AAAAAAAAAAAAAAAA": "pixel-7",
        "BBBBBBBBBBBBBBBB": "a52",
    }


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("AAAAAAAAAAAAAAAA", r"<tokens>:1: expected '<token> <phone-name>'"),
        ("short pixel", "at least 16 characters"),
        ("AAAAAAAAAAAAAAAA p1\nAAAAAAAAAAAAAAAA p2", r":2: token repeated"),
        ("AAAAAAAAAAAAAAAA p1\nBBBBBBBBBBBBBBBB p1", r":2: phone name 'p1' repeated"),
        ("# nothing\n", "no tokens"),
    ],
)
def test_bad_token_files_name_the_line_and_the_fault(text, message):
    with pytest.raises(TokenFileError, match=message):
        parse_tokens(text)


def test_cli_options_become_gateway_settings():
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers())
    args = parser.parse_args(
        ["bridge", "--tokens", "t", "--max-upload-mb", "2", "--chunk-kb", "64"]
    )
    settings = cli.settings_from_args(args)
    assert settings.max_upload_bytes == 2 * 1024 * 1024
    assert settings.chunk_bytes == 64 * 1024
    assert args.superlink == "127.0.0.1:8000"  # Flower 1.41's SuperLink port


def test_cli_refuses_a_missing_token_file(tmp_path):
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers())
    args = parser.parse_args(["bridge", "--tokens", str(tmp_path / "none.txt")])
    assert args.func(args) == 2


def _message(kind: str, config: dict, ttl: float, arrays: dict | None = None):
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 7, 0
    try:
        record = ArrayRecord(
            {k: Array(v) for k, v in (arrays or {"w": np.zeros(3, np.float32)}).items()}
        )
        content = RecordDict({"arrays": record, "config": ConfigRecord(config)})
        return Message(content, dst_node_id=5, message_type=kind, ttl=ttl)
    finally:
        TaskIdentity._task_id = TaskIdentity._run_id = TaskIdentity._node_id = None


def test_task_expires_at_the_earlier_of_ttl_and_deadline_plus_slack():
    msg = _message("train", {"deadline-s": 10.0}, ttl=60.0)
    created = msg.metadata.created_at
    # 4 s after creation: TTL leaves 56 s, deadline + slack leaves 10 + 3 = 13 s.
    task = task_from_message(msg, 3.0, clock=lambda: 100.0, wall=lambda: created + 4)
    assert task.expires_at == pytest.approx(113.0)
    # Without a deadline the TTL rules: 60 - 4 = 56 s.
    msg = _message("train", {}, ttl=60.0)
    created = msg.metadata.created_at
    task = task_from_message(msg, 3.0, clock=lambda: 100.0, wall=lambda: created + 4)
    assert task.expires_at == pytest.approx(156.0)


def test_messages_phones_cannot_run_are_refused_with_the_reason():
    with pytest.raises(TaskBuildError, match="float32 only"):
        task_from_message(
            _message("train", {}, 60.0, {"w": np.zeros(2, np.int64)}), 1.0
        )
    with pytest.raises(TaskBuildError, match="hold bytes"):
        task_from_message(_message("train", {"blob": b"x"}, 60.0), 1.0)
    with pytest.raises(TaskBuildError, match="TTL ran out"):
        msg = _message("train", {}, ttl=5.0)
        task_from_message(msg, 1.0, wall=lambda: msg.metadata.created_at + 6)


@pytest.mark.parametrize(
    ("metrics", "message"),
    [
        ([1, 2], "JSON object"),
        ({"num-examples": "40"}, "'num-examples' must be a number"),
        ({"num-examples": True}, "must be a number"),
        ({"num-examples": 0}, "'num-examples' > 0"),
        ({"num-examples": 4, "temp-c": float("nan")}, "'temp-c' is not finite"),
    ],
)
def test_train_metrics_are_numbers_with_positive_num_examples(metrics, message):
    with pytest.raises(ValueError, match=message):
        check_metrics(metrics, train=True)
