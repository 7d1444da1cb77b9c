"""Staleness discounts for updates computed on an older model.

An asynchronous or late update is ``s`` model versions behind; these map ``s`` to
the factor its weight is multiplied by.
"""

from __future__ import annotations

from collections.abc import Callable

StalenessFn = Callable[[int], float]
"""Maps an update's staleness (model versions behind) to a weight multiplier."""


def polynomial_staleness(staleness: int, exponent: float = 0.5) -> float:
    """Return ``(1 + s) ** -exponent``; with 0.5 this is FedBuff's ``1/sqrt(1+s)``.

    Nguyen et al., "Federated Learning with Buffered Asynchronous Aggregation",
    AISTATS 2022, Sec. 3 (staleness scaling of client updates); the polynomial
    family is from Xie et al., "Asynchronous Federated Optimization", 2019, Sec. 5.
    """
    if staleness < 0:
        raise ValueError(f"staleness must be >= 0, got {staleness}")
    return float((1.0 + staleness) ** -exponent)


def constant_staleness(staleness: int) -> float:
    """Return 1: stale updates count as much as fresh ones."""
    if staleness < 0:
        raise ValueError(f"staleness must be >= 0, got {staleness}")
    return 1.0


def hinge_staleness(staleness: int, a: float = 10.0, b: int = 4) -> float:
    """Return 1 up to ``b`` versions behind, then ``1 / (a (s - b) + 1)``.

    Xie et al., "Asynchronous Federated Optimization", 2019, Sec. 5 (hinge function).
    """
    if staleness < 0:
        raise ValueError(f"staleness must be >= 0, got {staleness}")
    return 1.0 if staleness <= b else 1.0 / (a * (staleness - b) + 1.0)


STALENESS_FUNCTIONS: dict[str, StalenessFn] = {
    "polynomial": polynomial_staleness,
    "constant": constant_staleness,
    "hinge": hinge_staleness,
}


def resolve_staleness_fn(fn: str | StalenessFn) -> StalenessFn:
    """Return ``fn`` itself, or the named function from :data:`STALENESS_FUNCTIONS`."""
    if callable(fn):
        return fn
    if fn not in STALENESS_FUNCTIONS:
        raise ValueError(
            f"unknown staleness function {fn!r}; valid: {sorted(STALENESS_FUNCTIONS)}"
        )
    return STALENESS_FUNCTIONS[fn]
