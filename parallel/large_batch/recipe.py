"""Large-batch synchronous training, the pure parts: batch shares and the LR recipe.

Shared by the all-reduce job (:class:`flowerbed.strategies.LargeBatchSync`), the
server-side large-batch rounds (:class:`flowerbed.strategies.LargeBatchRounds`),
the virtual clock and the benchmark. No torch here.

**Batch shares proportional to speed.** A global batch of ``B`` samples per step
is split so that unequal devices finish each step together: member ``i`` with
measured speed ``s_i`` (samples per second) gets

    B_i = B * s_i / sum_j s_j          (rounded by largest remainder, each >= 1)

which is S0's idea (Hemed, Lavie, Kaplan, ICSEE 2018: weight a node by its
runtime relative to the others) applied per step: the per-step time
``B_i / s_i`` is then the same for everyone.

**One large batch from unequal shares.** With ``l_s`` the loss of sample ``s``
and ``g_i = (1 / B_i) sum_{s in share i} grad l_s`` member ``i``'s mean gradient,

    grad (1 / B) sum_{s in batch} l_s  =  sum_i (B_i / B) g_i

so each member scales its mean loss by ``B_i / B`` and the members' gradients
are summed; DistributedDataParallel averages (sums, then divides by the world
size ``W``), so the member multiplies by ``W`` as well: :func:`loss_scale`.
The server-side rounds average replies weighted by examples, which is the same
sum with weights ``B_i / B``.

**Learning rate.** Linear scaling with gradual warm-up (Goyal et al., "Accurate,
Large Minibatch SGD: Training ImageNet in 1 Hour", arXiv:1706.02677, Sec. 2.1
and 2.2): for a batch ``B`` and a reference ``(eta, B_ref)`` (their ResNet-50:
``eta = 0.1`` for ``B_ref = 256``) the target rate is ``eta_hat = eta * B /
B_ref``; warm-up starts at ``eta`` and grows by a constant amount per step to
reach ``eta_hat`` after ``T_w`` steps (they use 5 epochs):

    lr(t) = eta + (eta_hat - eta) * t / T_w      for t < T_w
    lr(t) = eta_hat * decay(t)                   afterwards

with an optional polynomial decay ``decay(t) = (1 - (t - T_w) / (T - T_w)) **
power`` to ``T`` total steps (LARS: You, Gitman, Ginsburg, arXiv:1708.03888,
Sec. 6, poly decay with power 2).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


def _check_positive(name: str, value: float) -> None:
    if isinstance(value, bool) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


def batch_shares(
    batch_size: int, speeds: Sequence[float], minimum: int = 1
) -> list[int]:
    """Split ``batch_size`` samples over members proportionally to ``speeds``.

    ``B_i = B * s_i / sum_j s_j`` (module docstring), rounded by largest
    remainder (ties to the lower index) so the shares sum to ``batch_size``
    exactly, with every member getting at least ``minimum`` samples (taken from
    the largest shares). Raises ValueError for no members, a speed that is not a
    finite number > 0, or a batch too small for ``minimum`` per member.
    """
    if not speeds:
        raise ValueError("no members to share the batch among")
    for index, speed in enumerate(speeds):
        _check_positive(f"speed of member {index}", float(speed))
    if minimum < 0:
        raise ValueError(f"minimum share must be >= 0, got {minimum}")
    if batch_size < minimum * len(speeds):
        raise ValueError(
            f"batch of {batch_size} cannot give {len(speeds)} members at least "
            f"{minimum} samples each"
        )
    total = float(sum(speeds))
    exact = [batch_size * s / total for s in speeds]
    shares = [math.floor(e) for e in exact]
    order = sorted(range(len(speeds)), key=lambda i: (-(exact[i] - shares[i]), i))
    for i in order[: batch_size - sum(shares)]:
        shares[i] += 1
    for i in range(len(shares)):
        while shares[i] < minimum:
            donor = max(range(len(shares)), key=lambda j: (shares[j], -j))
            shares[donor] -= 1
            shares[i] += 1
    return shares


def share_bounds(shares: Sequence[int]) -> list[tuple[int, int]]:
    """``(first, stop)`` sample indices of each share within the global batch."""
    bounds = []
    first = 0
    for share in shares:
        bounds.append((first, first + share))
        first += share
    return bounds


def loss_scale(share: int, batch_size: int, world_size: int) -> float:
    """Factor on a member's mean loss so DDP's average is the large batch's gradient.

    ``W * B_i / B`` (module docstring): DDP divides the summed gradients by ``W``.
    """
    if not 0 < share <= batch_size:
        raise ValueError(f"share {share} must be in 1..{batch_size}")
    if world_size < 1:
        raise ValueError(f"world size must be >= 1, got {world_size}")
    return world_size * share / batch_size


@dataclass(frozen=True)
class LrSchedule:
    """Goyal et al.'s linear scaling with gradual warm-up (module docstring).

    Attributes
    ----------
    base_lr : float
        ``eta``, the rate that suits ``base_batch`` (> 0).
    base_batch : int
        ``B_ref``, the batch ``base_lr`` was tuned for (Goyal et al.: 256).
    batch_size : int
        ``B``, the large batch actually used per step.
    warmup_steps : int
        ``T_w`` (0: no warm-up, the scaled rate from the first step).
    total_steps : int
        ``T`` for the polynomial decay after warm-up (0: no decay).
    power : float
        Exponent of the polynomial decay (LARS's choice: 2).
    """

    base_lr: float
    base_batch: int
    batch_size: int
    warmup_steps: int = 0
    total_steps: int = 0
    power: float = 2.0

    def __post_init__(self) -> None:
        _check_positive("base_lr", self.base_lr)
        _check_positive("base_batch", self.base_batch)
        _check_positive("batch_size", self.batch_size)
        _check_positive("power", self.power)
        if self.warmup_steps < 0 or self.total_steps < 0:
            raise ValueError("warmup_steps and total_steps must be >= 0")
        if self.total_steps and self.total_steps <= self.warmup_steps:
            raise ValueError(
                f"total_steps ({self.total_steps}) must exceed warmup_steps "
                f"({self.warmup_steps}), or be 0 for no decay"
            )

    @property
    def peak_lr(self) -> float:
        """``eta_hat = eta * B / B_ref`` (Goyal et al., Sec. 2.1)."""
        return self.base_lr * self.batch_size / self.base_batch

    def lr(self, step: int) -> float:
        """The learning rate of global step ``step`` (0-based)."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if step < self.warmup_steps:
            return self.base_lr + (self.peak_lr - self.base_lr) * (
                step / self.warmup_steps
            )
        if not self.total_steps:
            return self.peak_lr
        done = min(
            1.0, (step - self.warmup_steps) / (self.total_steps - self.warmup_steps)
        )
        return self.peak_lr * (1.0 - done) ** self.power

    def to_config(self) -> dict[str, float | int]:
        return {
            "base-lr": self.base_lr,
            "base-batch": self.base_batch,
            "batch-size": self.batch_size,
            "warmup-steps": self.warmup_steps,
            "total-steps": self.total_steps,
            "power": self.power,
        }

    @classmethod
    def from_config(cls, config: Mapping[str, object]) -> LrSchedule:
        """Read what :meth:`to_config` wrote; ValueError names a bad field."""
        try:
            return cls(
                base_lr=float(config["base-lr"]),  # type: ignore[arg-type]
                base_batch=int(config["base-batch"]),  # type: ignore[call-overload]
                batch_size=int(config["batch-size"]),  # type: ignore[call-overload]
                warmup_steps=int(config.get("warmup-steps", 0)),  # type: ignore[call-overload]
                total_steps=int(config.get("total-steps", 0)),  # type: ignore[call-overload]
                power=float(config.get("power", 2.0)),  # type: ignore[arg-type]
            )
        except KeyError as err:
            raise ValueError(f"learning-rate schedule lacks {err}") from None
        except (TypeError, ValueError) as err:
            raise ValueError(f"learning-rate schedule: {err}") from None
