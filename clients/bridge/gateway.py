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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from flowerbed.clients.bridge.programs import PROGRAM_CONFIG_KEY, Program
from flowerbed.clients.bridge.ratelog import RateLimitedLog
from flowerbed.clients.bridge.relay import NodeConnector, NodeRelay
from flowerbed.clients.bridge.settings import GatewaySettings
from flowerbed.clients.bridge.tasks import ProtocolError, Task, TaskBuildError
from flowerbed.clients.bridge.tokens import TokenTable

log = logging.getLogger("flowerbed.bridge")

PROTOCOL_VERSION = 2
"""Newest protocol revision (android_client/PROTOCOL.md); 2 adds program delivery."""
SUPPORTED_VERSIONS = (1, 2)
"""Revisions this gateway speaks; every revision lives under the ``/v1`` path."""
PATH_VERSION = 1
"""The version in the URL path (``/v1``); it changes only if the paths do."""


def negotiate(hello: Mapping[str, Any]) -> int:
    """The protocol revision of a hello: the newest both sides speak.

    A phone lists its revisions in ``protocols`` (revision 2 on) or names one in
    ``protocol`` (revision 1). No common revision: ``426`` with the revisions the
    gateway speaks and a request to update the app.
    """
    offered = hello.get("protocols", [hello.get("protocol")])
    if not isinstance(offered, list):
        offered = [offered]
    common = [
        v
        for v in offered
        if isinstance(v, int) and not isinstance(v, bool) and v in SUPPORTED_VERSIONS
    ]
    if not common:
        raise ProtocolError(
            426,
            f"protocol revisions {offered!r:.100} not supported; this gateway speaks "
            f"{list(SUPPORTED_VERSIONS)}: update the flowerbed app",
            supported=list(SUPPORTED_VERSIONS),
            update=True,
        )
    return max(common)


@dataclass
class Phone:
    """One phone, known by its name; survives reconnects and token rotation."""

    name: str
    identity: Any = None
    node_id: int | None = None
    last_seen: float | None = None
    address: str = ""
    device: dict[str, Any] = field(default_factory=dict)
    task: Task | None = None
    in_flight: int = 0
    """Requests of this phone being served now (capped by the server)."""
    protocol: int = 1
    """The protocol revision agreed at hello."""


class Gateway:
    """Phones, tasks and node relays of one ``flowerbed bridge`` process.

    Parameters
    ----------
    tokens : TokenTable | Mapping[str, str]
        The phones' tokens: a :class:`~flowerbed.clients.bridge.tokens.TokenTable`
        (reloaded when its file changes), or a fixed ``{token: phone_name}``.
    connector : NodeConnector
        Opens Flower node connections (the SuperLink, or a fake in tests).
    settings : GatewaySettings
        Limits and timings.
    clock : Callable[[], float]
        Monotonic seconds (injectable for tests).
    programs : Sequence[Program]
        Training programs to serve (revision 2); the first is the default of tasks
        whose config names none (key ``program``).
    """

    def __init__(
        self,
        tokens: TokenTable | Mapping[str, str],
        connector: NodeConnector,
        settings: GatewaySettings | None = None,
        clock: Callable[[], float] = time.monotonic,
        programs: Sequence[Program] = (),
    ) -> None:
        self.programs = {p.name: p for p in programs}
        if len(self.programs) != len(programs):
            raise ValueError("two programs share a model name; give each its own")
        self._programs_by_hash = {p.sha256: p for p in programs}
        self._default_program = programs[0] if programs else None
        self.settings = settings or GatewaySettings()
        self.connector = connector
        self.clock = clock
        self.tokens = (
            tokens if isinstance(tokens, TokenTable) else TokenTable.from_tokens(tokens)
        )
        self._by_name: dict[str, Phone] = {}
        self._relays: dict[str, NodeRelay] = {}
        self._cond = threading.Condition()
        self._register_lock = threading.Lock()
        self._listeners: list[Callable[[str], None]] = []
        self.refusals = RateLimitedLog(log)
        """Rate-limited log of refused and rejected requests."""

    @property
    def phones(self) -> dict[str, Phone]:
        """Every phone seen or listed in the token table, by name."""
        with self._cond:
            for name in self.tokens.names():
                self._by_name.setdefault(name, Phone(name))
            return dict(self._by_name)

    # -- authentication ---------------------------------------------------------
    def authenticate(self, authorization: str | None, address: str) -> Phone:
        """The phone of a ``Bearer`` token; 401 (logged, rate-limited) otherwise."""
        scheme, _, token = (authorization or "").partition(" ")
        token = token.strip()
        name = self.tokens.lookup(token) if scheme.lower() == "bearer" else None
        if name is None:
            self.refusals.log(
                "refused",
                logging.WARNING,
                "refused request from %s: %s",
                address,
                "no bearer token" if not token else "unknown token",
            )
            raise ProtocolError(401, "missing or unknown bearer token")
        with self._cond:
            phone = self._by_name.setdefault(name, Phone(name))
            phone.last_seen = self.clock()
            phone.address = address
            self._cond.notify_all()
        return phone

    def phone(self, name: str) -> Phone:
        """The phone called ``name`` (KeyError lists the known names)."""
        phones = self.phones
        try:
            return phones[name]
        except KeyError:
            raise KeyError(f"no phone {name!r}; known: {sorted(phones)}") from None

    # -- endpoints ------------------------------------------------------------------
    def hello(self, phone: Phone, body: Any) -> dict[str, Any]:
        """``POST /v1/hello``: register the phone's node once, start its relay."""
        if not isinstance(body, dict):
            raise ProtocolError(400, "hello body must be a JSON object")
        phone.protocol = negotiate(body)
        device = body.get("device", {})
        phone.device = device if isinstance(device, dict) else {"raw": str(device)}
        app = body.get("app")
        if isinstance(app, dict):
            phone.device = {**phone.device, "app": app}
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
            "hello from phone %s (node %s) at %s: %.300s",
            phone.name,
            phone.node_id,
            phone.address,
            phone.device,
        )
        answer = {
            "node_id": phone.node_id,
            "phone": phone.name,
            "poll_s": self.settings.poll_s,
            "max_upload_bytes": self.settings.max_upload_bytes,
            "chunk_bytes": self.settings.chunk_bytes,
        }
        if phone.protocol >= 2:
            answer["protocol"] = phone.protocol
            answer["supported"] = list(SUPPORTED_VERSIONS)
        return answer

    def program_for(self, phone_name: str, config: Mapping[str, Any]) -> Program | None:
        """The program a task with ``config`` needs (None: the phone's own trainer).

        Raises :class:`~flowerbed.clients.bridge.tasks.TaskBuildError` when the config
        names an unknown program, or the phone speaks a revision without programs.
        """
        name = config.get(PROGRAM_CONFIG_KEY)
        if name is None:
            program = self._default_program
        elif not isinstance(name, str) or name not in self.programs:
            raise TaskBuildError(
                f"config {PROGRAM_CONFIG_KEY}={name!r} names no program of this "
                f"gateway; it serves {sorted(self.programs) or 'none'}"
            )
        else:
            program = self.programs[name]
        if program is not None and self._by_name[phone_name].protocol < 2:
            raise TaskBuildError(
                f"phone {phone_name} speaks protocol 1, which cannot fetch program "
                f"{program.name!r}; update the flowerbed app on it"
            )
        return program

    def program_blob(self, sha256: str) -> bytes:
        """The bytes of the program with this hash; 404 if the gateway has none."""
        program = self._programs_by_hash.get(sha256)
        if program is None:
            raise ProtocolError(404, f"no program with sha256 {sha256[:64]!r}")
        return program.data

    def open_task(self, phone: Phone) -> Task | None:
        """``GET /v1/task`` without waiting: the phone's open task, if any.

        Counts as a sign of life (the phone's node stays active while it polls).
        """
        if phone.node_id is None:
            raise ProtocolError(409, "say hello first: POST /v1/hello")
        with self._cond:
            phone.last_seen = self.clock()
            task = phone.task
        return task if task is not None and task.is_open() else None

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

    def add_listener(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(phone_name)`` whenever a phone is offered a task."""
        self._listeners.append(callback)

    # -- relay side -----------------------------------------------------------------
    def offer(self, phone_name: str, task: Task) -> None:
        """A relay hands its phone a new task; waiting polls wake up."""
        with self._cond:
            self._by_name[phone_name].task = task
            self._cond.notify_all()
        for callback in self._listeners:
            callback(phone_name)

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
