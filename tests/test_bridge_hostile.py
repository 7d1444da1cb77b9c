"""The gateway against careless and malicious clients.

Each case is a test here: malformed requests get a 4xx JSON error and
the server keeps serving; slow and idle connections cannot pin it; keep-alive stays
in step after an error; tokens change without a restart; refusals are logged at a
limited rate; an accepted result stays accepted.
"""

from __future__ import annotations

import argparse
import json
import logging
import queue
import socket
import threading
import time
from dataclasses import replace

import numpy as np
import pytest
from bridge_fakes import (
    BLOB,
    SETTINGS,
    TOKENS,
    B,
    W,
    running_bridge,
    task_identity,  # noqa: F401 (fixture)
    train_once,
)
from flowerbed.clients.bridge import cli
from flowerbed.clients.bridge.gateway import Gateway
from flowerbed.clients.bridge.relay import StateDirError, SuperLinkConnector
from flowerbed.clients.bridge.tokens import TokenTable, load_tokens

pytestmark = pytest.mark.usefixtures("task_identity")

ALICE = "tok-alice-0123456789"


def _raw(port: int, data: bytes, answers: int = 1, timeout: float = 5.0) -> bytes:
    """Send ``data`` on a fresh connection; read until ``answers`` whole answers
    arrived, the server closed the connection, or ``timeout`` passed."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        raw = b""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not _complete(raw, answers):
            try:
                chunk = s.recv(65536)
            except (TimeoutError, ConnectionResetError):
                break
            if not chunk:
                break
            raw += chunk
        return raw


def _complete(raw: bytes, answers: int) -> bool:
    for _ in range(answers):
        head, sep, rest = raw.partition(b"\r\n\r\n")
        if not sep:
            return False
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        if len(rest) < length:
            return False
        raw = rest[length:]
    return True


def _answers(raw: bytes) -> list[tuple[int, dict[str, str], bytes]]:
    """Split a byte stream of HTTP answers into (status, headers, body)."""
    out = []
    while raw:
        head, _, rest = raw.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = {
            k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])
        }
        length = int(headers.get("content-length", "0"))
        out.append((int(lines[0].split()[1]), headers, rest[:length]))
        raw = rest[length:]
    return out


def _await_in_flight(gateway: Gateway, counts: dict[str, int]) -> None:
    """Wait until each named phone has this many requests being served."""
    deadline = time.monotonic() + 10
    while any(gateway.phone(n).in_flight != c for n, c in counts.items()):
        assert time.monotonic() < deadline, {
            n: gateway.phone(n).in_flight for n in counts
        }
        time.sleep(0.01)


def _request(method: str, path: str, body: bytes = b"", extra: str = "") -> bytes:
    head = (
        f"{method} {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {ALICE}\r\n"
        f"Content-Length: {len(body)}\r\n{extra}\r\n"
    )
    return head.encode("latin-1") + body


NESTED = b"[" * 60_000


SUPERSCRIPT_LENGTH = (
    b"POST /v1/hello HTTP/1.1\r\nAuthorization: Bearer "
    + ALICE.encode()
    + b"\r\nContent-Length: \xc2\xb2\r\n\r\n{}"
)
CHUNKED = _request("POST", "/v1/hello").replace(
    b"Content-Length: 0", b"Transfer-Encoding: chunked"
) + (b"2\r\n{}\r\n0\r\n\r\n")
BAD_REQUESTS = {
    # Issue 17: 60,000 nested "[" raised RecursionError in a handler thread.
    "nested-json": (_request("POST", "/v1/hello", NESTED), 400, "nested too deeply"),
    # Issue 17: "Content-Length: ²" raised ValueError (str.isdigit accepts it).
    "length-superscript": (SUPERSCRIPT_LENGTH, 400, "Content-Length"),
    "length-negative": (
        _request("POST", "/v1/hello", b"{}").replace(b": 2\r", b": -2\r"),
        400,
        "Content-Length",
    ),
    "length-twice": (
        _request("POST", "/v1/hello", b"{}", "Content-Length: 2\r\n"),
        400,
        "repeated",
    ),
    "chunked": (CHUNKED, 411, "Content-Length"),
    # Issue 17: wait=nan made threads spin forever.
    "wait-nan": (_request("GET", "/v1/task?wait=nan"), 400, "finite"),
    "wait-inf": (_request("GET", "/v1/task?wait=inf"), 400, "finite"),
    "wait-overflow": (_request("GET", "/v1/task?wait=1e999"), 400, "finite"),
    "wait-word": (_request("GET", "/v1/task?wait=soon"), 400, "not a number"),
    "offset-superscript": (
        _request("PUT", "/v1/task/x/result?offset=%C2%B2&total=4", b"abcd"),
        400,
        "offset",
    ),
    "total-negative": (
        _request("PUT", "/v1/task/x/result?offset=0&total=-4", b"abcd"),
        400,
        "total",
    ),
    "json-nan": (
        _request("POST", "/v1/hello", b'{"protocol": NaN}'),
        400,
        "not a JSON number",
    ),
    "json-not-utf8": (_request("POST", "/v1/hello", b"\xff\xfe"), 400, "UTF-8 JSON"),
    "hello-not-object": (_request("POST", "/v1/hello", b"[1]"), 400, "JSON object"),
    "body-too-large": (
        _request("POST", "/v1/hello", b"x" * (64 * 1024 + 1)),
        413,
        "exceeds",
    ),
    "request-line": (b"GARBAGE\r\n\r\n", 400, "request line"),
    "header-line": (b"GET /v1/task HTTP/1.1\r\nno colon\r\n\r\n", 400, "header"),
    "head-too-large": (
        b"GET /v1/task HTTP/1.1\r\nX: " + b"a" * 20_000 + b"\r\n\r\n",
        431,
        "head",
    ),
}


@pytest.mark.parametrize(
    ("data", "status", "reason"), BAD_REQUESTS.values(), ids=BAD_REQUESTS.keys()
)
def test_malformed_requests_get_a_4xx_json_error_and_the_server_keeps_serving(
    data, status, reason
):
    with running_bridge() as (_, _, server, phone):
        answers = _answers(_raw(server.port, data))
        assert answers, "the server closed the connection without an answer"
        got, headers, body = answers[0]
        assert got == status
        assert headers["content-type"] == "application/json"
        assert reason in json.loads(body)["error"]
        assert phone("alice").hello()["phone"] == "alice"  # still serving


def test_unread_body_after_an_error_never_becomes_the_next_request():
    """Issue 17: after a 404 on a keep-alive connection the unread body was read as
    the next request (an HTML 400). A body the server did not read closes the
    connection; a body it read keeps it in step."""
    smuggled = b"GET /v1/task HTTP/1.1\r\n\r\n"
    with running_bridge() as (_, _, server, phone):
        phone("alice").hello()
        # Upload to an unknown task: refused before its body is read -> close.
        put = _request("PUT", "/v1/task/nope/result?offset=0&total=25", smuggled)
        answers = _answers(_raw(server.port, put))
        assert [(s, h.get("connection")) for s, h, _ in answers] == [(404, "close")]
        # Complete of an unknown task: body read, 404, then the next request works.
        two = _request("POST", "/v1/task/nope/complete", b'{"metrics": {}}')
        two += _request("GET", "/v1/task?wait=0", extra="Connection: close\r\n")
        answers = _answers(_raw(server.port, two, answers=2))
        assert [s for s, _, _ in answers] == [404, 204]
        assert "error" in json.loads(answers[0][2])


def test_slow_and_idle_clients_cannot_pin_the_gateway():
    """Issue 17: 150 idle or slow connections stayed open, one thread each.

    With room for 6 connections: 12 idle sockets, 4 trickling a request head a
    byte at a time and 2 stalling half-way through a body. Idle and trickling
    connections beyond the limit are closed as new ones come; the stalled bodies
    time out; meanwhile a well-behaved phone trains three rounds.
    """
    settings = replace(
        SETTINGS, max_connections=6, idle_timeout_s=1.5, read_timeout_s=1.0, workers=2
    )
    with running_bridge(settings) as (flower, _, server, phone):
        alice = phone("alice")
        node = alice.hello()["node_id"]
        stop = threading.Event()
        attackers: list[socket.socket] = []
        peak = [0]

        def watch() -> None:
            while not stop.is_set():
                peak[0] = max(peak[0], server.open_connections)
                time.sleep(0.01)

        def trickle(s: socket.socket) -> None:
            for byte in b"GET /v1/task HTTP/1.1\r\nHost: x\r\n":
                if stop.is_set():
                    return
                try:
                    s.send(bytes([byte]))
                except OSError:
                    return
                time.sleep(0.2)

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            for _ in range(12):
                attackers.append(socket.create_connection(("127.0.0.1", server.port)))
            trickles = []
            for _ in range(4):
                s = socket.create_connection(("127.0.0.1", server.port))
                attackers.append(s)
                trickles.append(threading.Thread(target=trickle, args=(s,)))
                trickles[-1].start()
            for _ in range(2):
                s = socket.create_connection(("127.0.0.1", server.port))
                s.sendall(_request("POST", "/v1/hello", b"{" * 10)[:-6])  # 4 of 10
                attackers.append(s)
            for _ in range(3):
                reply = train_once(flower, alice, node)
                assert reply.has_content()
                np.testing.assert_array_equal(
                    reply.content["arrays"]["fc.weight"].numpy(), W + 1
                )
            time.sleep(settings.idle_timeout_s + 1.0)
            closed = sum(_closed_by_server(s) for s in attackers)
        finally:
            stop.set()
            watcher.join()
            for s in attackers:
                s.close()
        assert peak[0] <= 6
        assert closed == len(attackers), "every slow or idle connection was closed"


def _closed_by_server(s: socket.socket) -> bool:
    """Whether the server closed ``s`` (EOF or reset after any answer it sent)."""
    s.settimeout(0.5)
    try:
        while s.recv(65536):
            pass
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    return True


def test_a_full_gateway_refuses_new_connections_with_503():
    settings = replace(SETTINGS, max_connections=2, max_poll_s=3.0)
    with running_bridge(settings) as (_, gateway, server, phone):
        alice, bob = phone("alice"), phone("bob")
        alice.hello()
        bob.hello()
        polls = [threading.Thread(target=p.poll, args=(3,)) for p in (alice, bob)]
        for t in polls:
            t.start()
        _await_in_flight(gateway, {"alice": 1, "bob": 1})  # both in long polls
        answers = _answers(_raw(server.port, _request("GET", "/v1/task?wait=0")))
        for t in polls:
            t.join()
        assert [(s, h["connection"]) for s, h, _ in answers] == [(503, "close")]


def test_a_phone_is_limited_to_four_requests_at_once():
    settings = replace(SETTINGS, max_poll_s=2.0)
    with running_bridge(settings) as (_, gateway, _, phone):
        phones = [phone("alice") for _ in range(5)]
        phones[0].hello()
        results: queue.Queue = queue.Queue()

        def poll(p):
            try:
                results.put(p.poll(1.5))
            except RuntimeError as err:
                results.put(str(err))

        threads = [threading.Thread(target=poll, args=(p,)) for p in phones[:4]]
        for t in threads:
            t.start()
        _await_in_flight(gateway, {"alice": 4})
        resp = phones[4].request("GET", "/v1/task?wait=0")
        for t in threads:
            t.join()
        assert resp.status == 429
        assert [results.get() for _ in range(4)] == [None] * 4


def test_200_bad_requests_write_at_most_six_log_lines(caplog):
    """Issue 17: 200 bad requests wrote 350 log lines."""
    with running_bridge() as (_, _, _, phone):
        intruder = phone("alice")
        intruder.token = "tok-mallory-99999999"
        with caplog.at_level(logging.INFO, logger="flowerbed.bridge"):
            for _ in range(200):
                assert intruder.post_json("/v1/hello", {"protocol": 1}).status == 401
    lines = [r for r in caplog.records if r.name == "flowerbed.bridge"]
    assert 1 <= len(lines) <= 6
    assert all("refused request from 127.0.0.1" in r.message for r in lines)


def test_tokens_are_revoked_and_rotated_without_restart(tmp_path):
    path = tmp_path / "tokens.txt"
    path.write_text("".join(f"{t} {n}\n" for t, n in TOKENS.items()))
    table = TokenTable(load_tokens(path), path, check_interval_s=0.0)
    with running_bridge(tokens=table) as (_, _, _, phone):
        alice, bob = phone("alice"), phone("bob")
        node = alice.hello()["node_id"]
        bob.hello()
        # bob revoked; alice rotated to a new token.
        path.write_text("tok-alice-NEW-0123456789 alice\n")
        assert bob.post_json("/v1/hello", {"protocol": 1}).status == 401
        assert alice.post_json("/v1/hello", {"protocol": 1}).status == 401
        alice.token = "tok-alice-NEW-0123456789"
        assert alice.hello()["node_id"] == node  # same phone, same Flower node


def test_accepted_means_accepted():
    """Issue 17: an oversize PUT after a successful complete flipped the accepted
    task to failed, and Flower received an error reply."""
    with running_bridge() as (flower, gateway, _, phone):
        alice = phone("alice")
        flower.send(alice.hello()["node_id"], "train", {})
        task_id = alice.poll(2)["task_id"]
        alice.upload(task_id, [("fc.weight", W), ("fc.bias", B)])
        assert alice.complete(task_id, {"num-examples": 5}).json() == {
            "status": "accepted"
        }
        url = f"/v1/task/{task_id}/result?offset=0&total="
        late = [
            alice.request("PUT", url + "10000", b"x" * 32),  # over max_upload_bytes
            alice.request("PUT", url + str(len(BLOB)), BLOB[:32]),
            alice.post_json(f"/v1/task/{task_id}/fail", {"reason": "changed my mind"}),
            alice.post_json(f"/v1/task/{task_id}/complete", {"metrics": {}}),
        ]
        assert [r.status for r in late] == [409, 409, 409, 200]
        assert gateway.phone("alice").task.outcome.status == "accepted"
        assert flower.reply().has_content()
        with pytest.raises(queue.Empty):
            flower.reply(timeout=0.3)  # exactly one reply


@pytest.mark.parametrize(
    ("metrics", "reason"),
    [
        ({"num-examples": 5, "train-time-s": -2.0}, "'train-time-s' is negative"),
        ({"num-examples": 5, "num-steps": -1}, "'num-steps' is negative"),
        ({"num-examples": -5}, "'num-examples' is negative"),
    ],
)
def test_complete_validates_metrics_as_the_strategies_do(metrics, reason):
    """Issue 17: complete accepted a negative train-time-s and relayed it."""
    with running_bridge() as (flower, _, _, phone):
        alice = phone("alice")
        flower.send(alice.hello()["node_id"], "train", {})
        task_id = alice.poll(2)["task_id"]
        alice.upload(task_id, [("fc.weight", W), ("fc.bias", B)])
        resp = alice.complete(task_id, metrics)
        assert resp.status == 400 and reason in resp.json()["error"]
        error = flower.reply()
        assert error.has_error() and reason in error.error.reason


def test_an_upload_of_another_size_than_the_arrays_sent_is_refused_at_once():
    """Decode cost is bounded by the model: a result must be exactly as large as the
    arrays sent (same names, shapes, float32), so a blob of millions of tiny tensors
    is refused at its first chunk."""
    with running_bridge() as (flower, _, _, phone):
        alice = phone("alice")
        flower.send(alice.hello()["node_id"], "train", {})
        task_id = alice.poll(2)["task_id"]
        resp = alice.request(
            "PUT", f"/v1/task/{task_id}/result?offset=0&total=180", b"FBT1" + b"\0" * 28
        )
        assert resp.status == 400
        assert f"total must be {len(BLOB)}" in resp.json()["error"]
        assert alice.poll(0)["task_id"] == task_id  # the task is still open


# -- command line and state dir ------------------------------------------------------


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers())
    return parser.parse_args(["bridge", "--tokens", "t", *argv])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--port", "99999"], "port 99999 is outside 0..65535"),
        (["--port", "http"], "not a port number"),
        (["--pull-interval-s", "nan"], "must be finite and > 0"),
        (["--offline-after-s", "inf"], "must be finite and > 0"),
        (["--deadline-slack-s", "nan"], "must be finite and >= 0"),
        (["--deadline-slack-s", "-1"], "must be finite and >= 0"),
        (["--max-upload-mb", "nan"], "must be finite and > 0"),
        (["--max-upload-mb", "0"], "must be finite and > 0"),
        (["--max-poll-s=-inf"], "must be finite and > 0"),
        (["--chunk-kb", "1.5"], "not an integer"),
        (["--max-connections", "0"], "must be finite and >= 1"),
    ],
)
def test_bad_command_line_values_are_refused_with_the_valid_range(
    argv, message, capsys
):
    with pytest.raises(SystemExit) as exit_info:
        _parse(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_a_state_dir_that_is_a_file_is_refused_before_serving(tmp_path, caplog):
    tokens = tmp_path / "tokens.txt"
    tokens.write_text(f"{ALICE} alice\n")
    state = tmp_path / "state"
    state.write_text("not a directory")
    args = _parse(["--state-dir", str(state)])
    args.tokens = str(tokens)
    with caplog.at_level(logging.ERROR, logger="flowerbed.bridge"):
        assert args.func(args) == 2
    assert f"state dir {state} exists and is not a directory" in caplog.text


def test_stale_tmp_files_of_a_killed_key_write_are_removed(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    (state / "alice.pem.4242.tmp").write_bytes(b"-----BEGIN PRIV")  # killed mid-write
    (state / "keep.pem").write_bytes(b"not touched")
    connector = SuperLinkConnector("127.0.0.1:1", True, state_dir=state)
    assert sorted(p.name for p in state.iterdir()) == ["keep.pem"]
    connector.new_identity("alice")
    assert sorted(p.name for p in state.iterdir()) == ["alice.pem", "keep.pem"]
    assert (state / "alice.pem").stat().st_mode & 0o777 == 0o600


def test_state_dir_errors_name_the_path(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(StateDirError, match="cannot be created or written"):
        SuperLinkConnector("127.0.0.1:1", True, state_dir=blocker / "sub")
