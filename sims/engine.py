"""The in-process fleet engine: a Flower ``Grid`` that runs nodes on a virtual clock.

``FleetGrid`` runs each node's ClientApp in this process the moment a message is
pushed, and schedules the reply at the virtual time the node's device would have
delivered it: dispatch time plus the durations the node reports
(``train-time-s`` + ``comm-time-s`` + ``eval-time-s``). ``pull_messages`` returns only
replies that have arrived by the virtual now, so any ServerApp and strategy written
against Flower's ``Grid`` runs unchanged, deterministically, and much faster than
real time. A node that vanishes never replies; like Flower's SuperLink, the engine
then answers with an error once the message's TTL has expired.

Using the machine: given a ``batch_train`` runner (for the simulated fleet,
:func:`flowerbed.sims.node.train_batch`), the train messages of one
``push_messages`` call run together: the runner trains nodes of one architecture
as one batched computation, and with ``workers`` > 1 the messages are split over
that many worker processes (one model per worker; each task draws from its own
random stream, so where it runs does not change what it draws). Arrival times,
and so the virtual clock, depend only on what the replies report.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import multiprocessing
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing.pool import Pool
from typing import Protocol

from flowerbed import keys
from flowerbed.clock import collect_replies
from flowerbed.grid import LocalGrid
from flowerbed.sims.links import Network, charge_round
from flowerbed.sims.vclock import NodeDropout
from flwr.app import Context, Error, Message, MessageType, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import SUPERLINK_NODE_ID, ErrorCode
from flwr.supercore.task_identity import TaskIdentity

log = logging.getLogger(__name__)

DURATION_KEYS = (keys.TRAIN_TIME_S, keys.COMM_TIME_S, keys.EVAL_TIME_S)
"""Reply metrics whose sum is the virtual time from dispatch to arrival."""

MIN_TASKS_PER_WORKER = 16
"""Train messages a worker must get for a push to be split over workers: smaller
pushes train faster batched in one process than split (measured by the
benchmark's machinery section: 10 nodes over 2 workers took more CPU and more
wall time than batched in one process)."""

BatchRunner = Callable[[Sequence[tuple[Message, Context]]], list[Message | Exception]]
"""Runs many train tasks; returns each one's reply or the exception it raised."""


class Arrivals(Protocol):
    """What a virtual clock asks its engine: when the next reply arrives."""

    def next_arrival_after(self, t: float) -> float | None: ...


class VirtualClock:
    """Virtual seconds since the run started; only the engine's events move it."""

    def __init__(self, engine: Arrivals) -> None:
        self._engine = engine
        self._now = 0.0

    def now(self) -> float:
        return self._now

    def wait(self, seconds: float) -> None:
        """Advance to the next reply arrival or by ``seconds``, whichever is first."""
        target = self._now + max(0.0, seconds)
        upcoming = self._engine.next_arrival_after(self._now)
        if upcoming is not None:
            target = min(target, upcoming)
        if math.isinf(target):
            raise RuntimeError(
                "waiting forever on the virtual clock with no reply in flight"
            )
        self._now = target


@dataclass(frozen=True)
class SimNode:
    """One simulated node: Flower node id and the node_config its ClientApp sees."""

    node_id: int
    node_config: Mapping[str, bool | float | int | str]


@dataclass(order=True)
class _Pending:
    arrival: float
    partition: int
    seq: int
    message_id: str = field(compare=False)
    reply: Message = field(compare=False)


class ArrivalQueue:
    """Replies waiting for the virtual clock to reach their arrival time.

    Replies arriving at the same virtual time come out in the order of the
    ``partition-id`` they report (then in push order): node ids differ between
    engines, partition ids do not, so equal-time replies are ordered alike
    everywhere.
    """

    def __init__(self) -> None:
        self._in_flight: list[_Pending] = []
        self._arrived: dict[str, Message] = {}
        self._seq = itertools.count()

    def schedule(
        self,
        sent_at: float,
        message: Message,
        message_id: str,
        reply: Message,
        after_s: float,
    ) -> None:
        """Queue ``reply`` to ``message`` to arrive ``after_s`` after ``sent_at``.

        A reply later than the message's TTL is dropped and replaced by the error
        Flower's SuperLink sends when a TTL expires, at the expiry time.
        """
        ttl = message.metadata.ttl
        if after_s > ttl:
            reply = Message(
                Error(
                    ErrorCode.REPLY_MESSAGE_UNAVAILABLE,
                    f"no reply within the message's TTL of {ttl:g} s",
                ),
                reply_to=message,
            )
            after_s = ttl
        partition = -1
        if not reply.has_error():
            for record in metric_records(reply):
                value = record.get(keys.PARTITION_ID)
                if isinstance(value, int):
                    partition = value
        heapq.heappush(
            self._in_flight,
            _Pending(sent_at + after_s, partition, next(self._seq), message_id, reply),
        )

    def take(self, now: float, message_ids: Iterable[str]) -> list[Message]:
        """The replies to ``message_ids`` that have arrived by ``now``."""
        while self._in_flight and self._in_flight[0].arrival <= now:
            item = heapq.heappop(self._in_flight)
            self._arrived[item.message_id] = item.reply
        wanted = set(message_ids)
        found = [mid for mid in self._arrived if mid in wanted]
        return [self._arrived.pop(mid) for mid in found]

    def next_arrival_after(self, t: float) -> float | None:
        """Virtual time of the first queued reply arriving strictly after ``t``."""
        later = [p.arrival for p in self._in_flight if p.arrival > t]
        return min(later) if later else None


class FleetGrid(LocalGrid):
    """Flower ``Grid`` over simulated nodes, releasing replies in virtual-time order.

    Parameters
    ----------
    client_app : ClientApp
        The ClientApp every node runs.
    nodes : Sequence[SimNode]
        The fleet's nodes.
    run_config : Mapping
        Flower run config handed to every node's ``Context``.
    run_id : int (default: 1)
        Run id stamped on messages.
    batch_train : BatchRunner | None (default: None)
        Runs the train messages of one push together (instead of ``client_app``
        one by one); must answer each message as ``client_app`` would.
    workers : int (default: 0)
        Worker processes for ``batch_train`` (0 or 1: this process), used for
        pushes of at least ``MIN_TASKS_PER_WORKER`` train messages per worker.
        Each worker keeps its own copy of the nodes' contexts: a ClientApp that
        keeps state in ``context.state`` across rounds needs ``workers=0``.
    network : flowerbed.sims.links.Network | None (default: None)
        Charge each push's train transfers to a shared network (switched
        Ethernet, Wi-Fi: :func:`flowerbed.sims.links.charge_round`) instead of
        each device's own bandwidth.
    """

    def __init__(
        self,
        client_app: ClientApp,
        nodes: Sequence[SimNode],
        run_config: Mapping[str, bool | float | int | str],
        run_id: int = 1,
        *,
        batch_train: BatchRunner | None = None,
        workers: int = 0,
        network: Network | None = None,
    ) -> None:
        if workers < 0:
            raise ValueError(f"workers must be >= 0, got {workers}")
        if workers > 1 and batch_train is None:
            raise ValueError("workers > 1 needs a batch_train runner")
        self.client_app = client_app
        self.batch_train = batch_train
        self.workers = workers
        self.network = network
        self._pool: Pool | None = None
        self.clock = VirtualClock(self)
        self._nodes = {n.node_id: n for n in nodes}
        if len(self._nodes) != len(nodes):
            raise ValueError("node ids must be unique")
        self._run_config = dict(run_config)
        self._run_id = run_id
        self._contexts: dict[int, Context] = {}
        super().__init__(run_id)
        self._seq = itertools.count()
        self._queue = ArrivalQueue()
        self.messages_run = 0

    # --- Grid API -----------------------------------------------------------------
    def get_node_ids(self) -> Iterable[int]:
        return sorted(self._nodes)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        batch = list(messages)
        for message in batch:
            if message.metadata.dst_node_id not in self._nodes:
                raise ValueError(
                    f"message for unknown node {message.metadata.dst_node_id}"
                )
        ids = [f"sim-{next(self._seq):09d}" for _ in batch]
        for message, message_id in zip(batch, ids, strict=True):
            message.metadata.__dict__["_message_id"] = message_id
        outcomes = self._run_all(batch)
        if self.network is not None:
            outcomes = charge_round(self.network, batch, outcomes)
        now = self.clock.now()
        for message, message_id, (reply, after_s) in zip(
            batch, ids, outcomes, strict=True
        ):
            self._queue.schedule(now, message, message_id, reply, after_s)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return self._queue.take(self.clock.now(), message_ids)

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        return collect_replies(self, self.push_messages(messages), timeout)

    # --- engine -------------------------------------------------------------------
    def next_arrival_after(self, t: float) -> float | None:
        """Virtual time of the first in-flight reply arriving strictly after ``t``."""
        return self._queue.next_arrival_after(t)

    def close(self) -> None:
        """Stop the worker processes (if any); the grid can start them again."""
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()
            self._pool = None

    def _run_all(self, messages: Sequence[Message]) -> list[tuple[Message, float]]:
        """Every message's reply and virtual seconds to arrival, in order."""
        self.messages_run += len(messages)
        train = [
            i
            for i, m in enumerate(messages)
            if self.batch_train is not None
            and m.metadata.message_type == MessageType.TRAIN
        ]
        out: list[tuple[Message, float] | None] = [None] * len(messages)
        if train:
            tasks = [messages[i] for i in train]
            for i, outcome in zip(train, self._run_train(tasks), strict=True):
                out[i] = outcome
        for i, message in enumerate(messages):
            if out[i] is None:
                out[i] = task_outcome(
                    message, _call(self.client_app, message, self._context(message))
                )
        return [o for o in out if o is not None]

    def context(self, node_id: int) -> Context:
        """The node's Flower ``Context``, made when the node gets its first message.

        A population's nodes that are never sampled cost no more than their
        ``SimNode``: no context, no data, no model.
        """
        return _context_of(
            self._contexts, self._nodes, self._run_config, self._run_id, node_id
        )

    @property
    def nodes_contacted(self) -> int:
        """How many nodes have been sent a message (in this process)."""
        return len(self._contexts)

    @property
    def worker_processes(self) -> int:
        """Worker processes running now (0 until a push was split over them)."""
        return self.workers if self._pool is not None else 0

    def _context(self, message: Message) -> Context:
        return self.context(message.metadata.dst_node_id)

    def _run_train(self, tasks: Sequence[Message]) -> list[tuple[Message, float]]:
        assert self.batch_train is not None
        parts = min(self.workers, len(tasks) // MIN_TASKS_PER_WORKER)
        if parts <= 1 or self._pool is None:
            # The first batch runs here: the workers forked after it inherit this
            # process's warm caches (data shards, models, torch's first-call setup).
            outcomes = _run_batch(
                self.batch_train, [(m, self._context(m)) for m in tasks]
            )
            if parts > 1:
                self._worker_pool()
            return outcomes
        pool = self._worker_pool()
        size = math.ceil(len(tasks) / parts)
        chunks = [tasks[i : i + size] for i in range(0, len(tasks), size)]
        pending = [pool.apply_async(_worker_run, (chunk,)) for chunk in chunks]
        return [outcome for job in pending for outcome in job.get()]

    def _worker_pool(self) -> Pool:
        if self._pool is None:
            methods = multiprocessing.get_all_start_methods()
            context = multiprocessing.get_context(
                "fork" if "fork" in methods else "spawn"
            )
            self._pool = context.Pool(
                self.workers,
                initializer=_worker_init,
                initargs=(
                    self.batch_train,
                    self._nodes,
                    self._run_config,
                    self._run_id,
                ),
            )
            weakref.finalize(self, self._pool.terminate)
        return self._pool


def _context_of(
    contexts: dict[int, Context],
    nodes: Mapping[int, SimNode],
    run_config: Mapping[str, bool | float | int | str],
    run_id: int,
    node_id: int,
) -> Context:
    if node_id not in contexts:
        contexts[node_id] = Context(
            run_id=run_id,
            node_id=node_id,
            node_config=dict(nodes[node_id].node_config),
            state=RecordDict(),
            run_config=dict(run_config),
        )
    return contexts[node_id]


@dataclass
class _Worker:
    """A worker process's runner and the fleet it makes contexts for."""

    runner: BatchRunner
    nodes: Mapping[int, SimNode]
    run_config: Mapping[str, bool | float | int | str]
    run_id: int
    contexts: dict[int, Context] = field(default_factory=dict)


_WORKER: _Worker | None = None
"""This worker process's state (set by ``_worker_init``)."""


def _worker_init(
    runner: BatchRunner,
    nodes: Mapping[int, SimNode],
    run_config: Mapping[str, bool | float | int | str],
    run_id: int,
) -> None:
    global _WORKER
    _WORKER = _Worker(runner, nodes, run_config, run_id)
    TaskIdentity.run_id = run_id
    TaskIdentity.node_id = SUPERLINK_NODE_ID
    TaskIdentity.task_id = 0


def _worker_run(tasks: Sequence[Message]) -> list[tuple[Message, float]]:
    worker = _WORKER
    assert worker is not None, "worker not initialised"
    return _run_batch(
        worker.runner,
        [
            (
                m,
                _context_of(
                    worker.contexts,
                    worker.nodes,
                    worker.run_config,
                    worker.run_id,
                    m.metadata.dst_node_id,
                ),
            )
            for m in tasks
        ],
    )


def _run_batch(
    runner: BatchRunner, tasks: Sequence[tuple[Message, Context]]
) -> list[tuple[Message, float]]:
    results = runner(tasks)
    if len(results) != len(tasks):
        raise RuntimeError(
            f"batch_train answered {len(results)} of {len(tasks)} messages"
        )
    return [task_outcome(m, r) for (m, _), r in zip(tasks, results, strict=True)]


def _call(app: ClientApp, message: Message, context: Context) -> Message | Exception:
    try:
        return app(message, context)
    except Exception as err:  # the outcome is decided by _outcome
        return err


def task_outcome(
    message: Message, result: Message | Exception
) -> tuple[Message, float]:
    """A task's reply (or the error Flower would send) and its virtual delay."""
    if isinstance(result, NodeDropout):
        if result.silent:
            return Message(
                Error(ErrorCode.REPLY_MESSAGE_UNAVAILABLE, result.reason),
                reply_to=message,
            ), math.inf
        return Message(
            Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, result.reason),
            reply_to=message,
        ), result.after_s
    if isinstance(result, Exception):  # a crashing ClientApp: an error reply
        log.warning("node %s raised %r", message.metadata.dst_node_id, result)
        return Message(
            Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, repr(result)),
            reply_to=message,
        ), 0.0
    if result.has_error():
        return result, 0.0
    return result, reply_duration(result)


def metric_records(reply: Message) -> list[MetricRecord]:
    """The reply's metric records, in order: ``reply.content.metric_records``
    without the synced view Flower builds (and type-checks) on every access,
    ~6 us, read several times per reply per round."""
    return [r for r in reply.content.values() if isinstance(r, MetricRecord)]


def reply_duration(reply: Message) -> float:
    """Virtual seconds a reply reports for its task (sum of its duration keys).

    A duration that is not a finite, non-negative number counts as 0: one node's
    NaN must not become an arrival time that stalls every other reply.
    """
    total = 0.0
    for record in metric_records(reply):
        for key in DURATION_KEYS:
            value = record.get(key)
            if isinstance(value, (int, float)) and 0 <= value < math.inf:
                total += float(value)
    return total
