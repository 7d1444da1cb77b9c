"""Bases of flowerbed's grids.

``LocalGrid`` is the part every grid that runs the ServerApp in this process shares
(the run it serves, how it builds messages). ``GridWrapper`` passes everything to
another Grid: the base of grid decorators. Its subclasses override what they watch
or change (``push_messages``, ``pull_messages``, ``get_node_ids``); the inner
grid's clock stays visible through the wrapper, so strategies wait on the same
clock whatever wraps the grid.
"""

from __future__ import annotations

from collections.abc import Iterable

from flowerbed.clock import collect_replies
from flwr.app import Message, RecordDict
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.serverapp import Grid
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity


class LocalGrid(Grid):
    """A Grid whose ServerApp runs in this process: holds the run, builds messages.

    Subclasses deliver the messages (``get_node_ids``, ``push_messages``,
    ``pull_messages``, ``send_and_receive``). Messages built by strategies need a
    task identity, as inside a ServerApp; the constructor sets the parts of
    Flower's ``TaskIdentity`` that are not set yet (run ``run_id``, the SuperLink's
    node id, task 0).
    """

    def __init__(self, run_id: int) -> None:
        self._run = Run.create_empty(run_id)
        if TaskIdentity._run_id is None:
            TaskIdentity.run_id = run_id
        if TaskIdentity._node_id is None:
            TaskIdentity.node_id = SUPERLINK_NODE_ID
        if TaskIdentity._task_id is None:
            TaskIdentity.task_id = 0

    def set_run(self, run: Run) -> None:
        self._run = run

    @property
    def run(self) -> Run:
        return self._run

    def create_message(
        self,
        content: RecordDict,
        message_type: str,
        dst_node_id: int,
        group_id: str,
        ttl: float | None = None,
    ) -> Message:
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)


class GridWrapper(Grid):
    """Delegates every ``Grid`` call to ``inner``; exposes ``inner.clock`` if any."""

    def __init__(self, inner: Grid) -> None:
        self.inner = inner
        clock = getattr(inner, "clock", None)
        if clock is not None:
            self.clock = clock

    def set_run(self, run: Run) -> None:
        self.inner.set_run(run)

    @property
    def run(self) -> Run:
        return self.inner.run

    def create_message(
        self,
        content: RecordDict,
        message_type: str,
        dst_node_id: int,
        group_id: str,
        ttl: float | None = None,
    ) -> Message:
        return self.inner.create_message(
            content, message_type, dst_node_id, group_id, ttl
        )

    def get_node_ids(self) -> Iterable[int]:
        return self.inner.get_node_ids()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        return self.inner.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return self.inner.pull_messages(message_ids)

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        """Push through this wrapper and collect replies on the grid's clock."""
        return collect_replies(self, self.push_messages(messages), timeout)
