"""TileClusters: several tile clusters, each one participant of an outer strategy.

A :class:`~flowerbed.strategies.tiled.TiledTraining` job trains one model on one
group of co-located boards. Several such groups (a lab's racks, sites on
different networks) can train one model together by federated averaging: each
cluster acts as one Flower node for an existing FedAvg-style strategy (Flower's
``FedAvg``, :class:`~flowerbed.strategies.RuntimeWeightedFedAvg`, ...), which
is unchanged. :class:`TileClusters` is the Grid the outer strategy runs on: it
lists one node per cluster; a train message to a cluster runs one segment of
tiled training on that cluster's boards (re-planned and retried without a lost
board, up to ``attempts`` times) and replies with the cluster's weights and
``num-examples`` (steps x batch), as a client would; an evaluate message makes
the cluster's rank 0 evaluate. Clusters train at the same time (one thread
each) over the real grid.

Momentum: a cluster starts each outer round without momentum, as a Flower
client builds a fresh optimiser per round.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterable, Sequence
from logging import WARNING

from flowerbed import keys
from flowerbed.grid import GridWrapper
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Error,
    Message,
    MessageType,
    RecordDict,
)
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid
from flwr.supercore import log

from .tiled import TiledTraining


def numbered(clusters: Sequence[Sequence[int]]) -> dict[int, list[int]]:
    """Each cluster's node ids under its node id ``k + 1``; ValueError unless the
    clusters are non-empty and disjoint."""
    flat = [n for nodes in clusters for n in nodes]
    if len(flat) != len(set(flat)) or any(not nodes for nodes in clusters):
        raise ValueError(
            f"clusters {list(map(list, clusters))} must be non-empty and disjoint"
        )
    return {k + 1: list(nodes) for k, nodes in enumerate(clusters)}


class _Locked(GridWrapper):
    """One cluster's view of the shared grid: its nodes only, calls serialised."""

    def __init__(self, inner: Grid, nodes: Sequence[int], lock: threading.Lock) -> None:
        super().__init__(inner)
        self.nodes = set(nodes)
        self.lock = lock

    def get_node_ids(self) -> Iterable[int]:
        with self.lock:
            return sorted(n for n in self.inner.get_node_ids() if n in self.nodes)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        with self.lock:
            return list(self.inner.push_messages(messages))

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        with self.lock:
            return list(self.inner.pull_messages(message_ids))


class TileClusters(GridWrapper):
    """A Grid whose nodes are tile clusters (see the module docstring).

    Parameters
    ----------
    grid : Grid
        The real grid (every cluster's boards are its nodes).
    clusters : sequence of sequences of int
        The node ids of each cluster; cluster ``k`` appears as node ``k + 1``.
    make_strategy : callable
        ``make_strategy(k)`` builds the :class:`TiledTraining` that runs cluster
        ``k`` (0-based; e.g. its own ``seed``, so clusters see different data);
        its ``steps_per_round`` is the cluster's local work per outer round.
    timeout : float (default: 3600)
        Seconds a cluster's segment may take.
    attempts : int (default: 3)
        Segments a cluster tries per outer round when boards are lost.
    """

    def __init__(
        self,
        grid: Grid,
        clusters: Sequence[Sequence[int]],
        make_strategy: Callable[[int], TiledTraining],
        *,
        timeout: float = 3600.0,
        attempts: int = 3,
    ) -> None:
        super().__init__(grid)
        self.clusters = numbered(clusters)
        lock = threading.Lock()
        self.views = {k: _Locked(grid, n, lock) for k, n in self.clusters.items()}
        self.strategies = {k: make_strategy(k - 1) for k in self.clusters}
        self.timeout, self.attempts = timeout, attempts
        self._ids = itertools.count()
        self._done: dict[str, Message] = {}
        self._done_lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    def get_node_ids(self) -> Iterable[int]:
        return list(self.clusters)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids = []
        for message in messages:
            cluster = message.metadata.dst_node_id
            if cluster not in self.clusters:
                raise ValueError(
                    f"message for node {cluster}: the clusters are nodes "
                    f"{sorted(self.clusters)}"
                )
            message_id = f"cluster-{next(self._ids):09d}"
            message.metadata.__dict__["_message_id"] = message_id
            thread = threading.Thread(
                target=self._serve,
                args=(cluster, message, message_id),
                name=f"tile-cluster-{cluster}",
                daemon=True,
            )
            thread.start()
            self._threads.append(thread)
            ids.append(message_id)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        with self._done_lock:
            found = [i for i in message_ids if i in self._done]
            return [self._done.pop(i) for i in found]

    def _serve(self, cluster: int, message: Message, message_id: str) -> None:
        try:
            reply = self._answer(cluster, message)
        except Exception as err:  # a cluster that cannot train is an error reply
            log(WARNING, "cluster %d: %s", cluster, err)
            reply = Message(
                Error(
                    ErrorCode.CLIENT_APP_RAISED_EXCEPTION, f"cluster {cluster}: {err}"
                ),
                reply_to=message,
            )
        with self._done_lock:
            self._done[message_id] = reply

    def _answer(self, cluster: int, message: Message) -> Message:
        strategy = self.strategies[cluster]
        view = self.views[cluster]
        content = message.content
        arrays = content.array_records.get(strategy.arrayrecord_key, ArrayRecord())
        config = content.config_records.get(strategy.configrecord_key, ConfigRecord())
        round_value = config.get("server-round", 0)
        server_round = round_value if isinstance(round_value, int) else 0
        if strategy._inflight is None:
            strategy.attach(view)
            strategy.round_timeout = self.timeout
        if message.metadata.message_type == MessageType.EVALUATE:
            metrics = strategy.evaluate_round(
                server_round, arrays, config, self.timeout
            )
            if metrics is None:
                raise RuntimeError("this cluster's job has no dataset to evaluate on")
            return Message(RecordDict({keys.METRICS: metrics}), reply_to=message)
        strategy.central_optimizer = {}
        for attempt in range(1, self.attempts + 1):
            new, metrics = strategy.train_round(
                view, server_round, arrays, config, self.timeout
            )
            if new is not None:
                return Message(
                    RecordDict({strategy.arrayrecord_key: new, keys.METRICS: metrics}),
                    reply_to=message,
                )
            if not strategy.boards:
                break
            log(WARNING, "cluster %d: attempt %d failed, re-planning", cluster, attempt)
        raise RuntimeError(
            f"no segment completed in {self.attempts} attempts "
            f"({len(strategy.boards)} boards left)"
        )

    def close(self, timeout: float = 60.0) -> None:
        """Wait for the clusters' running segments to end."""
        for thread in self._threads:
            thread.join(timeout)
