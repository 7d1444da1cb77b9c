"""The gateway: phones by token, their tasks, and one Flower node relay each.

:class:`Gateway` holds the protocol's logic (android_client/PROTOCOL.md) without
HTTP: ``server.py`` maps requests onto its methods, and each phone's
:class:`~flowerbed.clients.bridge.relay.NodeRelay` hands it tasks. A phone counts as
connected while it made a request within ``offline_after_s`` or has a task open;
only then is its Flower node activated, so a phone that went away is not sampled
and never blocks another phone.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from flowerbed.clients.bridge.relay import NodeConnector, NodeRelay
from flowerbed.clients.bridge.tasks import ProtocolError, Task

log = logging.getLogger("flowerbed.bridge")

PROTOCOL_VERSION = 1
SUPPORTED_VERSIONS = (PROTOCOL_VERSION,)


@dataclass(frozen=True)
class GatewaySettings:
    """Limits and timings of a gateway.

    Parameters
    ----------
    max_upload_bytes : int
        Largest result blob a phone may upload (default 64 MiB); larger: 413.
    chunk_bytes : int
        Largest upload chunk (default 1 MiB).
    max_poll_s : float
        Cap on a long poll's ``wait`` (default 20 s).
    poll_s : int
        Seconds a phone is told to wait between polls after an error (default 5).
    offline_after_s : float
        A phone silent this long, with no open task, is disconnected and its node
        deactivated (default 60 s).
    deadline_slack_s : float
        Seconds after a config's ``deadline-s`` before its task expires (default 30).
    pull_interval_s : float
        Seconds between a node's pulls when idle (default 3, as Flower's SuperNode).
    """

    max_upload_bytes: int = 64 * 2**20
    chunk_bytes: int = 2**20
    max_poll_s: float = 20.0
    poll_s: int = 5
    offline_after_s: float = 60.0
    deadline_slack_s: float = 30.0
    pull_interval_s: float = 3.0

    def __post_init__(self) -> None:
        for name in (
            "max_upload_bytes",
            "chunk_bytes",
            "max_poll_s",
            "poll_s",
            "offline_after_s",
            "pull_interval_s",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.deadline_slack_s < 0:
            raise ValueError(
                f"deadline_slack_s must be >= 0, got {self.deadline_slack_s}"
            )


@dataclass
class Phone:
    """One phone, known by its token; survives reconnects."""

    name: str
    token: str
    identity: Any = None
    node_id: int | None = None
    last_seen: float | None = None
    address: str = ""
    device: dict[str, Any] = field(default_factory=dict)
    task: Task | None = None


class Gateway:
    """Phones, tasks and node relays of one ``flowerbed bridge`` process.

    Parameters
    ----------
    tokens : dict[str, str]
        ``{token: phone_name}``.
    connector : NodeConnector
        Opens Flower node connections (the SuperLink, or a fake in tests).
    settings : GatewaySettings
        Limits and timings.
    clock : Callable[[], float]
        Monotonic seconds (injectable for tests).
    """

    def __init__(
        self,
        tokens: dict[str, str],
        connector: NodeConnector,
        settings: GatewaySettings | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings or GatewaySettings()
        self.connector = connector
        self.clock = clock
        self.phones = {token: Phone(name, token) for token, name in tokens.items()}
        self._by_name = {p.name: p for p in self.phones.values()}
        self._relays: dict[str, NodeRelay] = {}
        self._cond = threading.Condition()
        self._register_lock = threading.Lock()

    # -- authentication ---------------------------------------------------------
    def authenticate(self, authorization: str | None, address: str) -> Phone:
        """The phone of a ``Bearer`` token; 401 (logged with the address) otherwise."""
        scheme, _, token = (authorization or "").partition(" ")
        phone = self.phones.get(token.strip()) if scheme.lower() == "bearer" else None
        if phone is None:
            log.warning(
                "refused request from %s: %s",
                address,
                "no bearer token" if not token else "unknown token",
            )
            raise ProtocolError(401, "missing or unknown bearer token")
        with self._cond:
            phone.last_seen = self.clock()
            phone.address = address
            self._cond.notify_all()
        return phone

    def phone(self, name: str) -> Phone:
        """The phone called ``name`` (KeyError lists the known names)."""
        try:
            return self._by_name[name]
        except KeyError:
            raise KeyError(
                f"no phone {name!r}; known: {sorted(self._by_name)}"
            ) from None

    # -- endpoints ------------------------------------------------------------------
    def hello(self, phone: Phone, body: Any) -> dict[str, Any]:
        """``POST /v1/hello``: register the phone's node once, start its relay."""
        if not isinstance(body, dict):
            raise ProtocolError(400, "hello body must be a JSON object")
        version = body.get("protocol")
        if version not in SUPPORTED_VERSIONS:
            raise ProtocolError(
                426,
                f"protocol version {version!r} not supported",
                supported=list(SUPPORTED_VERSIONS),
            )
        device = body.get("device", {})
        phone.device = device if isinstance(device, dict) else {"raw": str(device)}
        with self._register_lock:
            if phone.node_id is None:
                identity = self.connector.new_identity(phone.name)
                try:
                    node_id = self.connector.register(identity)
                except Exception as err:
                    log.warning(
                        "phone %s: node registration failed: %s", phone.name, err
                    )
                    raise ProtocolError(
                        503, "the gateway cannot reach Flower's SuperLink; retry later"
                    ) from err
                phone.identity, phone.node_id = identity, node_id
                relay = NodeRelay(
                    phone.name,
                    identity,
                    self.connector,
                    self,
                    deadline_slack_s=self.settings.deadline_slack_s,
                    pull_interval_s=self.settings.pull_interval_s,
                )
                self._relays[phone.name] = relay
                relay.start()
        log.info(
            "hello from phone %s (node %s) at %s: %s",
            phone.name,
            phone.node_id,
            phone.address,
            phone.device,
        )
        return {
            "node_id": phone.node_id,
            "phone": phone.name,
            "poll_s": self.settings.poll_s,
            "max_upload_bytes": self.settings.max_upload_bytes,
            "chunk_bytes": self.settings.chunk_bytes,
        }

    def poll(self, phone: Phone, wait_s: float) -> Task | None:
        """``GET /v1/task``: the open task, waiting up to ``wait_s`` (capped)."""
        if phone.node_id is None:
            raise ProtocolError(409, "say hello first: POST /v1/hello")
        deadline = self.clock() + min(max(wait_s, 0.0), self.settings.max_poll_s)
        with self._cond:
            while True:
                task = phone.task
                if task is not None and task.is_open():
                    return task
                remaining = deadline - self.clock()
                if remaining <= 0:
                    return None
                self._cond.wait(timeout=min(remaining, 1.0))
                phone.last_seen = self.clock()

    def task(self, phone: Phone, task_id: str) -> Task:
        """The phone's task ``task_id`` (open, or ended with an outcome); else 404."""
        task = phone.task
        if (
            task is None
            or task.task_id != task_id
            or (task.outcome is None and not task.is_open())
        ):
            raise ProtocolError(404, f"unknown or expired task {task_id!r}")
        return task

    # -- relay side -----------------------------------------------------------------
    def offer(self, phone_name: str, task: Task) -> None:
        """A relay hands its phone a new task; waiting polls wake up."""
        with self._cond:
            self._by_name[phone_name].task = task
            self._cond.notify_all()

    def wants_node(self, phone_name: str) -> bool:
        """Whether the phone's node should be online: seen lately, or a task open."""
        phone = self._by_name[phone_name]
        if phone.task is not None and phone.task.is_open():
            return True
        seen = phone.last_seen
        return seen is not None and self.clock() - seen < self.settings.offline_after_s

    def wait_for_phone(self, phone_name: str, timeout: float) -> None:
        """Block until any phone makes a request, or ``timeout`` passes."""
        with self._cond:
            self._cond.wait(timeout=timeout)

    def relay_active(self, phone_name: str) -> bool:
        """Whether the phone's Flower node is currently activated."""
        relay = self._relays.get(phone_name)
        return relay is not None and relay.active.is_set()

    def stop(self) -> None:
        """Expire open tasks and stop every relay (their nodes are deactivated)."""
        for phone in self.phones.values():
            if phone.task is not None:
                phone.task.cancel()
        relays = list(self._relays.values())
        for relay in relays:
            relay.request_stop()
        with self._cond:
            self._cond.notify_all()
        for relay in relays:
            relay.join()

    def status(self) -> list[dict[str, Any]]:
        """One row per phone: name, node id, connected, counts (for logs/tests)."""
        return [
            {
                "phone": p.name,
                "node_id": p.node_id,
                "connected": p.node_id is not None and self.wants_node(p.name),
                "node_active": self.relay_active(p.name),
                **(self._relays[p.name].counts if p.name in self._relays else {}),
                "address": p.address,
            }
            for p in self.phones.values()
        ]
