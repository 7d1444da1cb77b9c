"""One Flower node per phone: the relay between the SuperLink and a phone's tasks.

A real SuperNode (``flwr.supernode.start_client_internal``) opens one Fleet API
connection (``flwr.supernode.fleet_http_connection.http_request_response``), then
loops: pull a message, pull its objects, run the ClientApp, push the reply and its
objects. The gateway keeps that connection and that loop, one per phone, in a
thread, and replaces "run the ClientApp" by "hand a task to the phone and wait for
its result". Message (de)serialisation, request signing, heartbeats and object
transfer are Flower's own functions; nothing of Flower's wire format is redone here.

Each phone owns a Flower node key pair. The gateway registers the node once (at the
phone's first ``hello``) and passes the key pair to ``http_request_response``, which
then only activates the node on entry and deactivates it on exit, never unregisters
it: a phone that sleeps, changes network or restarts keeps its node id. With a state
directory the key pairs are kept on disk, so node ids also survive a gateway
restart (the SuperLink knows the key and answers with the same node).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import httpx
from cryptography.hazmat.primitives.asymmetric import ec
from flowerbed import keys
from flowerbed.clients.bridge.files import write_atomic
from flowerbed.clients.bridge.programs import Program
from flowerbed.clients.bridge.tasks import (
    Task,
    TaskBuildError,
    error_reply,
    reply_for,
    task_from_message,
)
from flwr.app import Message
from flwr.common.constant import HEARTBEAT_DEFAULT_INTERVAL
from flwr.proto.fleet_pb2 import (  # pylint: disable=E0611
    ActivateNodeRequest,
    DeactivateNodeRequest,
    RegisterNodeFleetRequest,
)
from flwr.supercore.error import ApiErrorCode, FlowerError
from flwr.supercore.inflatable.inflatable_object import (
    get_all_nested_objects,
    get_object_tree,
    iterate_object_tree,
    no_object_id_recompute,
)
from flwr.supercore.inflatable.inflatable_utils import (
    inflate_object_from_contents,
    pull_objects,
    push_object_contents_from_iterable,
)
from flwr.supercore.primitives.asymmetric import (
    bytes_to_private_key,
    generate_key_pairs,
    private_key_to_bytes,
    public_key_to_bytes,
)
from flwr.supernode.fleet_http_client import FleetHttpClient
from flwr.supernode.fleet_http_connection import http_request_response
from flwr.supernode.node_auth_http_interceptor import NodeAuthHttpInterceptor

log = logging.getLogger("flowerbed.bridge")

KeyPair = tuple[ec.EllipticCurvePrivateKey, ec.EllipticCurvePublicKey]


class NodeLink(Protocol):
    """An open Fleet API connection of one node."""

    node_id: int

    def receive(self) -> Message | None:
        """The next message for this node with its content, or ``None``."""

    def send(self, reply: Message) -> None:
        """Push a reply message and its objects."""


class NodeConnector(Protocol):
    """Creates node identities and opens their Fleet API connections."""

    def new_identity(self, phone_name: str) -> Any:
        """The phone's node identity (a key pair for the SuperLink)."""

    def register(self, identity: Any) -> int:
        """Register the identity as a node once; return its node id."""

    def connect(self, identity: Any) -> AbstractContextManager[NodeLink]:
        """Activate the node; deactivate it when the context exits."""


class RelayTarget(Protocol):
    """What a relay needs from the gateway: hand tasks out, ask if the phone is here."""

    def offer(self, phone_name: str, task: Task) -> None: ...

    def wants_node(self, phone_name: str) -> bool: ...

    def wait_for_phone(self, phone_name: str, timeout: float) -> None: ...

    def program_for(
        self, phone_name: str, config: Mapping[str, Any]
    ) -> Program | None: ...


class StateDirError(ValueError):
    """A ``--state-dir`` that cannot hold the phones' node keys."""


def prepare_state_dir(path: Path) -> Path:
    """Create ``path`` if needed, check it is a writable directory, drop ``*.tmp``.

    Raises :class:`StateDirError` naming the path and the fault.
    """
    path = path.expanduser()
    if path.exists() and not path.is_dir():
        raise StateDirError(f"state dir {path} exists and is not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-probe.{os.getpid()}.tmp"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        raise StateDirError(
            f"state dir {path} cannot be created or written: {err.strerror}"
        ) from err
    for stale in path.glob("*.tmp"):
        log.info("removing %s, left by a gateway killed while writing it", stale)
        stale.unlink(missing_ok=True)
    return path


class SuperLinkConnector:
    """Fleet API connections to a real SuperLink, with Flower's own client code.

    Parameters
    ----------
    address : str
        SuperLink Fleet API ``host:port`` (Flower 1.41 serves it on the SuperLink's
        HTTP port, 8000 by default).
    insecure : bool
        Plain HTTP instead of HTTPS.
    root_certificates : bytes | str | None
        PEM bundle (or its path) to verify the SuperLink's certificate.
    state_dir : str | Path | None
        Keep each phone's node key here (``<phone>.pem``, mode 600) so node ids
        survive gateway restarts; None keeps keys in memory only. The directory is
        created if missing and checked writable here, and temporary files a killed
        gateway left in it (``*.tmp``) are removed.

    Raises
    ------
    StateDirError
        If ``state_dir`` is not a directory, or cannot be created or written.
    """

    def __init__(
        self,
        address: str,
        insecure: bool,
        root_certificates: bytes | str | None = None,
        state_dir: str | Path | None = None,
    ) -> None:
        self.address = address
        self.insecure = insecure
        self.root_certificates = root_certificates
        self.state_dir = (
            prepare_state_dir(Path(state_dir)) if state_dir is not None else None
        )

    def new_identity(self, phone_name: str) -> KeyPair:
        if self.state_dir is None:
            return generate_key_pairs()
        path = self.state_dir / f"{phone_name}.pem"
        if path.exists():
            private_key = bytes_to_private_key(path.read_bytes())
            return private_key, private_key.public_key()
        private_key, public_key = generate_key_pairs()
        write_atomic(path, private_key_to_bytes(private_key))
        return private_key, public_key

    def register(self, identity: KeyPair) -> int:
        """Register the node; a key the SuperLink already knows keeps its node id."""
        private_key, public_key = identity
        key = public_key_to_bytes(public_key)
        with FleetHttpClient.from_server_address(
            self.address,
            self.insecure,
            self.root_certificates,
            interceptors=[NodeAuthHttpInterceptor(private_key, public_key)],
        ) as client:
            try:
                return int(
                    client.RegisterNode(
                        RegisterNodeFleetRequest(public_key=key)
                    ).node_id
                )
            except httpx.HTTPStatusError as err:
                error = FlowerError.from_json(err.response.text)
                if (
                    error is None
                    or error.code != ApiErrorCode.PUBLIC_KEY_ALREADY_IN_USE
                ):
                    raise
            # Known key (a restarted gateway): activating answers with its node id.
            node_id = client.ActivateNode(
                ActivateNodeRequest(
                    public_key=key, heartbeat_interval=HEARTBEAT_DEFAULT_INTERVAL
                )
            ).node_id
            client.DeactivateNode(DeactivateNodeRequest(node_id=node_id))
            return int(node_id)

    @contextmanager
    def connect(self, identity: KeyPair) -> Iterator[NodeLink]:
        with http_request_response(
            self.address,
            self.insecure,
            self.root_certificates,
            authentication_keys=identity,
        ) as (node_id, receive, send, _get_run, _get_fab, pull, push, confirm):
            yield _FleetLink(node_id, receive, send, pull, push, confirm)


@dataclass(eq=False, repr=False)
class _FleetLink:
    """The callbacks of ``http_request_response`` as a :class:`NodeLink`."""

    node_id: int
    _receive: Callable[..., Any]
    _send: Callable[..., Any]
    _pull_object: Callable[[int, str], bytes]
    _push_object: Callable[[int, str, str, bytes], None]
    _confirm: Callable[[int, str], None]

    def receive(self) -> Message | None:
        """Pull one message and its objects, as the SuperNode loop does."""
        received = self._receive()
        if received is None:
            return None
        shell, tree = received
        run_id = shell.metadata.run_id
        contents = pull_objects(
            [t.object_id for t in iterate_object_tree(tree)],
            pull_object_fn=lambda obj_id: self._pull_object(run_id, obj_id),
        )
        self._confirm(run_id, tree.object_id)
        message = inflate_object_from_contents(tree.object_id, contents)
        assert isinstance(message, Message)
        # The deflated message has no id of its own; take the SuperLink's.
        message.metadata.__dict__["_message_id"] = tree.object_id
        return message

    def send(self, reply: Message) -> None:
        """Push a reply and the objects the SuperLink asks for."""
        reply.metadata.__dict__["_message_id"] = reply.object_id
        with no_object_id_recompute():
            tree = get_object_tree(reply)
            objects = get_all_nested_objects(reply)
            wanted, session_id = self._send(reply, tree, 0.0)
            push_object_contents_from_iterable(
                ((i, objects[i].deflate()) for i in wanted if i in objects),
                push_object_fn=partial(
                    self._push_object, reply.metadata.run_id, session_id
                ),
            )


@dataclass(eq=False, repr=False)
class NodeRelay:
    """The Flower node of one phone: pull messages, hand tasks out, push replies.

    Parameters
    ----------
    phone_name : str
        The phone this node stands for (for logs and the gateway's lookups).
    identity : Any
        The node identity from ``connector.new_identity()``, already registered.
    connector : NodeConnector
        Opens the node's Fleet API connection.
    target : RelayTarget
        The gateway: receives tasks, says whether the phone is connected.
    deadline_slack_s : float
        Seconds added to a config's ``deadline-s`` before its task expires.
    pull_interval_s : float
        Seconds between pulls when no message is waiting (Flower's SuperNode: 3).
    retry_s : float
        Seconds before reconnecting after the connection failed.
    """

    phone_name: str
    identity: Any
    connector: NodeConnector
    target: RelayTarget
    deadline_slack_s: float
    pull_interval_s: float
    retry_s: float = 5.0
    active: threading.Event = field(default_factory=threading.Event, init=False)
    """Set while the node is activated at the SuperLink."""
    counts: dict[str, int] = field(init=False)
    """How this node's tasks ended."""

    def __post_init__(self) -> None:
        self.counts = {"accepted": 0, "failed": 0, "expired": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"relay-{self.phone_name}", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def request_stop(self) -> None:
        """Ask the relay to end; its node is deactivated when the loop exits."""
        self._stop.set()

    def join(self, timeout: float = 10.0) -> None:
        self._thread.join(timeout)

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self.target.wants_node(self.phone_name):
                self.target.wait_for_phone(self.phone_name, timeout=1.0)
                continue
            try:
                with self.connector.connect(self.identity) as link:
                    self.active.set()
                    log.info("phone %s: node %s online", self.phone_name, link.node_id)
                    self._serve(link)
                log.info("phone %s: node deactivated", self.phone_name)
            # Flower's connection calls flwr_exit (SystemExit) when it cannot reach
            # the SuperLink; in a gateway that must end this node's attempt only.
            except (Exception, SystemExit) as err:
                log.warning(
                    "phone %s: Fleet connection failed (%s); retrying in %.0f s",
                    self.phone_name,
                    err,
                    self.retry_s,
                )
                self._stop.wait(self.retry_s)
            finally:
                self.active.clear()

    def _serve(self, link: NodeLink) -> None:
        while not self._stop.is_set() and self.target.wants_node(self.phone_name):
            try:
                message = link.receive()
            except Exception as err:  # e.g. the run stopped while pulling
                log.warning(
                    "phone %s: pulling a message failed: %s", self.phone_name, err
                )
                message = None
            if message is None:
                self._stop.wait(self.pull_interval_s)
                continue
            reply = self.handle(message)
            if reply is None:
                continue
            try:
                link.send(reply)
            except Exception as err:  # e.g. the run finished meanwhile
                log.warning(
                    "phone %s: pushing the reply failed: %s", self.phone_name, err
                )

    def handle(self, message: Message) -> Message | None:
        """The reply to one message, or ``None`` when the phone did not finish."""
        meta = message.metadata
        try:
            task = task_from_message(
                message,
                self.deadline_slack_s,
                program_for=partial(self.target.program_for, self.phone_name),
            )
        except TaskBuildError as err:
            log.warning(
                "phone %s: cannot relay %s: %s", self.phone_name, meta.message_type, err
            )
            return error_reply(message, f"flowerbed bridge: {err}")
        self.target.offer(self.phone_name, task)
        log.info(
            "phone %s: %s task %s (round %s, expires in %.0f s)",
            self.phone_name,
            task.kind,
            task.task_id,
            task.config.get(keys.SERVER_ROUND, meta.group_id),
            task.expires_in_s(),
        )
        outcome = task.wait()
        self.counts["expired" if outcome is None else outcome.status] += 1
        if outcome is None:
            log.warning(
                "phone %s: task %s expired; no reply (straggler)",
                self.phone_name,
                task.task_id,
            )
            return None
        if outcome.status != "accepted":
            log.warning(
                "phone %s: task %s failed: %s",
                self.phone_name,
                task.task_id,
                outcome.reason,
            )
        return reply_for(message, task, outcome)
