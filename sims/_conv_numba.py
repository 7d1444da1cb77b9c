"""numba kernels of :mod:`flowerbed.sims.numba_kernels` (imports numba: load
through :func:`flowerbed.sims.numba_kernels.kernels_for` only).

Every array is C-contiguous float32 (a tensor's memory in the node layout,
``(nodes, H, W, channels, batch)``, weights ``(nodes, O, KH, KW, C)``), indexed
flat; the sizes are arguments, so one machine code (cached on disk) serves
every shape.

A :data:`Vector` is :data:`LANES` samples of one position and channel, held as
a tuple of floats: with superword-level vectorisation (which
:mod:`flowerbed.sims.numba_kernels` turns on while these compile) the compiler
keeps each in one AVX-512 register (or two of AVX2), so a sum over taps and
channels is accumulated there for a block of :data:`BLOCK` output (or input)
channels at once (the weight gradient's: 8 output by 2 input channels), each
input vector loaded once for the block. A block that would run past the last
channel repeats the last one and keeps one copy of its result; the input
gradient instead reads its weights from a copy whose channels are padded with
zeros to whole blocks (one address for a block's weights, not eight). Indices
known to be non-negative are read as unsigned (numba checks a signed one for a
negative value, which in the inner loops costs more than the load).
``fastmath={"contract"}``: a product and the sum it is added to are one fused
multiply-add where the CPU has it (as the C kernels' ``-ffp-contract=fast``),
nothing reassociated: each sum is taken in the loops' order, the order of the C
kernels, whose values these equal bit for bit on this project's machine.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np

LANES = 16
"""Samples per :data:`Vector` (the batch is whole vectors)."""
BLOCK = 8
"""Channels accumulated at once."""

Vector = tuple[Any, ...]
""":data:`LANES` float32 values, one a sample."""

_inline = numba.njit(inline="always", boundscheck=False, fastmath={"contract"})
_kernel = numba.njit(nogil=True, cache=True, boundscheck=False, fastmath={"contract"})


@_inline
def _fill(value: Any) -> Vector:
    v = np.float32(value)
    return (v, v, v, v, v, v, v, v, v, v, v, v, v, v, v, v)


@_inline
def _load(x: Any, p: int) -> Vector:
    """The :data:`LANES` values of ``x`` from ``p`` on (``p >= 0``: an unsigned
    index, which numba reads without the check for a negative one)."""
    q = np.uint64(p)
    u = np.uint64
    return (
        x[q], x[q + u(1)], x[q + u(2)], x[q + u(3)], x[q + u(4)], x[q + u(5)],
        x[q + u(6)], x[q + u(7)], x[q + u(8)], x[q + u(9)], x[q + u(10)],
        x[q + u(11)], x[q + u(12)], x[q + u(13)], x[q + u(14)], x[q + u(15)],
    )  # fmt: skip


@_inline
def _at(x: Any, p: int) -> Any:
    """``x[p]`` for ``p >= 0``, read as an unsigned index (no check for a
    negative one, which would cost more than the load in the inner loops)."""
    return x[np.uint64(p)]


@_inline
def _madd(a: Vector, s: Any, x: Any) -> Vector:
    """``a + s x`` for a number ``s`` and :data:`LANES` values ``x``."""
    return (
        a[0] + s * x[0], a[1] + s * x[1], a[2] + s * x[2], a[3] + s * x[3],
        a[4] + s * x[4], a[5] + s * x[5], a[6] + s * x[6], a[7] + s * x[7],
        a[8] + s * x[8], a[9] + s * x[9], a[10] + s * x[10], a[11] + s * x[11],
        a[12] + s * x[12], a[13] + s * x[13], a[14] + s * x[14], a[15] + s * x[15],
    )  # fmt: skip


@_inline
def _vmadd(a: Vector, g: Any, x: Any) -> Vector:
    """``a + g x``, lane by lane."""
    return (
        a[0] + g[0] * x[0], a[1] + g[1] * x[1], a[2] + g[2] * x[2],
        a[3] + g[3] * x[3], a[4] + g[4] * x[4], a[5] + g[5] * x[5],
        a[6] + g[6] * x[6], a[7] + g[7] * x[7], a[8] + g[8] * x[8],
        a[9] + g[9] * x[9], a[10] + g[10] * x[10], a[11] + g[11] * x[11],
        a[12] + g[12] * x[12], a[13] + g[13] * x[13], a[14] + g[14] * x[14],
        a[15] + g[15] * x[15],
    )  # fmt: skip


@_inline
def _add(a: Vector, x: Any) -> Vector:
    """``a + x``, lane by lane."""
    return (
        a[0] + x[0], a[1] + x[1], a[2] + x[2], a[3] + x[3],
        a[4] + x[4], a[5] + x[5], a[6] + x[6], a[7] + x[7],
        a[8] + x[8], a[9] + x[9], a[10] + x[10], a[11] + x[11],
        a[12] + x[12], a[13] + x[13], a[14] + x[14], a[15] + x[15],
    )  # fmt: skip


@_inline
def _store(out: Any, a: Vector) -> None:
    """Write ``a`` into the :data:`LANES` values ``out``."""
    out[0], out[1], out[2], out[3] = a[0], a[1], a[2], a[3]
    out[4], out[5], out[6], out[7] = a[4], a[5], a[6], a[7]
    out[8], out[9], out[10], out[11] = a[8], a[9], a[10], a[11]
    out[12], out[13], out[14], out[15] = a[12], a[13], a[14], a[15]


@_inline
def _sum(a: Any) -> Any:
    """The sum of :data:`LANES` values in memory: the halves added, then the
    halves of that, down to one (the order of a vector's horizontal sum)."""
    h = (
        a[0] + a[8], a[1] + a[9], a[2] + a[10], a[3] + a[11],
        a[4] + a[12], a[5] + a[13], a[6] + a[14], a[7] + a[15],
    )  # fmt: skip
    q = (h[0] + h[4], h[1] + h[5], h[2] + h[6], h[3] + h[7])
    return (q[0] + q[2]) + (q[1] + q[3])


@_inline
def _block(first: int, count: int) -> tuple[int, ...]:
    """The :data:`BLOCK` channels from ``first``, each past the last channel
    (``count - 1``) replaced by the last."""
    last = count - 1
    return (
        first, min(first + 1, last), min(first + 2, last), min(first + 3, last),
        min(first + 4, last), min(first + 5, last), min(first + 6, last),
        min(first + 7, last),
    )  # fmt: skip


@_inline
def _store_block(out: Any, p: int, step: int, kept: int, vectors: Any) -> None:
    """Write the first ``kept`` of a block's vectors, ``step`` values apart,
    from ``p`` on."""
    for k in range(BLOCK):
        if k < kept:
            at = p + k * step
            _store(out[at : at + LANES], vectors[k])


@_kernel
def conv_forward(
    x: Any, w: Any, bias: Any, out: Any, n: int, c: int, o: int, hi: int,
    wi: int, kh: int, kw: int, ph: int, pw: int, b: int,
) -> None:  # fmt: skip
    """``out = bias + sum of w x`` over the taps of each window that fall in
    the image and the input channels, added in the order row, column,
    channel."""
    x, w, bias, out = (
        x.reshape(x.size),
        w.reshape(w.size),
        bias.reshape(bias.size),
        out.reshape(out.size),
    )
    ho = hi + 2 * ph - kh + 1
    wo = wi + 2 * pw - kw + 1
    taps = kh * kw * c  # weights of one output channel
    for i in range(n):
        for y in range(ho):
            ky0 = max(ph - y, 0)
            ky1 = min(hi + ph - y, kh)
            for xx in range(wo):
                # one row of the window: columns kx0..kx1 x channels, contiguous
                j0 = max(pw - xx, 0) * c
                j1 = min(wi + pw - xx, kw) * c
                here = ((i * ho + y) * wo + xx) * o
                for v in range(0, b, LANES):
                    for ob in range(0, o, BLOCK):
                        k0, k1, k2, k3, k4, k5, k6, k7 = _block(ob, o)
                        a0 = _fill(bias[i * o + k0])
                        a1 = _fill(bias[i * o + k1])
                        a2 = _fill(bias[i * o + k2])
                        a3 = _fill(bias[i * o + k3])
                        a4 = _fill(bias[i * o + k4])
                        a5 = _fill(bias[i * o + k5])
                        a6 = _fill(bias[i * o + k6])
                        a7 = _fill(bias[i * o + k7])
                        for ky in range(ky0, ky1):
                            row = ((i * hi + y + ky - ph) * wi + xx - pw) * c
                            w0 = (i * o * kh + ky) * kw * c
                            for j in range(j0, j1):
                                xv = _load(x, (row + j) * b + v)
                                a0 = _madd(a0, _at(w, w0 + k0 * taps + j), xv)
                                a1 = _madd(a1, _at(w, w0 + k1 * taps + j), xv)
                                a2 = _madd(a2, _at(w, w0 + k2 * taps + j), xv)
                                a3 = _madd(a3, _at(w, w0 + k3 * taps + j), xv)
                                a4 = _madd(a4, _at(w, w0 + k4 * taps + j), xv)
                                a5 = _madd(a5, _at(w, w0 + k5 * taps + j), xv)
                                a6 = _madd(a6, _at(w, w0 + k6 * taps + j), xv)
                                a7 = _madd(a7, _at(w, w0 + k7 * taps + j), xv)
                        _store_block(
                            out,
                            (here + ob) * b + v,
                            b,
                            o - ob,
                            (a0, a1, a2, a3, a4, a5, a6, a7),
                        )


@_kernel
def conv_input_grad(
    g: Any, w: Any, gin: Any, n: int, c: int, o: int, hi: int, wi: int,
    kh: int, kw: int, ph: int, pw: int, b: int,
) -> None:  # fmt: skip
    """``gin`` = the gradient of the input: for each input position, the sum
    over the outputs whose window covers it (tap row, tap column, output
    channel, in that order) of the tap's weight times the output's gradient."""
    g, w, gin = g.reshape(g.size), w.reshape(w.size), gin.reshape(gin.size)
    ho = hi + 2 * ph - kh + 1
    wo = wi + 2 * pw - kw + 1
    # the weights with each tap's channels padded with zeros to whole blocks:
    # a block's weights are then :data:`BLOCK` consecutive values
    cp = -(-c // BLOCK) * BLOCK
    padded = np.zeros(n * o * kh * kw * cp, np.float32)
    for t in range(n * o * kh * kw):
        for cc in range(c):
            padded[t * cp + cc] = w[t * c + cc]
    for i in range(n):
        for y in range(hi):
            ky0 = max(y + ph - ho + 1, 0)
            ky1 = min(y + ph + 1, kh)
            for xx in range(wi):
                kx0 = max(xx + pw - wo + 1, 0)
                kx1 = min(xx + pw + 1, kw)
                here = ((i * hi + y) * wi + xx) * c
                for v in range(0, b, LANES):
                    for cb in range(0, c, BLOCK):
                        a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = _fill(0.0)
                        for ky in range(ky0, ky1):
                            for kx in range(kx0, kx1):
                                at = ((i * ho + y - ky + ph) * wo + xx - kx + pw) * o
                                for oo in range(o):
                                    gv = _load(g, (at + oo) * b + v)
                                    t = ((i * o + oo) * kh + ky) * kw + kx
                                    wb = padded[t * cp + cb : t * cp + cb + BLOCK]
                                    a0 = _madd(a0, wb[0], gv)
                                    a1 = _madd(a1, wb[1], gv)
                                    a2 = _madd(a2, wb[2], gv)
                                    a3 = _madd(a3, wb[3], gv)
                                    a4 = _madd(a4, wb[4], gv)
                                    a5 = _madd(a5, wb[5], gv)
                                    a6 = _madd(a6, wb[6], gv)
                                    a7 = _madd(a7, wb[7], gv)
                        _store_block(
                            gin,
                            (here + cb) * b + v,
                            b,
                            c - cb,
                            (a0, a1, a2, a3, a4, a5, a6, a7),
                        )


@_kernel
def conv_update_weights(
    g: Any, x: Any, w: Any, bias: Any, n: int, c: int, o: int, hi: int,
    wi: int, kh: int, kw: int, ph: int, pw: int, b: int,
) -> None:  # fmt: skip
    """``w -=`` the weight gradient: for each tap, output and input channel,
    the sum over output positions (row by row) and samples of ``g`` times the
    input the tap reads there, each lane summed on its own and the lanes then
    added (:func:`_sum`); ``bias -=`` the sum of ``g`` over positions and
    samples (when ``bias`` is not empty)."""
    g, x, w, bias = (
        g.reshape(g.size),
        x.reshape(x.size),
        w.reshape(w.size),
        bias.reshape(bias.size),
    )
    ho = hi + 2 * ph - kh + 1
    wo = wi + 2 * pw - kw + 1
    step = kh * kw * c  # from one output channel's weights to the next
    lanes = np.empty(2 * BLOCK * LANES, np.float32)  # a block's sums, to add
    for i in range(n):
        if bias.size:
            for oo in range(o):
                a = _fill(0.0)
                for q in range(ho * wo):
                    for v in range(0, b, LANES):
                        a = _add(a, _load(g, ((i * ho * wo + q) * o + oo) * b + v))
                _store(lanes, a)
                bias[i * o + oo] -= _sum(lanes)
        for ky in range(kh):
            y0 = max(ph - ky, 0)
            y1 = min(hi + ph - ky, ho)
            for kx in range(kw):
                x0 = max(pw - kx, 0)
                x1 = min(wi + pw - kx, wo)
                for ob in range(0, o, BLOCK):
                    k0, k1, k2, k3, k4, k5, k6, k7 = _block(ob, o)
                    for cc in range(0, c, 2):  # two input channels at once
                        pair = cc + 1 < c
                        a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = _fill(0.0)
                        b0 = b1 = b2 = b3 = b4 = b5 = b6 = b7 = a0
                        for y in range(y0, y1):
                            for xx in range(x0, x1):
                                gp = ((i * ho + y) * wo + xx) * o * b
                                at = (i * hi + y + ky - ph) * wi + xx + kx - pw
                                xp = (at * c + cc) * b
                                for v in range(0, b, LANES):
                                    xv = _load(x, xp + v)
                                    xw = _load(x, xp + b + v) if pair else xv
                                    p = gp + v
                                    gv = _load(g, p + k0 * b)
                                    a0 = _vmadd(a0, gv, xv)
                                    if pair:
                                        b0 = _vmadd(b0, gv, xw)
                                    gv = _load(g, p + k1 * b)
                                    a1 = _vmadd(a1, gv, xv)
                                    if pair:
                                        b1 = _vmadd(b1, gv, xw)
                                    gv = _load(g, p + k2 * b)
                                    a2 = _vmadd(a2, gv, xv)
                                    if pair:
                                        b2 = _vmadd(b2, gv, xw)
                                    gv = _load(g, p + k3 * b)
                                    a3 = _vmadd(a3, gv, xv)
                                    if pair:
                                        b3 = _vmadd(b3, gv, xw)
                                    gv = _load(g, p + k4 * b)
                                    a4 = _vmadd(a4, gv, xv)
                                    if pair:
                                        b4 = _vmadd(b4, gv, xw)
                                    gv = _load(g, p + k5 * b)
                                    a5 = _vmadd(a5, gv, xv)
                                    if pair:
                                        b5 = _vmadd(b5, gv, xw)
                                    gv = _load(g, p + k6 * b)
                                    a6 = _vmadd(a6, gv, xv)
                                    if pair:
                                        b6 = _vmadd(b6, gv, xw)
                                    gv = _load(g, p + k7 * b)
                                    a7 = _vmadd(a7, gv, xv)
                                    if pair:
                                        b7 = _vmadd(b7, gv, xw)
                        sums = (a0, a1, a2, a3, a4, a5, a6, a7)
                        for k in range(BLOCK):
                            _store(lanes[k * LANES :], sums[k])
                        sums = (b0, b1, b2, b3, b4, b5, b6, b7)
                        for k in range(BLOCK):
                            _store(lanes[(BLOCK + k) * LANES :], sums[k])
                        wp = (((i * o + ob) * kh + ky) * kw + kx) * c + cc
                        for k in range(min(BLOCK, o - ob)):
                            w[wp + k * step] -= _sum(lanes[k * LANES :])
                            if pair:
                                w[wp + k * step + 1] -= _sum(
                                    lanes[(BLOCK + k) * LANES :]
                                )


@_kernel
def pool_forward(
    x: Any, out: Any, places: Any, n: int, c: int, hi: int, wi: int, kh: int,
    kw: int, b: int,
) -> None:  # fmt: skip
    """Max pooling over ``kh x kw`` windows of the same stride, no padding:
    each window's first maximum in row-major order, a NaN taken as the
    maximum (as PyTorch's ``max_pool2d``); ``places`` holds its place in the
    window (a float)."""
    x, out, places = (
        x.reshape(x.size),
        out.reshape(out.size),
        places.reshape(places.size),
    )
    ho = hi // kh
    wo = wi // kw
    row = c * b  # one position's values
    for i in range(n):
        for y in range(ho):
            for xx in range(wo):
                win = ((i * hi + y * kh) * wi + xx * kw) * row
                at = ((i * ho + y) * wo + xx) * row
                m = out[at : at + row]
                k = places[at : at + row]
                first = x[win : win + row]
                for q in range(row):
                    m[q] = first[q]
                    k[q] = 0.0
                for a in range(kh):
                    for bb in range(kw):
                        if a == 0 and bb == 0:
                            continue
                        place = np.float32(a * kw + bb)
                        p = win + (a * wi + bb) * row
                        vals = x[p : p + row]
                        for q in range(row):
                            value = vals[q]
                            take = value > m[q] or value != value
                            m[q] = value if take else m[q]
                            k[q] = place if take else k[q]


@_kernel
def pool_backward(
    g: Any, places: Any, gin: Any, n: int, c: int, hi: int, wi: int, kh: int,
    kw: int, b: int,
) -> None:  # fmt: skip
    """The gradient of :func:`pool_forward`: each window's ``g`` where its
    maximum was, +0 elsewhere (and on rows and columns no window covers)."""
    g, places, gin = (
        g.reshape(g.size),
        places.reshape(places.size),
        gin.reshape(gin.size),
    )
    ho = hi // kh
    wo = wi // kw
    row = c * b
    zero = np.float32(0.0)
    for i in range(n):
        for y in range(hi):
            for xx in range(wi):
                if y >= ho * kh or xx >= wo * kw:
                    p = ((i * hi + y) * wi + xx) * row
                    gin[p : p + row] = zero
        for y in range(ho):
            for xx in range(wo):
                win = ((i * hi + y * kh) * wi + xx * kw) * row
                at = ((i * ho + y) * wo + xx) * row
                gv = g[at : at + row]
                k = places[at : at + row]
                for a in range(kh):
                    for bb in range(kw):
                        place = np.float32(a * kw + bb)
                        p = win + (a * wi + bb) * row
                        dst = gin[p : p + row]
                        for q in range(row):
                            # 0 + g: a -0 gradient lands as +0, as PyTorch
                            # adds it to zeros
                            dst[q] = zero + (gv[q] if k[q] == place else zero)
