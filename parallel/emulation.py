"""Timing a member's compute, and emulating a slower device's speed.

On real boards a member only measures: :class:`TimedModule` wraps the layers a
member runs and records the forward and backward seconds of every call. On one
machine the same wrapper also *emulates* a device: it runs the real computation,
then sleeps for the difference between the real time and the time the device
would have taken, so every timing the planner sees is real wall time and unequal
as the fleet is. The device's time comes from its effective training rate
(:class:`DeviceSpeed`, FLOP/s), which the caller derives from a device catalogue
(``flowerbed.sims.devices``: a Pi 4B trains the reference LeNet at 3.1 ms per
sample, i.e. 1.35 GFLOP/s); this package does not import the catalogue, the numbers
are passed in.

Emulated seconds (FLOPs = 2 x multiply-accumulates; backward = 2 x forward, the
usual rule: Kaplan et al. 2020, "Scaling laws for neural language models", Sec. 2.1)::

    forward(layers, n samples)  = 2 * MACs(layers, n) / rate
    backward(layers, n samples) = 4 * MACs(layers, n) / rate

A call whose real time already exceeds its target is not slowed further (the host
is slower than the emulated device; :attr:`TimedModule.overrun_s` counts it, so a
local run can say its emulation was not faithful).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from flowerbed.models import count_macs
from torch import nn

FORWARD_FLOPS_PER_MAC = 2.0
BACKWARD_FLOPS_PER_MAC = 4.0


@dataclass(frozen=True)
class DeviceSpeed:
    """An emulated device's effective training rate, possibly changing mid-run.

    Attributes
    ----------
    flops_per_s : float
        Effective training FLOP/s of the device (> 0).
    slow_from_step : int
        From this global step on the device runs ``slow_factor`` times slower
        (-1: never). A test aid for dynamic re-partitioning (a board that heats
        up and throttles, or gets a second job).
    slow_factor : float
        Slow-down factor after ``slow_from_step`` (>= 1).
    """

    flops_per_s: float
    slow_from_step: int = -1
    slow_factor: float = 1.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.flops_per_s) and self.flops_per_s > 0):
            raise ValueError(f"flops_per_s must be > 0, got {self.flops_per_s}")
        if not (math.isfinite(self.slow_factor) and self.slow_factor >= 1):
            raise ValueError(f"slow_factor must be >= 1, got {self.slow_factor}")

    def rate_at(self, step: int) -> float:
        """FLOP/s at global step ``step``."""
        if 0 <= self.slow_from_step <= step:
            return self.flops_per_s / self.slow_factor
        return self.flops_per_s

    def forward_s(self, macs: float, step: int) -> float:
        return FORWARD_FLOPS_PER_MAC * macs / self.rate_at(step)

    def backward_s(self, macs: float, step: int) -> float:
        return BACKWARD_FLOPS_PER_MAC * macs / self.rate_at(step)

    def train_s(self, macs: float, step: int) -> float:
        """Forward plus backward seconds of ``macs`` multiply-accumulates."""
        return self.forward_s(macs, step) + self.backward_s(macs, step)


class _Mark(torch.autograd.Function):
    """Identity whose backward calls a callback: marks where a backward pass is."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, callback: Callable[[], None]
    ) -> torch.Tensor:
        ctx.callback = callback
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.callback()
        return grad, None


class TimedModule(nn.Module):
    """Runs ``inner``, timing forward and backward, optionally emulating a device.

    The wrapper is transparent to autograd (identity marks around ``inner``) and
    to ``state_dict`` (``inner``'s names are kept: use :attr:`inner` for state).
    The first stage's input does not require a gradient; the wrapper then asks
    autograd for one anyway (on a detached copy) so that the backward pass has an
    end to time; the parameters' gradients are unchanged.

    Attributes
    ----------
    forward_s, backward_s : list[float]
        Seconds of every forward and backward call (after any emulation sleep).
    overrun_s : float
        Seconds by which real compute exceeded the emulated device's time.
    step : int
        Global step of the current call; :class:`DeviceSpeed` may depend on it.
    """

    def __init__(self, inner: nn.Module, speed: DeviceSpeed | None = None) -> None:
        super().__init__()
        self.inner = inner
        self.speed = speed
        self.step = 0
        self.forward_s: list[float] = []
        self.backward_s: list[float] = []
        self.overrun_s = 0.0
        self._macs: dict[tuple[int, ...], int] = {}
        self._backward_begin: float | None = None

    def reset(self) -> None:
        self.forward_s.clear()
        self.backward_s.clear()
        self.overrun_s = 0.0

    def macs(self, x: torch.Tensor) -> int:
        """Multiply-accumulates of ``inner`` on an input shaped like ``x``."""
        shape = tuple(x.shape)
        if shape not in self._macs:
            with torch.no_grad():
                self._macs[shape] = count_macs(
                    self.inner, torch.zeros(shape, dtype=x.dtype)
                )
        return self._macs[shape]

    def _pad(self, real: float, target: float) -> float:
        if target > real:
            time.sleep(target - real)
            return target
        if self.speed is not None:
            self.overrun_s += real - target
        return real

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        macs = self.macs(x) if self.speed is not None else 0
        step = self.step
        if torch.is_grad_enabled():
            if not x.requires_grad:
                x = x.detach().requires_grad_(True)
            x = _Mark.apply(x, lambda: self._end_backward(macs, step))
        begin = time.perf_counter()
        out = self.inner(x)
        real = time.perf_counter() - begin
        target = self.speed.forward_s(macs, step) if self.speed is not None else 0.0
        self.forward_s.append(self._pad(real, target))
        if (
            torch.is_grad_enabled()
            and isinstance(out, torch.Tensor)
            and out.requires_grad
        ):
            out = _Mark.apply(out, self._start_backward)
        return out

    def _start_backward(self) -> None:
        self._backward_begin = time.perf_counter()

    def _end_backward(self, macs: int, step: int) -> None:
        if self._backward_begin is None:
            return
        real = time.perf_counter() - self._backward_begin
        self._backward_begin = None
        target = self.speed.backward_s(macs, step) if self.speed is not None else 0.0
        self.backward_s.append(self._pad(real, target))
