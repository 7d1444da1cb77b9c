"""numba kernels of :mod:`flowerbed.strategies.fold_kernel` (imports numba: load
through :func:`flowerbed.strategies.fold_kernel.kernel` only)."""

from __future__ import annotations

from typing import Any

import numba

from .fold_kernel import BLOCK


@numba.njit(nogil=True, cache=True, boundscheck=False, fastmath={"reassoc"})
def _fold_block(x: Any, b: Any, s: Any, f: Any, zero: Any) -> Any:
    """``s += f d`` where ``d = x - b`` has a finite square (else ``s`` keeps its
    value there); return the sum of ``d**2`` in the arrays' dtype."""
    part = zero
    for i in range(x.size):
        d = x[i] - b[i]
        square = d * d
        part += square
        s[i] += f * (d if square - square == 0 else zero)
    return part


@numba.njit(nogil=True, cache=True, boundscheck=False)
def _unfold_block(x: Any, b: Any, s: Any, f: Any, zero: Any) -> None:
    """Take back what :func:`_fold_block` added (to within one rounding)."""
    for i in range(x.size):
        d = x[i] - b[i]
        square = d * d
        s[i] -= f * (d if square - square == 0 else zero)


@numba.njit(nogil=True, cache=True, boundscheck=False)
def fold(x: Any, b: Any, s: Any, f: Any, zero: Any) -> tuple[float, int]:
    """Fold block by block; stop at (and take back) a non-finite block."""
    n = x.size
    total = 0.0
    start = 0
    while start < n:
        stop = min(start + BLOCK, n)
        part = _fold_block(x[start:stop], b[start:stop], s[start:stop], f, zero)
        if part - part != 0:  # NaN or Inf (Inf - Inf is NaN)
            _unfold_block(x[start:stop], b[start:stop], s[start:stop], f, zero)
            return total, start
        total += float(part)
        start = stop
    return total, -1
