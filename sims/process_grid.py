"""A Flower ``Grid`` whose nodes are real local processes: span jobs on one machine.

Jobs that span devices need their members to run *at the same time* (they
exchange tensors every step), which the in-process engine cannot do. Here every
node is a persistent worker process (``multiprocessing`` spawn) running a
ClientApp on the messages it is sent, one at a time, with its own node_config
(``address='127.0.0.1'``, an emulated speed ...). Any ServerApp strategy runs
against it unchanged, on wall time: :meth:`ProcessGrid.push_messages` hands the
message to the node's process, :meth:`ProcessGrid.pull_messages` returns the
replies that came back.

Failures as on real boards: :meth:`ProcessGrid.kill` SIGKILLs a node's process
(a board losing power); like Flower's SuperLink, the grid keeps listing the node
for ``unavailable_after_s`` and then answers its pending messages with a
``NODE_UNAVAILABLE`` error. :meth:`ProcessGrid.add_node` starts a node under a
new id (a board coming back registers anew, as with Flower). Every process is
stopped by its pid on :meth:`ProcessGrid.close`.

This is a single-machine harness: the real deployment path is
``flower-superlink`` + ``flower-supernode`` processes (tests/procs.py, the
deployment guide); both run the same ClientApp code.
"""

from __future__ import annotations

import contextlib
import importlib
import itertools
import multiprocessing
import multiprocessing.connection
import os
import signal
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from flowerbed.clock import collect_replies
from flowerbed.grid import LocalGrid
from flwr.app import Context, Error, Message, RecordDict
from flwr.common.constant import ErrorCode
from flwr.supercore.task_identity import TaskIdentity

NodeConfig = Mapping[str, bool | float | int | str]
STOP_TIMEOUT_S = 10.0


def _serve(
    app_ref: str,
    run_id: int,
    node_id: int,
    node_config: dict[str, Any],
    run_config: dict[str, Any],
    conn: Connection,
    log_level: int | None = None,
) -> None:  # pragma: no cover - runs in the child process
    """Worker loop: run the ClientApp on each message, send the reply back."""
    import logging

    import torch

    torch.set_num_threads(1)
    module, _, attr = app_ref.partition(":")
    app = getattr(importlib.import_module(module), attr)
    if log_level is not None:
        logging.getLogger("flwr").setLevel(log_level)
    TaskIdentity.run_id = run_id
    TaskIdentity.node_id = node_id
    TaskIdentity.task_id = 0
    context = Context(
        run_id=run_id,
        node_id=node_id,
        node_config=node_config,
        state=RecordDict(),
        run_config=run_config,
    )
    conn.send(("ready", None))
    while True:
        try:
            item = conn.recv()
        except EOFError:
            return
        if item is None:
            return
        message_id, message = item
        try:
            reply = app(message, context)
        except Exception as err:  # a crashing ClientApp is an error reply, as in Flower
            reply = Message(
                Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, repr(err)),
                reply_to=message,
            )
        conn.send((message_id, reply))


@dataclass
class _Node:
    node_id: int
    node_config: dict[str, Any]
    process: Any = None
    conn: Connection | None = None
    killed_at: float | None = None
    pending: dict[str, Message] = field(default_factory=dict)


def _await_ready(nodes: Iterable[_Node], timeout: float) -> None:
    """Take each node process's "ready" (it has imported the ClientApp)."""
    deadline = time.monotonic() + timeout
    for node in nodes:
        conn = node.conn
        assert conn is not None
        if not conn.poll(max(0.0, deadline - time.monotonic())):
            raise TimeoutError(f"node {node.node_id} did not start within {timeout} s")
        tag, _ = conn.recv()
        if tag != "ready":
            raise RuntimeError(f"node {node.node_id} sent {tag!r} before 'ready'")


class ProcessGrid(LocalGrid):
    """Flower ``Grid`` over local worker processes (see the module docstring).

    Parameters
    ----------
    client_app : str
        ``"module:attribute"`` of the ClientApp every node runs.
    node_configs : Sequence[Mapping]
        One node_config per node; nodes get ids 1, 2, ...
    run_config : Mapping, optional
        Flower run config of every node's ``Context``.
    unavailable_after_s : float (default: 5)
        Seconds a killed node stays listed before its pending messages get a
        ``NODE_UNAVAILABLE`` error reply.
    env : Mapping, optional
        Extra environment variables for the worker processes.
    log_level : int, optional
        Level of Flower's logger in the workers (e.g. ``logging.WARNING`` to
        hide the ClientApps' INFO lines); None keeps Flower's.
    """

    def __init__(
        self,
        client_app: str,
        node_configs: Sequence[NodeConfig],
        run_config: Mapping[str, Any] | None = None,
        *,
        unavailable_after_s: float = 5.0,
        env: Mapping[str, str] | None = None,
        run_id: int = 1,
        log_level: int | None = None,
    ) -> None:
        self.client_app = client_app
        self.log_level = log_level
        self.run_config = dict(run_config or {})
        self.unavailable_after_s = unavailable_after_s
        self.env = dict(env or {})
        super().__init__(run_id)
        self._ids = itertools.count(1)
        self._seq = itertools.count()
        self._nodes: dict[int, _Node] = {}
        self._arrived: dict[str, Message] = {}
        self._ctx = multiprocessing.get_context("spawn")
        try:
            for config in node_configs:
                self.add_node(config, wait=False)
            self.wait_ready()
        except BaseException:
            self.close()
            raise

    # --- lifecycle -----------------------------------------------------------------
    def add_node(self, node_config: NodeConfig, *, wait: bool = True) -> int:
        """Start a node process under a new id; return the id."""
        node = _Node(next(self._ids), dict(node_config))
        parent, child = self._ctx.Pipe()
        saved = {k: os.environ.get(k) for k in self.env}
        os.environ.update(self.env)
        try:
            node.process = self._ctx.Process(
                target=_serve,
                args=(
                    self.client_app,
                    self._run.run_id,
                    node.node_id,
                    node.node_config,
                    self.run_config,
                    child,
                    self.log_level,
                ),
                daemon=True,
            )
            node.process.start()
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
        child.close()
        node.conn = parent
        if wait:
            # Ready before it is listed: a node the strategy can see may be polled
            # by pull_messages from another thread, which would take its "ready"
            # for a reply (and this wait would then take the reply).
            _await_ready([node], 120.0)
        self._nodes[node.node_id] = node
        return node.node_id

    def wait_ready(
        self, node_ids: Iterable[int] | None = None, timeout: float = 120.0
    ) -> None:
        """Wait until the nodes' processes have imported the ClientApp."""
        ids = list(node_ids) if node_ids is not None else list(self._nodes)
        _await_ready([self._nodes[i] for i in ids], timeout)

    def pid(self, node_id: int) -> int:
        return int(self._nodes[node_id].process.pid)

    def kill(self, node_id: int) -> None:
        """SIGKILL the node's process (a board losing power)."""
        node = self._nodes[node_id]
        if node.process.is_alive():
            os.kill(node.process.pid, signal.SIGKILL)
        node.process.join(STOP_TIMEOUT_S)
        node.killed_at = time.monotonic()

    def close(self) -> None:
        """Stop every node process by its pid (asked first, then SIGKILL)."""
        for node in self._nodes.values():
            if node.conn is not None and node.process.is_alive():
                with contextlib.suppress(BrokenPipeError, OSError):
                    node.conn.send(None)
        for node in self._nodes.values():
            node.process.join(STOP_TIMEOUT_S)
            if node.process.is_alive():
                os.kill(node.process.pid, signal.SIGKILL)
                node.process.join(STOP_TIMEOUT_S)
            if node.conn is not None:
                node.conn.close()

    def __enter__(self) -> ProcessGrid:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- Grid API ------------------------------------------------------------------
    def get_node_ids(self) -> Iterable[int]:
        now = time.monotonic()
        return sorted(
            n.node_id
            for n in self._nodes.values()
            if n.killed_at is None or now - n.killed_at < self.unavailable_after_s
        )

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids = []
        for message in messages:
            node = self._nodes.get(message.metadata.dst_node_id)
            if node is None:
                raise ValueError(
                    f"message for unknown node {message.metadata.dst_node_id}"
                )
            message_id = f"proc-{next(self._seq):09d}"
            message.metadata.__dict__["_message_id"] = message_id
            node.pending[message_id] = message
            if node.killed_at is None and node.conn is not None:
                try:
                    node.conn.send((message_id, message))
                except (BrokenPipeError, OSError):
                    node.killed_at = time.monotonic()
            ids.append(message_id)
        return ids

    def _collect(self) -> None:
        live = {
            n.conn: n
            for n in self._nodes.values()
            if n.conn is not None and n.killed_at is None
        }
        if live:
            for ready in multiprocessing.connection.wait(list(live), timeout=0):
                assert isinstance(ready, Connection)
                node = live[ready]
                try:
                    message_id, reply = ready.recv()
                except (EOFError, OSError):
                    node.killed_at = time.monotonic()
                    continue
                node.pending.pop(message_id, None)
                self._arrived[message_id] = reply
        now = time.monotonic()
        for node in self._nodes.values():
            if node.killed_at is None and not node.process.is_alive():
                node.killed_at = now
            if (
                node.killed_at is not None
                and now - node.killed_at >= self.unavailable_after_s
            ):
                for message_id, message in node.pending.items():
                    self._arrived[message_id] = Message(
                        Error(
                            ErrorCode.NODE_UNAVAILABLE,
                            f"node {node.node_id} is unavailable (its process died)",
                        ),
                        reply_to=message,
                    )
                node.pending.clear()

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        self._collect()
        wanted = set(message_ids)
        found = [mid for mid in self._arrived if mid in wanted]
        return [self._arrived.pop(mid) for mid in found]

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        return collect_replies(self, self.push_messages(messages), timeout)
