"""Which nodes a round asks: sampling connected nodes, and benching nodes whose
replies keep being rejected (quarantine).
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from logging import INFO, WARNING
from typing import Any

from flowerbed.clock import Clock
from flowerbed.strategies.checkpoints import MAX_ROUND, Bounds, StateReader
from flwr.serverapp import Grid
from flwr.supercore import log

WAIT_FOR_NODES_S = 1.0
"""Clock seconds between checks while too few nodes are connected."""


class Quarantine:
    """Bench nodes whose replies keep being rejected.

    After ``after`` consecutive faulty replies a node sits out ``rounds`` rounds;
    an accepted reply resets its count.
    """

    def __init__(self, after: int = 3, rounds: int = 5) -> None:
        if after < 1:
            raise ValueError(f"quarantine_after must be >= 1, got {after}")
        if rounds < 0:
            raise ValueError(f"quarantine_rounds must be >= 0, got {rounds}")
        self.after = after
        self.rounds = rounds
        self.failures: dict[int, int] = {}
        self.until: dict[int, int] = {}

    def record_failure(self, node_id: int, server_round: int) -> None:
        """Count a rejected reply; quarantine the node when the count reaches limit."""
        self.failures[node_id] = self.failures.get(node_id, 0) + 1
        if self.failures[node_id] >= self.after and self.rounds > 0:
            self.until[node_id] = server_round + self.rounds
            self.failures[node_id] = 0
            log(
                WARNING,
                "node %d quarantined after %d rejected replies: out until round %d",
                node_id,
                self.after,
                self.until[node_id],
            )

    def record_success(self, node_id: int) -> None:
        """An accepted reply clears the node's count."""
        self.failures.pop(node_id, None)

    def is_quarantined(self, node_id: int, server_round: int) -> bool:
        """True while ``server_round`` is at or before the node's release round."""
        return self.until.get(node_id, -1) >= server_round

    def state(self) -> dict[str, Any]:
        """JSON-able state for checkpoints."""
        return {
            "failures": {str(k): v for k, v in self.failures.items()},
            "until": {str(k): v for k, v in self.until.items()},
        }

    def load_state(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state` returned.

        Raises
        ------
        CheckpointError
            Naming the field, its value and the valid range: counts are whole
            numbers from 0 to :data:`~.checkpoints.MAX_ROUND`, release rounds up
            to that plus ``rounds``, keys node ids. Nothing is loaded then.
        """
        saved = StateReader.of(state)
        failures = saved.counts_by_node("failures")
        until = saved.counts_by_node(
            "until", Bounds(0, MAX_ROUND + self.rounds, whole=True)
        )
        self.failures, self.until = failures, until


def sample_nodes(
    grid: Grid,
    clock: Clock,
    *,
    count: int,
    min_available: int,
    exclude: set[int],
    rng: random.Random,
    timeout: float,
) -> list[int]:
    """Pick ``count`` connected nodes not in ``exclude`` (fewer if not enough).

    Waits on the clock, at most ``timeout`` seconds, until ``min_available`` nodes
    are connected (as Flower's own sampling does).
    """
    give_up = clock.now() + timeout
    nodes = sorted(grid.get_node_ids())
    while len(nodes) < min_available and clock.now() < give_up:
        log(
            INFO,
            "waiting for nodes: %d connected, %d needed",
            len(nodes),
            min_available,
        )
        clock.wait(WAIT_FOR_NODES_S)
        nodes = sorted(grid.get_node_ids())
    eligible = [n for n in nodes if n not in exclude]
    return rng.sample(eligible, min(count, len(eligible)))


def round_rng(seed: int, server_round: int, purpose: str) -> random.Random:
    """A generator fixed by (seed, round, purpose): resumed runs sample the same."""
    return random.Random(f"{seed}:{server_round}:{purpose}")
