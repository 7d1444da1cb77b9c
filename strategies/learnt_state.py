"""What a data-parallel strategy has learnt about its nodes, as a checkpoint holds it.

Each node's smoothed speed, the quarantine's counts, and the recent weights,
update norms and step counts the influence bound measures against. Read back,
every field is checked against its range (:class:`~.checkpoints.StateReader`):
a field out of range raises one CheckpointError naming it, and nothing is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from flowerbed.replies import MAX_STEPS
from flowerbed.strategies.checkpoints import (
    NORMS,
    STEPS_PER_SECOND,
    Bounds,
    StateReader,
    samples_per_second,
)
from flowerbed.strategies.sampling import Quarantine

from .robust import Reference


@dataclass
class LearntState:
    """The learnt state of one strategy (module docstring)."""

    speeds: dict[int, float]
    """Smoothed optimiser steps per second of each node."""
    quarantine: Quarantine
    weights: Reference
    """Weights of recent accepted replies."""
    norms: Reference
    """Norms of recent accepted updates."""
    steps: Reference
    """``num-steps`` of recent accepted replies."""

    def state(self) -> dict[str, Any]:
        """JSON-able, as a checkpoint holds it."""
        return {
            "speeds": {str(k): v for k, v in self.speeds.items()},
            "quarantine": self.quarantine.state(),
            "influence": {
                "weights": list(self.weights.values),
                "norms": list(self.norms.values),
                "steps": list(self.steps.values),
            },
        }

    @classmethod
    def read(
        cls, state: dict[str, Any], quarantine: Quarantine, max_num_examples: float
    ) -> LearntState:
        """What :meth:`state` returned, checked; ``quarantine`` gives the
        settings of the quarantine read, ``max_num_examples`` the weights' range."""
        saved = StateReader.of(state)
        speeds = saved.by_node("speeds", STEPS_PER_SECOND)
        read = Quarantine(quarantine.after, quarantine.rounds)
        read.load_state(saved.section("quarantine"))
        influence = saved.section("influence")
        weights = influence.numbers("weights", samples_per_second(max_num_examples))
        norms = influence.numbers("norms", NORMS)
        steps = (
            influence.numbers("steps", Bounds(0.0, MAX_STEPS))
            if "steps" in influence
            else []  # a checkpoint from before the steps bound
        )
        return cls(speeds, read, Reference(weights), Reference(norms), Reference(steps))
