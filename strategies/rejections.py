"""What a strategy logs about the replies it refuses or bounds.

A reply's fault (NaN, wrong shapes) is logged every time; a refusal that is not
the node's fault (no runtime to weight by) may recur every task, so it is logged
once per node and reason, then at DEBUG. An error reply gets Flower's own line,
so a Flower user finds it.
"""

from __future__ import annotations

from logging import DEBUG, INFO, WARNING

from flowerbed.replies import ReplyRejected
from flwr.app import Message
from flwr.supercore import log


def log_received(stage: str, results: int, failures: int) -> None:
    """Flower's line for the replies an aggregation got."""
    log(INFO, "%s: Received %s results and %s failures", stage, results, failures)


def log_error_reply(reply: Message, node: int) -> None:
    """Flower's own line for an error reply."""
    log(INFO, "\t> Received error in reply from node %s: %s", node, reply.error.reason)


class RejectionLog:
    """The log lines of refused and bounded replies, each said as often as useful.

    Parameters
    ----------
    weighted_by_key : str
        The metric a reply's weight comes from (named in the weight cap's line).
    """

    def __init__(self, weighted_by_key: str) -> None:
        self.weighted_by_key = weighted_by_key
        self._unused_logged: set[tuple[int, str]] = set()
        """(node, reason) of rejections that were not the node's fault, logged."""
        self._weight_capped: set[int] = set()

    def train(
        self, reply: Message, server_round: int, node: int, rejection: ReplyRejected
    ) -> None:
        """A rejected train reply: its node and reason."""
        if reply.has_error():
            log_error_reply(reply, node)
        elif rejection.fault or (node, rejection.reason) not in self._unused_logged:
            if not rejection.fault:  # not its fault, and it may recur every task
                self._unused_logged.add((node, rejection.reason))
            log(
                WARNING,
                "round %d: rejected reply from node %s: %s%s",
                server_round,
                node,
                rejection.reason,
                "" if rejection.fault else " (said once per node)",
            )
        else:
            log(
                DEBUG,
                "round %d: rejected reply from node %s: %s",
                server_round,
                node,
                rejection.reason,
            )

    def evaluate(
        self, reply: Message, server_round: int, rejection: ReplyRejected
    ) -> None:
        """A rejected evaluate reply: its node and reason."""
        if reply.has_error():
            log_error_reply(reply, reply.metadata.src_node_id)
        else:
            log(
                WARNING,
                "round %d: rejected evaluate reply from node %s: %s",
                server_round,
                reply.metadata.src_node_id,
                rejection.reason,
            )

    def weight_capped(
        self,
        node: int,
        claimed: float,
        n: float,
        weight_cap: float | None,
        median: float | None,
    ) -> None:
        """Log, once per node, a weight above ``weight_cap`` times the recent
        ``median`` (as the reply arrives), with the value and the bound; the
        round's summary line counts every capped weight."""
        if weight_cap is None or median is None:
            return
        bound = weight_cap * median
        if claimed <= bound or node in self._weight_capped:
            return
        self._weight_capped.add(node)
        log(
            WARNING,
            "node %s: its weight %g (%s=%g) is more than %g (weight_cap=%g x the "
            "median of recent replies): counted as at most %g from now on",
            node,
            claimed,
            self.weighted_by_key,
            n,
            bound,
            weight_cap,
            bound,
        )
