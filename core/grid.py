"""A Grid that passes everything to another Grid: the base of grid decorators.

Subclasses override what they watch or change (``push_messages``,
``pull_messages``, ``get_node_ids``); the inner grid's clock stays visible through
the wrapper, so strategies wait on the same clock whatever wraps the grid.
"""

from __future__ import annotations

from collections.abc import Iterable

from flowerbed.clock import collect_replies
from flwr.app import Message, RecordDict
from flwr.serverapp import Grid
from flwr.supercore.run import Run


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
