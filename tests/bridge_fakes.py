"""Fakes shared by the gateway tests: a fake Flower side and a running bridge.

The fake stands in for the SuperLink: it hands out node ids, queues messages per
node, records which nodes are activated and collects the replies the relays push.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Iterator
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


@pytest.fixture()
def task_identity():
    """Messages built outside a Flower runtime need a task identity (run 7)."""
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 7, 0
    yield
    TaskIdentity._task_id = TaskIdentity._run_id = TaskIdentity._node_id = None


SETTINGS = GatewaySettings(
    max_upload_bytes=200,
    chunk_bytes=32,
    max_poll_s=2.0,
    offline_after_s=1.0,
    deadline_slack_s=0.2,
    pull_interval_s=0.02,
)
"""Small limits and fast timings for tests (the blob of W and B is 76 bytes)."""


@contextmanager
def running_bridge(
    settings: GatewaySettings = SETTINGS, tokens: object = None, programs: tuple = ()
) -> Iterator[tuple[FakeFlower, Gateway, GatewayServer, Callable[[str], SimPhone]]]:
    """A gateway on a free port with a fake Flower side; everything stopped after."""
    flower = FakeFlower()
    gateway = Gateway(
        TOKENS if tokens is None else tokens, flower, settings, programs=programs
    )
    server = GatewayServer(gateway, "127.0.0.1", 0).start()
    phones: list[SimPhone] = []

    def phone(name: str) -> SimPhone:
        token = next(t for t, n in TOKENS.items() if n == name)
        p = SimPhone(server.url, token, timeout=10)
        phones.append(p)
        return p

    try:
        yield flower, gateway, server, phone
    finally:
        for p in phones:
            p.close()
        server.stop()


def train_once(flower: FakeFlower, phone: SimPhone, node: int) -> Message:
    """Send one train message to ``node``; ``phone`` runs it; return the reply."""
    flower.send(node, "train", {})
    task = phone.poll(2)
    assert task is not None, "expected a task"
    tensors = phone.download(task["task_id"])
    phone.upload(task["task_id"], [(n, a + 1) for n, a in tensors])
    assert phone.complete(task["task_id"], {"num-examples": 4}).status == 200
    return flower.reply()


def self_signed(tmp_path) -> tuple[str, str]:
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
