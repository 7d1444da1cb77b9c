"""The compiled fold step of the strategies' ``UpdateAccumulator``.

One call folds ``s += f_j (x_j - b)`` for up to :data:`MOST` values ``x_j`` of
one array and returns each one's sum of squares of ``d_j = x_j - b``, in one
pass: each element of ``x_j``, ``b`` and ``s`` is read once and ``s`` written
once, with no temporaries (the NumPy fallback makes four passes over a cache-
resident chunk of ``d``). Four values are folded together element by element,
so the base and the sum are read once for the four (a fold of one moves four
arrays per update, a fold of four 7/4); fewer go one after the other, block by
block, while the block's base and sum are in cache, except that
:class:`~flowerbed.strategies.accumulation.UpdateAccumulator` pads two or three values
to four with the base itself at factor 0 (it adds exactly zero, at most turning
a -0.0 of the sum into +0.0, and is read from cache): a 10-update round's last
two, ~6% of its aggregation here (median of 8 rounds, 0.195 -> 0.183 s). One
value stays on its own (padded, 25% slower). Per element it adds ``d**2`` to
the block's sum and ``f d`` to ``s`` -- or, where ``d**2`` is not finite (NaN,
Inf, or ``|d|`` over ~1.8e19 in float32), leaves ``s`` as it is (a masked add),
so ``s`` never takes in a non-finite value. At the end of each block of
:data:`BLOCK` elements the block's sum of squares is the NaN/Inf check (finite
exactly when every difference is, and below the dtype's range); a value with a
non-finite block is taken back from it at once (``s -= f d`` over its finite
elements: the sum is as it was to within one rounding per element), not folded
further, and the call says where that block starts, so the caller takes back
the blocks before it, as for the NumPy fallback. A sum not written yet
(``fresh``) is written by the first value, not read: no zeros to write first.

The arithmetic per element is NumPy's (``d = x - b``, ``f * d``, ``s + f d``,
each rounded to the sum's dtype, no fused multiply-add, and the four values'
additions in their order), so the sum equals the NumPy fallback's, and adding
the values one call at a time, bit for bit when nothing is taken back; only
the order in which a block's squares are added differs (``fastmath``
reassociation, which lets the compiler vectorise that sum; NaN and Inf still
propagate: no ``nnan``/``ninf`` flags; the sum's additions are compiled
without it). :func:`finisher` gives the result's one pass, ``s = c s + x``.
Measured (``flowerbed bench``, machinery section, gives the published
figures): one value at a time ~0.5, four at a time ~0.85-1.0 of the
``a += b`` limit on this project's 2-core Intel Xeon, in-process.

numba compiles each kernel at its first use in a process, for each dtype,
writability and number of values (~0.4 s each), and caches the machine code on
disk (``cache=True``), so later processes load it in milliseconds. Importing
this module does not import numba: :func:`kernel` does, once, and returns
``None`` when numba is not installed (or ``FLOWERBED_NUMBA=0``);
UpdateAccumulator then folds with NumPy (the same sums, slower).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from logging import WARNING
from types import ModuleType
from typing import Any

import numpy as np
from flwr.supercore import log

BLOCK = 1 << 16
"""Elements per checked block (256 KiB of float32): what a rejected update's
block costs to take back; measured 14.1 GB/s against 12.2 GB/s with 4,096
(the per-block call and the sum's conversion)."""

MOST = 4
"""Values the kernel folds together, element by element, at most: a call
takes a tuple of up to this many (it compiles once for each count)."""

Kernel = Callable[..., tuple[np.ndarray, np.ndarray]]
Finisher = Callable[[np.ndarray, np.ndarray, Any], None]
_built: list[ModuleType | None] = []


def kernel() -> Kernel | None:
    """``fold(xs, b, s, fs, zero, fresh, src=None) -> (sums of squares, where
    each stopped or -1)``, or ``None`` without numba. ``xs`` is a tuple of at
    most :data:`MOST` values; they, ``b`` and ``s`` are 1-D, C-contiguous and
    of one float dtype; ``fs`` holds the values' factors in that dtype,
    ``zero`` is a scalar of it; ``fresh`` says ``s`` is not written yet;
    ``src`` (not with ``fresh``): the sum so far is read from it and ``s``,
    not written yet, is written with it plus the values (out of place, the
    same memory traffic as in place). Where a value stopped, nothing of its
    block is left in ``s``; before it, all is."""
    module = _module()
    return module.fold_values if module is not None else None


def finisher() -> Finisher | None:
    """``finish(s, x, factor)``: ``s = factor s + x`` in place, in one pass,
    rounded as NumPy rounds it; ``None`` without numba."""
    module = _module()
    return module.finish if module is not None else None


def _module() -> ModuleType | None:
    if not _built:
        _built.append(_build() if os.environ.get("FLOWERBED_NUMBA") != "0" else None)
    return _built[0]


def _build() -> ModuleType | None:
    try:
        from . import _fold_numba
    except ImportError:  # numba is not installed: the NumPy fallback
        return None
    except Exception as err:  # e.g. numba finds no writable cache directory
        log(WARNING, "fold kernel unavailable, folding with NumPy: %s", err)
        return None
    return _fold_numba
