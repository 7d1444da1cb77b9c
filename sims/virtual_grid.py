"""Virtual device time on any Flower Grid: the in-process engine's clock, for Ray.

Under ``flwr run`` a simulated fleet runs on Flower's simulation engine (Ray, on
one machine or a cluster): replies come back when this machine's CPUs finish
them, not when the simulated phones would have. :class:`VirtualTimeGrid` wraps
that grid and gives strategies the in-process engine's virtual clock
(:class:`flowerbed.sims.engine.VirtualClock`):

- a message pushed at virtual time ``t`` is answered at ``t`` plus the durations
  its reply reports (``train-time-s`` + ``comm-time-s`` + ``eval-time-s``), a
  simulated dropout at the time it carries (:class:`~flowerbed.sims.vclock.NodeDropout`,
  recovered from the error's text), a vanished node never (its message's TTL
  expires), any other error at ``t``;
- before the clock moves or a reply is released, every reply in flight is
  awaited (wall time), so a reply that the cluster finishes late but the device
  would have sent early is never overtaken: replies leave in virtual-time order,
  exactly as on the in-process engine (same ``ArrivalQueue``, same tie-break).

Messages keep their TTL in virtual seconds for the strategy; the wrapped grid
gets a copy of each with at least Flower's default TTL of wall time, so a slow
cluster does not expire them. A copy, because Flower's in-memory grid (the one
``flwr run`` gives a simulation) stores the pushed object itself and its nodes
read the TTL later: on the strategy's object the virtual TTL (e.g. 4 x a 5 s
deadline) would expire while Ray starts, and the replies' TTL would fall to zero.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from flowerbed.grid import GridWrapper
from flowerbed.sims.engine import ArrivalQueue, VirtualClock, task_outcome
from flowerbed.sims.vclock import NodeDropout
from flwr.app import Message
from flwr.app.constants import DEFAULT_TTL
from flwr.serverapp import Grid

log = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.05
"""Wall seconds between polls of the wrapped grid while replies are in flight."""
PATIENCE_LOG_S = 60.0
"""Wall seconds of waiting between two 'waits for N replies' log lines."""


class VirtualTimeGrid(GridWrapper):
    """A Grid whose replies arrive on a virtual clock (see the module docstring).

    Parameters
    ----------
    inner : Grid
        The grid to wrap, e.g. the one ``flwr run`` hands a ServerApp.
    poll_interval_s : float (default: 0.05)
        Wall seconds between polls while waiting for replies in flight.
    wall_ttl_s : float (default: Flower's DEFAULT_TTL, 12 h)
        Smallest TTL, in wall seconds, given to messages on the wrapped grid.
    """

    def __init__(
        self,
        inner: Grid,
        *,
        poll_interval_s: float = POLL_INTERVAL_S,
        wall_ttl_s: float = DEFAULT_TTL,
    ) -> None:
        super().__init__(inner)
        if not poll_interval_s > 0:
            raise ValueError(f"poll_interval_s must be > 0, got {poll_interval_s}")
        self.clock = VirtualClock(self)
        self.poll_interval_s = poll_interval_s
        self.wall_ttl_s = wall_ttl_s
        self._queue = ArrivalQueue()
        self._in_flight: dict[str, tuple[Message, float]] = {}

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        batch = list(messages)
        copies = [
            Message(
                m.content,
                m.metadata.dst_node_id,
                m.metadata.message_type,
                ttl=max(m.metadata.ttl, self.wall_ttl_s),
                group_id=m.metadata.group_id,
            )
            for m in batch
        ]
        ids = list(self.inner.push_messages(copies))
        now = self.clock.now()
        for message, message_id in zip(batch, ids, strict=True):
            if message_id:
                # the id the wrapped grid gave the copy: replies name it
                message.metadata.__dict__["_message_id"] = message_id
                self._in_flight[message_id] = (message, now)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        self._settle()
        return self._queue.take(self.clock.now(), message_ids)

    def next_arrival_after(self, t: float) -> float | None:
        """Virtual time of the first reply arriving after ``t`` (all settled)."""
        self._settle()
        return self._queue.next_arrival_after(t)

    def _settle(self) -> None:
        """Wait (wall time) for every reply in flight and queue it by virtual time."""
        started = last_log = time.monotonic()
        while self._in_flight:
            for reply in self.inner.pull_messages(list(self._in_flight)):
                message_id = reply.metadata.reply_to_message_id
                message, sent_at = self._in_flight.pop(message_id)
                result: Message | Exception = reply
                if reply.has_error():
                    dropout = NodeDropout.from_text(reply.error.reason)
                    result = dropout if dropout is not None else reply
                answer, after_s = task_outcome(message, result)
                self._queue.schedule(sent_at, message, message_id, answer, after_s)
            if self._in_flight:
                if time.monotonic() - last_log > PATIENCE_LOG_S:
                    last_log = time.monotonic()
                    log.warning(
                        "the virtual clock waits for %d replies still being "
                        "computed, %.0f s of wall time so far",
                        len(self._in_flight),
                        last_log - started,
                    )
                time.sleep(self.poll_interval_s)
