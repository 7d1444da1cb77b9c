"""Option objects of :class:`~flowerbed.strategies.LargeBatchSync`.

- :class:`AllReduceRecipe`: the optimiser, its learning-rate schedule and the
  gradient compression the members run (Goyal et al. 2017; You et al., LARS 2017
  and LAMB 2020), the first two a :class:`ServerOptimiser` as LargeBatchRounds'
  recipe has them;
- :class:`MemberProfiling`: how boards are timed when they join and how their
  measured speeds are smoothed.

The flat keywords these replace (``LargeBatchSync(base_lr=0.5)``) still work for
one release and warn with the object to use instead
(:func:`flowerbed.strategies.options.take_options`).
"""

from __future__ import annotations

from dataclasses import dataclass

from flowerbed.parallel.large_batch.optimizers import OPTIMIZERS
from flowerbed.parallel.large_batch.recipe import LrSchedule

COMPRESSIONS = ("none", "fp16", "powersgd")
"""Valid values of :attr:`AllReduceRecipe.compression` (DDP's communication hooks)."""


def _check(rules: list[tuple[bool, str]]) -> None:
    for ok, message in rules:
        if not ok:
            raise ValueError(message)


@dataclass(frozen=True, kw_only=True)
class ServerOptimiser:
    """The large-batch optimiser and its learning-rate schedule, shared by
    :class:`AllReduceRecipe` (the members of a LargeBatchSync job step it) and
    :class:`~flowerbed.strategies.large_batch_rounds.LargeBatchRecipe` (the
    server steps it); keyword-only fields.

    Parameters
    ----------
    optimizer : str (default: "lars")
        ``"sgd"`` (momentum), ``"lars"`` or ``"lamb"``.
    base_lr : float (default: 0.1)
        ``eta`` for ``base_batch`` (Goyal et al.'s ResNet-50: 0.1 for 256).
    base_batch : int (default: 256)
        ``B_ref``; the peak rate is ``base_lr * batch_size / base_batch``.
    warmup_steps : int (default: 0)
        Gradual warm-up length ``T_w`` in steps.
    decay_steps : int (default: 0)
        Total steps of the polynomial decay after warm-up (0: none).
    momentum, weight_decay : float (default: 0.9, 0.0)
        Optimiser settings (LAMB ignores momentum).
    trust : float (default: 0.001)
        LARS's trust coefficient.
    """

    optimizer: str = "lars"
    base_lr: float = 0.1
    base_batch: int = 256
    warmup_steps: int = 0
    decay_steps: int = 0
    momentum: float = 0.9
    weight_decay: float = 0.0
    trust: float = 0.001

    def __post_init__(self) -> None:
        _check(
            [
                (
                    self.optimizer in OPTIMIZERS,
                    f"optimizer {self.optimizer!r}; valid choices: "
                    f"{', '.join(OPTIMIZERS)}",
                )
            ]
        )

    def schedule(self, batch_size: int) -> LrSchedule:
        """Goyal et al.'s learning-rate schedule of a global batch of
        ``batch_size``, over optimiser steps."""
        return LrSchedule(
            base_lr=self.base_lr,
            base_batch=self.base_batch,
            batch_size=batch_size,
            warmup_steps=self.warmup_steps,
            total_steps=self.decay_steps,
        )


@dataclass(frozen=True)
class AllReduceRecipe(ServerOptimiser):
    """The members' optimiser, schedule and gradient compression.

    Parameters
    ----------
    compression : str (default: "none")
        ``"none"``, ``"fp16"`` or ``"powersgd"``.
    powersgd_rank : int (default: 1)
        PowerSGD's approximation rank.
    optimizer, base_lr, base_batch, warmup_steps, decay_steps, momentum, \
weight_decay, trust
        Keyword-only, as in :class:`ServerOptimiser` (``optimizer`` is ignored
        when the strategy's ``training`` names an optimiser factory).
    """

    compression: str = "none"
    powersgd_rank: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        _check(
            [
                (
                    self.compression in COMPRESSIONS,
                    f"compression {self.compression!r}; valid choices: "
                    f"{', '.join(COMPRESSIONS)}",
                ),
                (self.powersgd_rank >= 1, "powersgd_rank must be >= 1"),
            ]
        )


@dataclass(frozen=True)
class MemberProfiling:
    """How boards are timed when they join and how their speeds are smoothed.

    Parameters
    ----------
    profile_batch, profile_repeats : int (default: 8, 3)
        Samples per timed step and steps timed when profiling a board.
    speed_smoothing : float (default: 0.5)
        ``a``, weight of a segment's speed measurement:
        ``s <- a s_new + (1 - a) s``.
    query_timeout_s : float (default: 60)
        How long to wait for profiling answers.
    """

    profile_batch: int = 8
    profile_repeats: int = 3
    speed_smoothing: float = 0.5
    query_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        _check(
            [
                (
                    self.profile_batch >= 1 and self.profile_repeats >= 1,
                    "profiling needs >= 1",
                ),
                (0 < self.speed_smoothing <= 1, "speed_smoothing must be in (0, 1]"),
                (self.query_timeout_s > 0, "query_timeout_s must be > 0"),
            ]
        )
