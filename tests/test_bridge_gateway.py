"""Gateway endpoints (android_client/PROTOCOL.md) against a fake Flower side.

The fake stands in for the SuperLink: it hands out node ids, queues messages per
node, records which nodes are activated and collects the replies the relays push.
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
from flowerbed.clients.bridge.codec import encode_tensors
from flowerbed.clients.bridge.gateway import Gateway, GatewaySettings
from flowerbed.clients.bridge.server import GatewayServer
from flowerbed.clients.bridge.simphone import SimPhone
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.supercore.task_identity import TaskIdentity

TOKENS = {"tok-alice-0123456789": "alice", "tok-bob-000123456789": "bob"}
W = np.arange(6, dtype=np.float32).reshape(2, 3)
B = np.array([0.5, -0.5], dtype=np.float32)
BLOB = encode_tensors([("fc.weight", W), ("fc.bias", B)])


class FakeLink:
    def __init__(self, node_id: int, inbox: queue.Queue, replies: queue.Queue):
        self.node_id = node_id
        self._inbox = inbox
        self._replies = replies

    def receive(self) -> Message | None:
        try:
            return self._inbox.get_nowait()
        except queue.Empty:
            return None

    def send(self, reply: Message) -> None:
        self._replies.put(reply)


class FakeFlower:
    """Node ids from 101 on, one message queue per node, replies in one queue."""

    def __init__(self) -> None:
        self.ids: dict[object, int] = {}
        self.inbox: dict[int, queue.Queue] = {}
        self.replies: queue.Queue = queue.Queue()
        self.active: set[int] = set()
        self.registrations = 0

    def new_identity(self, phone_name: str) -> object:
        return object()

    def register(self, identity: object) -> int:
        self.registrations += 1
        node_id = 101 + len(self.ids)
        self.ids[identity] = node_id
        self.inbox[node_id] = queue.Queue()
        return node_id

    @contextmanager
    def connect(self, identity: object) -> Iterator[FakeLink]:
        node_id = self.ids[identity]
        self.active.add(node_id)
        try:
            yield FakeLink(node_id, self.inbox[node_id], self.replies)
        finally:
            self.active.discard(node_id)

    def send(self, node_id: int, kind: str, config: dict, ttl: float = 60.0) -> Message:
        content = RecordDict(
            {
                "arrays": ArrayRecord({"fc.weight": Array(W), "fc.bias": Array(B)}),
                "config": ConfigRecord(config),
            }
        )
        msg = Message(content, dst_node_id=node_id, message_type=kind, ttl=ttl)
        msg.metadata.__dict__["_message_id"] = f"msg-{node_id}-{kind}-{time.time()}"
        self.inbox[node_id].put(msg)
        return msg

    def reply(self, timeout: float = 5.0) -> Message:
        return self.replies.get(timeout=timeout)


@pytest.fixture(autouse=True)
def _task_identity():
    """Messages built outside a Flower runtime need a task identity (run 7)."""
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 7, 0
    yield
    TaskIdentity._task_id = TaskIdentity._run_id = TaskIdentity._node_id = None


@pytest.fixture()
def bridge():
    flower = FakeFlower()
    settings = GatewaySettings(
        max_upload_bytes=200,
        chunk_bytes=32,
        max_poll_s=2.0,
        offline_after_s=1.0,
        deadline_slack_s=0.2,
        pull_interval_s=0.02,
    )
    gateway = Gateway(TOKENS, flower, settings)
    server = GatewayServer(gateway, "127.0.0.1", 0).start()
    phones: list[SimPhone] = []

    def phone(name: str) -> SimPhone:
        token = next(t for t, n in TOKENS.items() if n == name)
        p = SimPhone(server.url, token, timeout=10)
        phones.append(p)
        return p

    try:
        yield flower, gateway, phone
    finally:
        for p in phones:
            p.close()
        server.stop()


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
    resp = alice.post_json("/v2/hello", {"protocol": 2})
    assert (resp.status, resp.json()["supported"]) == (426, [1])
    resp = alice.post_json("/v1/hello", {"protocol": 2})
    assert (resp.status, resp.json()["supported"]) == (426, [1])


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
    node = alice.hello()["node_id"]
    deadline = time.monotonic() + 3
    while node not in flower.active and time.monotonic() < deadline:
        time.sleep(0.02)
    assert node in flower.active
    alice.close()
    time.sleep(1.5)  # silent for longer than offline_after_s = 1 s
    assert node not in flower.active  # node deactivated, not sampled any more
    assert phone("alice").hello()["node_id"] == node  # a new connection
    deadline = time.monotonic() + 3
    while node not in flower.active and time.monotonic() < deadline:
        time.sleep(0.02)
    assert node in flower.active
    assert flower.registrations == 1


def _self_signed(tmp_path) -> tuple[str, str]:
    """A certificate for 127.0.0.1 and its key, as PEM files."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "gateway")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return str(cert_path), str(key_path)


def test_https_gateway_serves_phones_that_trust_its_certificate(tmp_path):
    import ssl

    cert, key = _self_signed(tmp_path)
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
