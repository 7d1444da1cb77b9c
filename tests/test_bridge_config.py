"""Token files, CLI settings and the message -> task conversion of the bridge."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import numpy as np
import pytest
from flowerbed.clients.bridge import cli
from flowerbed.clients.bridge.tasks import (
    TaskBuildError,
    check_metrics,
    task_from_message,
)
from flowerbed.clients.bridge.tokens import (
    TokenFileError,
    TokenTable,
    hash_token,
    load_tokens,
    parse_tokens,
)
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.supercore.task_identity import TaskIdentity


def test_token_file_maps_token_digests_to_phone_names(tmp_path):
    path = tmp_path / "tokens.txt"
    path.write_text("# lab phones\nAAAAAAAAAAAAAAAA pixel-7\n\nBBBBBBBBBBBBBBBB a52\n")
    # sha256("AAAAAAAAAAAAAAAA"), computed with `printf AAAAAAAAAAAAAAAA | sha256sum`
    digest_a = "991204fba2b6216d476282d375ab88d20e6108d109aecded97ef424ddd114706"
    assert hash_token("AAAAAAAAAAAAAAAA") == f"sha256:{digest_a}"
    assert load_tokens(path) == {
        f"sha256:{digest_a}": "pixel-7",
        hash_token("BBBBBBBBBBBBBBBB"): "a52",
    }


def test_hashed_lines_authenticate_the_token_they_hash(tmp_path):
    path = tmp_path / "tokens.txt"
    path.write_text(f"{hash_token('pQ3v9Yd0s2Xc7LrN1bTq8wEz')} pixel-7\n")
    table = TokenTable.from_file(path)
    assert table.lookup("pQ3v9Yd0s2Xc7LrN1bTq8wEz") == "pixel-7"
    assert table.lookup(hash_token("pQ3v9Yd0s2Xc7LrN1bTq8wEz")) is None  # not a token
    assert table.lookup("") is None


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def watched_tokens(root: Path, text: str) -> tuple[Path, _Clock, TokenTable]:
    """A token file ``root/tokens.txt`` holding ``text`` and its TokenTable, which
    rereads it at most once a second of the returned clock."""
    path = root / "tokens.txt"
    path.write_text(text)
    clock = _Clock()
    table = TokenTable(load_tokens(path), path, check_interval_s=1.0, clock=clock)
    return path, clock, table


def test_token_file_changes_apply_without_restart(tmp_path, caplog):
    tokens = "AAAAAAAAAAAAAAAA pixel-7\nBBBBBBBBBBBBBBBB a52\n"
    path, clock, table = watched_tokens(tmp_path, tokens)
    # a52 revoked, pixel-7 given a new token, s23 added.
    path.write_text("CCCCCCCCCCCCCCCC pixel-7\nDDDDDDDDDDDDDDDD s23\n")
    clock.now = 0.5  # within the check interval: the old table still answers
    assert table.lookup("BBBBBBBBBBBBBBBB") == "a52"
    clock.now = 1.5
    with caplog.at_level(logging.INFO, logger="flowerbed.bridge"):
        assert table.lookup("BBBBBBBBBBBBBBBB") is None
    assert "added ['s23'], removed ['a52']" in caplog.text
    assert table.lookup("AAAAAAAAAAAAAAAA") is None
    assert table.lookup("CCCCCCCCCCCCCCCC") == "pixel-7"
    assert table.lookup("DDDDDDDDDDDDDDDD") == "s23"


def test_an_invalid_token_file_change_keeps_the_previous_tokens(tmp_path, caplog):
    path, clock, table = watched_tokens(tmp_path, "AAAAAAAAAAAAAAAA pixel-7\n")
    path.write_text("short pixel-7\n")
    with caplog.at_level(logging.ERROR, logger="flowerbed.bridge"):
        for t in (2.0, 3.0, 4.0):
            clock.now = t
            assert table.lookup("AAAAAAAAAAAAAAAA") == "pixel-7"
    refusals = [r for r in caplog.records if "change refused" in r.message]
    assert len(refusals) == 1 and "at least 16 characters" in refusals[0].message


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
        ({"num-examples": 0}, "'num-examples' is 0"),
        ({"num-examples": 4, "train-time-s": -1.0}, "'train-time-s' is negative"),
        ({"num-examples": 4, "num-steps": -3}, "'num-steps' is negative"),
        ({"train-time-s": 2.0}, "need 'num-examples'"),
        ({"num-examples": 2**63}, "does not fit in 64 bits"),
        ({"num-examples": 4, "temp-c": float("nan")}, "'temp-c' is not finite"),
    ],
)
def test_train_metrics_are_numbers_with_positive_num_examples(metrics, message):
    with pytest.raises(ValueError, match=message):
        check_metrics(metrics, train=True)
