"""Gateway endpoints (android_client/PROTOCOL.md) against a fake Flower side
(tests/bridge_fakes.py)."""

from __future__ import annotations

import logging
import queue
import time

import numpy as np
import pytest
from bridge_fakes import (
    BLOB,
    TOKENS,
    B,
    FakeFlower,
    W,
    running_bridge,
    self_signed,
    task_identity,  # noqa: F401 (fixture)
)
from flowerbed.clients.bridge.gateway import Gateway, GatewaySettings
from flowerbed.clients.bridge.server import GatewayServer
from flowerbed.clients.bridge.simphone import SimPhone

# Messages built outside a Flower runtime need a task identity.
pytestmark = pytest.mark.usefixtures("task_identity")


@pytest.fixture()
def bridge():
    with running_bridge() as (flower, gateway, _, phone):
        yield flower, gateway, phone


def _task(phone: SimPhone) -> dict:
    task = phone.poll(2)
    assert task is not None, "expected a task"
    return task


def test_hello_gives_the_node_id_and_the_limits(bridge):
    flower, _, phone = bridge
    info = phone("alice").hello({"model": "Pixel 7", "cores": 8})
    assert info == {
        "node_id": 101,
        "phone": "alice",
        "poll_s": 5,
        "max_upload_bytes": 200,
        "chunk_bytes": 32,
    }
    assert flower.registrations == 1


@pytest.mark.parametrize("token", ["", "tok-mallory-99999999"])
def test_unknown_or_missing_token_is_refused_and_logged(bridge, caplog, token):
    _, gateway, phone = bridge
    intruder = phone("alice")
    intruder.token = token
    with caplog.at_level(logging.WARNING, logger="flowerbed.bridge"):
        resp = intruder.post_json("/v1/hello", {"protocol": 1})
    assert resp.status == 401
    assert "error" in resp.json()
    assert any("refused request from 127.0.0.1:" in r.message for r in caplog.records)
    assert all(
        p.last_seen is None and p.node_id is None for p in gateway.phones.values()
    )


def test_other_protocol_versions_get_426_with_the_supported_list(bridge):
    _, _, phone = bridge
    alice = phone("alice")
    resp = alice.post_json("/v2/hello", {"protocol": 2})  # another API path
    assert (resp.status, resp.json()["supported"]) == (426, [1, 2])
    resp = alice.post_json("/v1/hello", {"protocol": 3})
    assert (resp.status, resp.json()["supported"]) == (426, [1, 2])


def test_train_task_round_trip_relays_arrays_and_metrics(bridge):
    flower, _, phone = bridge
    alice = phone("alice")
    node = alice.hello()["node_id"]
    msg = flower.send(node, "train", {"lr": 0.1, "server-round": 3})
    task = _task(alice)
    assert task["type"] == "train"
    assert task["config"] == {"lr": 0.1, "server-round": 3}
    # 8 header + fc.weight (2+9+1+1+8 + 6*4) + fc.bias (2+7+1+1+4 + 2*4)
    assert task["arrays_bytes"] == 8 + 45 + 23 == len(BLOB)
    tensors = alice.download(task["task_id"])
    np.testing.assert_array_equal(tensors[0][1], W)
    new = [("fc.weight", W + 1), ("fc.bias", B - 1)]
    alice.upload(task["task_id"], new)
    metrics = {"num-examples": 40, "train-time-s": 1.5, "num-steps": 10}
    assert alice.complete(task["task_id"], metrics).json() == {"status": "accepted"}
    reply = flower.reply()
    assert reply.metadata.reply_to_message_id == msg.metadata.message_id
    np.testing.assert_array_equal(reply.content["arrays"]["fc.weight"].numpy(), W + 1)
    assert dict(reply.content["metrics"]) == metrics
    assert alice.poll(0) is None  # done: no task any more


def test_range_download_resumes_with_206(bridge):
    flower, _, phone = bridge
    alice = phone("alice")
    flower.send(alice.hello()["node_id"], "train", {})
    task_id = _task(alice)["task_id"]
    resp = alice.request(
        "GET", f"/v1/task/{task_id}/arrays", headers={"Range": "bytes=10-"}
    )
    assert resp.status == 206
    assert resp.headers["content-range"] == f"bytes 10-{len(BLOB) - 1}/{len(BLOB)}"
    assert resp.body == BLOB[10:]
    past_end = {"Range": f"bytes={len(BLOB)}-"}
    resp = alice.request("GET", f"/v1/task/{task_id}/arrays", headers=past_end)
    assert resp.status == 416


def test_chunk_at_the_wrong_offset_gets_409_with_bytes_received(bridge):
    flower, _, phone = bridge
    alice = phone("alice")
    flower.send(alice.hello()["node_id"], "train", {})
    task_id = _task(alice)["task_id"]
    url = f"/v1/task/{task_id}/result?offset={{}}&total={len(BLOB)}"
    assert alice.request("PUT", url.format(0), BLOB[:32]).json() == {"received": 32}
    resp = alice.request("PUT", url.format(64), BLOB[64:])  # skipped 32..64
    assert (resp.status, resp.json()["received"]) == (409, 32)
    assert alice.request("PUT", url.format(32), BLOB[32:64]).json() == {"received": 64}
    assert alice.request("PUT", url.format(64), BLOB[64:]).json() == {"received": 76}
    assert alice.complete(task_id, {"num-examples": 1}).status == 200
    reply = flower.reply()
    np.testing.assert_array_equal(reply.content["arrays"]["fc.bias"].numpy(), B)


def test_oversize_upload_fails_only_that_phone(bridge, caplog):
    flower, _, phone = bridge
    alice, bob = phone("alice"), phone("bob")
    flower.send(alice.hello()["node_id"], "train", {})
    flower.send(bob.hello()["node_id"], "train", {})
    a_task, b_task = _task(alice)["task_id"], _task(bob)["task_id"]
    with caplog.at_level(logging.WARNING, logger="flowerbed.bridge"):
        resp = alice.request(
            "PUT", f"/v1/task/{a_task}/result?offset=0&total=201", b"x" * 32
        )
    assert resp.status == 413
    assert any("phone alice at 127.0.0.1:" in r.message for r in caplog.records)
    error = flower.reply()
    assert error.has_error() and "exceeds the limit of 200" in error.error.reason
    assert error.metadata.dst_node_id == 0  # to the ServerApp; from alice's node
    bob.upload(b_task, [("fc.weight", W), ("fc.bias", B)])
    assert bob.complete(b_task, {"num-examples": 5}).status == 200
    assert flower.reply().has_content()


def test_malformed_upload_is_rejected_and_relayed_as_an_error(bridge):
    flower, _, phone = bridge
    alice, bob = phone("alice"), phone("bob")
    flower.send(alice.hello()["node_id"], "train", {})
    flower.send(bob.hello()["node_id"], "train", {})
    a_task, b_task = _task(alice)["task_id"], _task(bob)["task_id"]
    alice.upload(a_task, [("fc.weight", W.T.copy()), ("fc.bias", B)])  # wrong shape
    resp = alice.complete(a_task, {"num-examples": 5})
    assert resp.status == 400
    assert "shape [3, 2]" in resp.json()["error"]
    error = flower.reply()
    assert error.has_error() and "shape [3, 2]" in error.error.reason
    bob.upload(b_task, [("fc.weight", W), ("fc.bias", B)])
    assert bob.complete(b_task, {"num-examples": 5}).status == 200
    assert flower.reply().has_content()


def test_train_metrics_need_num_examples(bridge):
    flower, _, phone = bridge
    alice = phone("alice")
    flower.send(alice.hello()["node_id"], "train", {})
    task_id = _task(alice)["task_id"]
    alice.upload(task_id, [("fc.weight", W), ("fc.bias", B)])
    resp = alice.complete(task_id, {"train-time-s": 2.0})
    assert resp.status == 400 and "num-examples" in resp.json()["error"]
    assert flower.reply().has_error()


def test_evaluate_task_replies_metrics_only(bridge):
    flower, _, phone = bridge
    alice = phone("alice")
    flower.send(alice.hello()["node_id"], "evaluate", {})
    task = _task(alice)
    assert task["type"] == "evaluate"
    metrics = {"num-examples": 30, "eval-loss": 0.7, "eval-acc": 0.8}
    assert alice.complete(task["task_id"], metrics).status == 200
    reply = flower.reply()
    assert list(reply.content.array_records) == []
    assert dict(reply.content["metrics"]) == metrics


def test_fail_relays_the_phones_reason(bridge):
    flower, _, phone = bridge
    alice = phone("alice")
    flower.send(alice.hello()["node_id"], "train", {})
    task_id = _task(alice)["task_id"]
    assert alice.fail(task_id, "battery at 4%").status == 200
    reply = flower.reply()
    assert reply.has_error() and "battery at 4%" in reply.error.reason


def test_unsupported_message_type_gets_an_error_reply(bridge):
    flower, _, phone = bridge
    alice = phone("alice")
    flower.send(alice.hello()["node_id"], "query", {})
    reply = flower.reply()
    assert reply.has_error() and "not 'query'" in reply.error.reason
    assert alice.poll(0) is None


def test_task_expires_after_deadline_plus_slack_and_nothing_is_relayed(bridge):
    flower, _, phone = bridge
    alice = phone("alice")
    flower.send(alice.hello()["node_id"], "train", {"deadline-s": 0.3})
    task = _task(alice)
    assert 0 < task["expires_in_s"] <= 0.5  # deadline 0.3 s + slack 0.2 s
    time.sleep(0.6)
    assert alice.poll(0) is None
    resp = alice.request("GET", f"/v1/task/{task['task_id']}/arrays")
    assert resp.status == 404
    with pytest.raises(queue.Empty):
        flower.reply(timeout=0.3)


def test_reconnect_after_silence_keeps_the_node_id(bridge):
    flower, _, phone = bridge
    alice = phone("alice")
    heard = time.monotonic()  # the gateway last hears alice after this
    node = alice.hello()["node_id"]
    deadline = time.monotonic() + 3
    while node not in flower.active and time.monotonic() < deadline:
        time.sleep(0.02)
    assert node in flower.active
    alice.close()
    deadline = time.monotonic() + 10
    while node in flower.active and time.monotonic() < deadline:
        time.sleep(0.02)
    # deactivated (not sampled any more), not before offline_after_s = 1 s
    assert node not in flower.active
    assert time.monotonic() - heard >= 1.0
    assert phone("alice").hello()["node_id"] == node  # a new connection
    deadline = time.monotonic() + 3
    while node not in flower.active and time.monotonic() < deadline:
        time.sleep(0.02)
    assert node in flower.active
    assert flower.registrations == 1


def test_https_gateway_serves_phones_that_trust_its_certificate(tmp_path):
    import ssl

    cert, key = self_signed(tmp_path)
    gateway = Gateway(TOKENS, FakeFlower(), GatewaySettings(pull_interval_s=0.05))
    server = GatewayServer(gateway, "127.0.0.1", 0, certfile=cert, keyfile=key)
    server.start()
    try:
        assert server.url.startswith("https://127.0.0.1:")
        trusting = ssl.create_default_context(cafile=cert)
        phone = SimPhone(server.url, "tok-alice-0123456789", ssl_context=trusting)
        assert phone.hello()["node_id"] == 101
        phone.close()
        stranger = SimPhone(server.url, "tok-bob-000123456789")  # system CAs only
        with pytest.raises(ssl.SSLCertVerificationError):
            stranger.hello()
    finally:
        server.stop()
