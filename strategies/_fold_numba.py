"""numba kernels of :mod:`flowerbed.strategies.fold_kernel` (imports numba: load
through :func:`flowerbed.strategies.fold_kernel.kernel` only)."""

from __future__ import annotations

from typing import Any

import numba
import numpy as np

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
        s[i] = s[i] + f * d if square < np.inf else s[i]
    return part


@numba.njit(nogil=True, cache=True, boundscheck=False, fastmath={"reassoc"})
def _start_block(x: Any, b: Any, s: Any, f: Any, zero: Any) -> Any:
    """:func:`_fold_block` into a sum not yet written: ``s = 0 + f d`` (so
    reading it is not needed, and the sum is as adding into zeros makes it)."""
    part = zero
    for i in range(x.size):
        d = x[i] - b[i]
        square = d * d
        part += square
        s[i] = zero + f * d if square < np.inf else zero
    return part


@numba.njit(nogil=True, cache=True, boundscheck=False)
def _unfold_block(x: Any, b: Any, s: Any, f: Any, zero: Any) -> None:
    """Take back what :func:`_fold_block` added (to within one rounding)."""
    for i in range(x.size):
        d = x[i] - b[i]
        square = d * d
        s[i] = s[i] - f * d if square < np.inf else s[i]


@numba.njit(nogil=True, cache=True)
def _plus(t: Any, v: Any) -> Any:
    """``t + v`` as one rounded addition: not reassociated with the additions
    around it (the caller's ``fastmath`` flags do not reach this one)."""
    return t + v


@numba.njit(nogil=True, cache=True, boundscheck=False, fastmath={"reassoc"})
def _fold4_block(xs: Any, b: Any, s: Any, fs: Any, zero: Any, fresh: bool) -> Any:
    """:func:`_fold_block` of four values at once: each element of the base
    and of the sum is read once for the four (the sum's additions in the
    values' order, as four calls make them); the four sums of squares."""
    x0, x1, x2, x3 = xs
    f0, f1, f2, f3 = fs[0], fs[1], fs[2], fs[3]
    p0 = p1 = p2 = p3 = zero
    for i in range(b.size):
        base = b[i]
        t = zero if fresh else s[i]
        d = x0[i] - base
        square = d * d
        p0 += square
        t = _plus(t, f0 * d) if square < np.inf else t
        d = x1[i] - base
        square = d * d
        p1 += square
        t = _plus(t, f1 * d) if square < np.inf else t
        d = x2[i] - base
        square = d * d
        p2 += square
        t = _plus(t, f2 * d) if square < np.inf else t
        d = x3[i] - base
        square = d * d
        p3 += square
        s[i] = _plus(t, f3 * d) if square < np.inf else t
    return p0, p1, p2, p3


@numba.njit(nogil=True, cache=True, boundscheck=False, fastmath={"reassoc"})
def _fold4_block_moved(xs: Any, b: Any, s: Any, fs: Any, zero: Any, src: Any) -> Any:
    """:func:`_fold4_block` reading the sum so far from ``src`` and writing it,
    plus the values, to ``s`` (a separate function: the in-place one, given
    the same array twice, compiled ~20% slower)."""
    x0, x1, x2, x3 = xs
    f0, f1, f2, f3 = fs[0], fs[1], fs[2], fs[3]
    p0 = p1 = p2 = p3 = zero
    for i in range(b.size):
        base = b[i]
        t = src[i]
        d = x0[i] - base
        square = d * d
        p0 += square
        t = _plus(t, f0 * d) if square < np.inf else t
        d = x1[i] - base
        square = d * d
        p1 += square
        t = _plus(t, f1 * d) if square < np.inf else t
        d = x2[i] - base
        square = d * d
        p2 += square
        t = _plus(t, f2 * d) if square < np.inf else t
        d = x3[i] - base
        square = d * d
        p3 += square
        s[i] = _plus(t, f3 * d) if square < np.inf else t
    return p0, p1, p2, p3


@numba.njit(nogil=True, cache=True, boundscheck=False)
def _fold_each(
    xs: Any,
    start: int,
    stop: int,
    b: Any,
    s: Any,
    fs: Any,
    zero: Any,
    fresh: bool,
    squares: Any,
    stopped: Any,
    src: Any,
    moved: bool,
) -> None:
    """Fold the block ``start:stop`` of each value not stopped yet, one after
    the other; a value whose block is not finite is taken back from it and
    stopped there. With ``fresh``, the block of ``s`` is not written yet; with
    ``moved``, the sum so far is in ``src`` (copied in first, in cache)."""
    base = b[start:stop]
    into = s[start:stop]
    unwritten = fresh
    if moved and not fresh:
        into[:] = src[start:stop]
    for j in range(len(xs)):
        if stopped[j] >= 0:
            continue
        x = xs[j][start:stop]
        if unwritten:
            part = _start_block(x, base, into, fs[j], zero)
        else:
            part = _fold_block(x, base, into, fs[j], zero)
        if part - part != 0:  # NaN or Inf (Inf - Inf is NaN)
            if unwritten:
                into[:] = zero
            else:
                _unfold_block(x, base, into, fs[j], zero)
            stopped[j] = start
        else:
            squares[j] += float(part)
        unwritten = False
    if unwritten:
        into[:] = zero


@numba.njit(nogil=True, cache=True, boundscheck=False)
def fold(
    xs: Any, b: Any, s: Any, fs: Any, zero: Any, fresh: bool, src: Any, moved: bool
) -> tuple[Any, Any]:
    """Fold each ``xs[j]`` with factor ``fs[j]``, block by block: all of a
    block's values while its base and sum are in cache. A value whose block is
    not finite is taken back from that block and not folded further. With
    ``fresh``, ``s`` holds nothing yet: the first value of a block writes it
    (or zeros, where none folds); with ``moved``, the sum so far is read from
    ``src`` and ``s`` is written with it plus the values (out of place)."""
    squares = np.zeros(len(xs), np.float64)
    stopped = np.full(len(xs), -1, np.int64)
    for start in range(0, b.size, BLOCK):
        stop = min(start + BLOCK, b.size)
        _fold_each(xs, start, stop, b, s, fs, zero, fresh, squares, stopped, src, moved)
    return squares, stopped


@numba.njit(nogil=True, cache=True, boundscheck=False)
def fold4(
    xs: Any, b: Any, s: Any, fs: Any, zero: Any, fresh: bool, src: Any, moved: bool
) -> tuple[Any, Any]:
    """:func:`fold` of four values, which it folds together element by element
    while all four are finite (one read of the base and one read and write of
    the sum for the four); from a non-finite block on, as :func:`fold` does."""
    squares = np.zeros(4, np.float64)
    stopped = np.full(4, -1, np.int64)
    for start in range(0, b.size, BLOCK):
        stop = min(start + BLOCK, b.size)
        if (stopped >= 0).any():
            _fold_each(
                xs, start, stop, b, s, fs, zero, fresh, squares, stopped, src, moved
            )
            continue
        base = b[start:stop]
        into = s[start:stop]
        block = (
            xs[0][start:stop],
            xs[1][start:stop],
            xs[2][start:stop],
            xs[3][start:stop],
        )
        if moved and not fresh:
            parts = _fold4_block_moved(block, base, into, fs, zero, src[start:stop])
        else:
            parts = _fold4_block(block, base, into, fs, zero, fresh)
        failed = 0
        for j in range(4):
            part = parts[j]
            if part - part != 0:  # NaN or Inf (Inf - Inf is NaN)
                _unfold_block(block[j], base, into, fs[j], zero)
                stopped[j] = start
                failed += 1
            else:
                squares[j] += float(part)
        if fresh and failed == 4:
            into[:] = zero
    return squares, stopped


def fold_values(
    xs: tuple[Any, ...],
    b: Any,
    s: Any,
    fs: Any,
    zero: Any,
    fresh: bool,
    src: Any = None,
) -> tuple[Any, Any]:
    """:func:`fold4` for four values, else :func:`fold`; out of place (the sum
    so far read from ``src``, ``s`` written) when ``src`` is given."""
    moved = src is not None and src is not s
    source = src if moved else s
    return (fold4 if len(xs) == 4 else fold)(xs, b, s, fs, zero, fresh, source, moved)


@numba.njit(nogil=True, cache=True, boundscheck=False)
def finish(s: Any, x: Any, factor: Any) -> None:
    """``s = factor s + x`` in place, rounded as NumPy's ``s *= factor`` then
    ``s += x`` round it (no fused multiply-add), in one pass."""
    for i in range(s.size):
        s[i] = s[i] * factor + x[i]
