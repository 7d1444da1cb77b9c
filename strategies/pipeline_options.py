"""Option objects of :class:`~flowerbed.strategies.PipelineTraining`.

- :class:`Pipelining`: how one step runs across the stages (micro-batches, the
  schedule) and how often stages replicate their layers for recovery;
- :class:`PipelinePlanning`: which members take part, how the layers are split
  between them and re-split from measured times, and how long profiling and a
  round's attempts may go on.

The flat keywords these replace (``PipelineTraining(micro_batches=8)``) still
work for one release and warn with the object to use instead
(:func:`flowerbed.strategies.options.take_options`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from flowerbed.parallel.plan import SCHEDULES

DEFAULT_LINK_BYTES_PER_S = 12.5e6
"""Assumed bandwidth of a link not yet measured: 100 Mbit/s (a Pi 3's Ethernet)."""


def _check(owner: str, rules: list[tuple[bool, str]]) -> None:
    for ok, message in rules:
        if not ok:
            raise ValueError(f"{owner}: {message}")


@dataclass(frozen=True)
class Pipelining:
    """How one step runs across the stages, and how often they replicate.

    Parameters
    ----------
    micro_batches : int (default: 4)
        ``m``, micro-batches per step; 1F1B uses at most ``m`` stages.
    schedule : str (default: "1f1b")
        ``"1f1b"`` or ``"gpipe"`` (:data:`flowerbed.parallel.plan.SCHEDULES`).
    replicate_every : int (default: 5)
        ``R``: steps between ring replications (0: never; a loss then costs
        the segment).
    """

    micro_batches: int = 4
    schedule: str = "1f1b"
    replicate_every: int = 5

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Raise ValueError naming the field that is out of range."""
        _check(
            "Pipelining",
            [
                (
                    self.micro_batches >= 1,
                    f"micro_batches must be >= 1, got {self.micro_batches}",
                ),
                (
                    self.schedule in SCHEDULES,
                    f"schedule must be one of {', '.join(SCHEDULES)}, got "
                    f"{self.schedule!r}",
                ),
                (
                    self.replicate_every >= 0,
                    f"replicate_every must be >= 0, got {self.replicate_every}",
                ),
            ],
        )


@dataclass(frozen=True)
class PipelinePlanning:
    """Which members take part and how the layers are split between them.

    Parameters
    ----------
    num_stages : int, optional (default: None)
        Most members to use (default: all usable, at most one per layer, and
        with 1F1B at most ``micro_batches``); the fastest are kept. More than
        the model's layers is an error.
    stage_sizes : sequence of int, optional (default: None)
        A fixed partition (layers per stage, in member order) instead of the
        DP; disables re-partitioning. Must sum to the model's layers.
    repartition : bool (default: True)
        Re-partition from measured times
        (:class:`~flowerbed.strategies.PipelineTraining`).
    repartition_threshold : float (default: 0.1)
        Least relative step-time improvement worth a re-partition, in [0, 1).
    link_bandwidth : float (default: 12.5e6)
        Bytes/s assumed for links not yet measured.
    profile_repeats : int (default: 3)
        Timed passes per layer when profiling.
    query_timeout_s : float (default: 120)
        How long profiling and evaluation wait for a member.
    max_attempts : int (default: 10)
        Segment attempts per round before the run stops early (logged; the
        Result keeps the last good weights).
    """

    num_stages: int | None = None
    stage_sizes: Sequence[int] | None = None
    repartition: bool = True
    repartition_threshold: float = 0.1
    link_bandwidth: float = DEFAULT_LINK_BYTES_PER_S
    profile_repeats: int = 3
    query_timeout_s: float = 120.0
    max_attempts: int = 10

    def __post_init__(self) -> None:
        if self.stage_sizes is not None:
            object.__setattr__(self, "stage_sizes", tuple(self.stage_sizes))
        self.check()

    def check(self) -> None:
        """Raise ValueError naming the field that is out of range."""
        stages = self.num_stages
        _check(
            "PipelinePlanning",
            [
                (
                    stages is None or stages >= 1,
                    f"num_stages must be >= 1, got {stages}",
                ),
                (
                    0 <= self.repartition_threshold < 1,
                    "repartition_threshold must be in [0, 1), got "
                    f"{self.repartition_threshold}",
                ),
                (
                    self.link_bandwidth > 0,
                    f"link_bandwidth must be > 0, got {self.link_bandwidth}",
                ),
                (
                    self.profile_repeats >= 1,
                    f"profile_repeats must be >= 1, got {self.profile_repeats}",
                ),
                (
                    self.max_attempts >= 1,
                    f"max_attempts must be >= 1, got {self.max_attempts}",
                ),
            ],
        )
