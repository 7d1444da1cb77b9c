"""Small 2-D convolutions of many nodes at once in C (an opt-in), their shapes.

oneDNN pads each group of a grouped convolution to blocks of 16 channels: with
LeNet's 1 and 6 input channels a node (and 6 outputs for the first layer), most
of what it multiplies is padding, and each call pays its set-up. Measured here
for 10 LeNet nodes on 16 digits each (one thread, AVX-512): the first
convolution's forward pass 108 us and weight gradient 97 us, the second's
forward 106 us and input and weight gradients 339 us; these kernels take 16,
19, 33 and 39 + 64 us.

The kernels keep each node's activations as ``(H, W, C, batch)`` in memory, the
batch innermost (:data:`LANES` samples to a vector), so every multiply-add is one
weight times the same position of 16 samples: no padding multiplied (the loops
run over the window's taps that fall inside the image), no gathers, and as many
output channels (or, for the input gradient, input channels) as fit in
registers accumulated at once. The weight gradient sums its vectors' lanes at
the end and is subtracted from the weights at once (the learning rate is
already in the loss's gradient: :mod:`flowerbed.sims.grouped_sgd`). The sums
are taken in another order than oneDNN's: the same values within float
tolerance (``tests/test_conv_kernels.py``).

Max pooling over windows that do not overlap (LeNet's 2x2) runs here too, on
the same layout (:class:`PoolKernels`): PyTorch's kernel and its backward pass
(which zero-fills the whole input gradient first) took ~60 us a pooling in a
10-node LeNet step; the values and gradients are PyTorch's bit for bit.

They are off by default: the default is the numba kernels of
:mod:`flowerbed.sims.numba_kernels` (this layout, these sums, Python that
numba compiles; the shapes, checks and :func:`eligible` here are theirs too).
``FLOWERBED_C_KERNELS=1`` (:data:`ENABLE_ENV`) opts in; then the
C source below is compiled once per shape by the C compiler (``$CC``, else
``cc``) with ``-O3 -march=native`` into a cache directory
(``$FLOWERBED_KERNEL_CACHE``, else ``~/.cache/flowerbed/kernels``) created
private to the user (mode 0700), keyed by the source, the shape, the compiler
and this CPU; about 0.2 s each. Each build is recorded beside its library (its
SHA-256, the source's, the compiler, flags and shape, mode 600); a library is
loaded only when both files are this user's, private, and the library's hash
is the record's (else it is rebuilt), and builds of other sources, or beyond
:data:`MAX_BUILDS`, are removed (:func:`prune`). Not opted in, without a
compiler, or for other shapes (strides, dilations, groups, batches that are not
a multiple of :data:`LANES`), :func:`kernels_for` answers None and
:func:`flowerbed.sims.numba_kernels.kernels_for` takes the default. Nothing
is compiled before a kernel is asked for (importing this module, or collecting
the tests, builds nothing).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import logging
import os
import platform
import shutil
import stat
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

LANES = 16
"""Samples per vector: a batch must be a multiple of it."""

SOURCE = r"""
typedef float v16 __attribute__((vector_size(64), aligned(4)));
typedef int i16 __attribute__((vector_size(64)));
#define LB (16 * NB)
#ifdef __clang__
#define SHUF(a, ...) __builtin_shufflevector(a, a, __VA_ARGS__)
#else
#define SHUF(a, ...) __builtin_shuffle(a, (i16){__VA_ARGS__})
#endif

/* Activations: a node's [H][W][channels][LB] (samples innermost); weights
   w[node][O][KH][KW][C]. */

#ifdef KH
void conv_fwd(const float *restrict in, const float *restrict w,
              const float *restrict bias, float *restrict out, int n)
{
    for (int i = 0; i < n; i++) {
        const float *xi = in + (long)i * HI * WI * C * LB;
        const float *wi = w + (long)i * O * KH * KW * C;
        float *oi = out + (long)i * HO * WO * O * LB;
        for (int y = 0; y < HO; y++) {
            int ky0 = PH - y > 0 ? PH - y : 0;
            int ky1 = HI + PH - y < KH ? HI + PH - y : KH;
            for (int x = 0; x < WO; x++) {
                int kx0 = PW - x > 0 ? PW - x : 0;
                int kx1 = WI + PW - x < KW ? WI + PW - x : KW;
                for (int ob = 0; ob < O; ob += OBLK) {
                    v16 acc[OBLK][NB];
                    for (int o = 0; o < OBLK; o++)
                        for (int j = 0; j < NB; j++)
                            acc[o][j] = (v16){0} + bias[i * O + ob + o];
                    for (int ky = ky0; ky < ky1; ky++) {
                        for (int kx = kx0; kx < kx1; kx++) {
                            const float *xp =
                                xi + (long)((y + ky - PH) * WI + x + kx - PW) * C * LB;
                            const float *wp = wi + ((long)(ob * KH + ky) * KW + kx) * C;
                            for (int c = 0; c < C; c++) {
                                v16 v[NB];
                                for (int j = 0; j < NB; j++)
                                    v[j] = *(const v16 *)(xp + c * LB + 16 * j);
                                for (int o = 0; o < OBLK; o++) {
                                    float wv = wp[(long)o * KH * KW * C + c];
                                    for (int j = 0; j < NB; j++) acc[o][j] += wv * v[j];
                                }
                            }
                        }
                    }
                    float *op = oi + (long)(y * WO + x) * O * LB + ob * LB;
                    for (int o = 0; o < OBLK; o++)
                        for (int j = 0; j < NB; j++)
                            *(v16 *)(op + o * LB + 16 * j) = acc[o][j];
                }
            }
        }
    }
}

void conv_in_grad(const float *restrict g, const float *restrict w,
                  float *restrict gin, int n)
{
    for (int i = 0; i < n; i++) {
        const float *gi = g + (long)i * HO * WO * O * LB;
        const float *wi = w + (long)i * O * KH * KW * C;
        float *oi = gin + (long)i * HI * WI * C * LB;
        for (int y = 0; y < HI; y++) {
            int ky0 = y + PH - HO + 1 > 0 ? y + PH - HO + 1 : 0;
            int ky1 = y + PH + 1 < KH ? y + PH + 1 : KH;
            for (int x = 0; x < WI; x++) {
                int kx0 = x + PW - WO + 1 > 0 ? x + PW - WO + 1 : 0;
                int kx1 = x + PW + 1 < KW ? x + PW + 1 : KW;
                for (int cb = 0; cb < C; cb += CBLK) {
                    v16 acc[CBLK][NB];
                    for (int c = 0; c < CBLK; c++)
                        for (int j = 0; j < NB; j++) acc[c][j] = (v16){0};
                    for (int ky = ky0; ky < ky1; ky++) {
                        for (int kx = kx0; kx < kx1; kx++) {
                            const float *gp =
                                gi + (long)((y - ky + PH) * WO + x - kx + PW) * O * LB;
                            for (int o = 0; o < O; o++) {
                                v16 v[NB];
                                for (int j = 0; j < NB; j++)
                                    v[j] = *(const v16 *)(gp + o * LB + 16 * j);
                                const float *wp =
                                    wi + ((long)(o * KH + ky) * KW + kx) * C + cb;
                                for (int c = 0; c < CBLK; c++)
                                    for (int j = 0; j < NB; j++)
                                        acc[c][j] += wp[c] * v[j];
                            }
                        }
                    }
                    float *op = oi + (long)(y * WI + x) * C * LB + cb * LB;
                    for (int c = 0; c < CBLK; c++)
                        for (int j = 0; j < NB; j++)
                            *(v16 *)(op + c * LB + 16 * j) = acc[c][j];
                }
            }
        }
    }
}

static inline float lanes_sum(v16 a)
{
    a += SHUF(a, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    a += SHUF(a, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    a += SHUF(a, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    a += SHUF(a, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
    return a[0];
}

/* w -= the weight gradient: for each tap, the sum over output positions and
   samples of g times the input the tap reads there; bias (if not NULL) -= the
   sum of g over positions and samples. */
void conv_w_update(const float *restrict g, const float *restrict in,
                   float *restrict w, float *restrict bias, int n)
{
    for (int i = 0; i < n; i++) {
        const float *gi = g + (long)i * HO * WO * O * LB;
        const float *xi = in + (long)i * HI * WI * C * LB;
        float *wi = w + (long)i * O * KH * KW * C;
        if (bias) {
            for (int o = 0; o < O; o++) {
                v16 acc = (v16){0};
                for (int p = 0; p < HO * WO; p++)
                    for (int j = 0; j < NB; j++)
                        acc += *(const v16 *)(gi + ((long)p * O + o) * LB + 16 * j);
                bias[i * O + o] -= lanes_sum(acc);
            }
        }
        for (int ky = 0; ky < KH; ky++) {
            int y0 = PH - ky > 0 ? PH - ky : 0;
            int y1 = HI + PH - ky < HO ? HI + PH - ky : HO;
            for (int kx = 0; kx < KW; kx++) {
                int x0 = PW - kx > 0 ? PW - kx : 0;
                int x1 = WI + PW - kx < WO ? WI + PW - kx : WO;
                for (int ob = 0; ob < O; ob += OB2) {
                    for (int cb = 0; cb < C; cb += CB2) {
                        v16 acc[OB2][CB2];
                        for (int o = 0; o < OB2; o++)
                            for (int c = 0; c < CB2; c++) acc[o][c] = (v16){0};
                        for (int y = y0; y < y1; y++) {
                            for (int x = x0; x < x1; x++) {
                                const float *gp =
                                    gi + ((long)(y * WO + x) * O + ob) * LB;
                                const float *xp =
                                    xi + ((long)((y + ky - PH) * WI + x + kx - PW) * C
                                          + cb) * LB;
                                for (int j = 0; j < NB; j++) {
                                    v16 xv[CB2];
                                    for (int c = 0; c < CB2; c++)
                                        xv[c] = *(const v16 *)(xp + c * LB + 16 * j);
                                    for (int o = 0; o < OB2; o++) {
                                        v16 gv = *(const v16 *)(gp + o * LB + 16 * j);
                                        for (int c = 0; c < CB2; c++)
                                            acc[o][c] += gv * xv[c];
                                    }
                                }
                            }
                        }
                        for (int o = 0; o < OB2; o++) {
                            float *wp = wi + ((long)((ob + o) * KH + ky) * KW + kx) * C;
                            for (int c = 0; c < CB2; c++)
                                wp[cb + c] -= lanes_sum(acc[o][c]);
                        }
                    }
                }
            }
        }
    }
}
#endif

#ifdef PKH
/* Max pooling over PKH x PKW windows of the same stride, no padding: each
   window's first maximum in row-major order, a NaN taken as the maximum (as
   PyTorch's max_pool2d); idx holds its place in the window (a float). */
void pool_fwd(const float *restrict in, float *restrict out, float *restrict idx,
              int n)
{
    for (int i = 0; i < n; i++) {
        for (int y = 0; y < PHO; y++) {
            for (int x = 0; x < PWO; x++) {
                const float *win =
                    in + (((long)i * HI + y * PKH) * WI + x * PKW) * C * LB;
                long o = (((long)i * PHO + y) * PWO + x) * C * LB;
                for (int q = 0; q < C * NB; q++) {
                    v16 m = *(const v16 *)(win + 16 * q);
                    v16 k = (v16){0};
                    for (int a = 0; a < PKH; a++) {
                        for (int b = 0; b < PKW; b++) {
                            if (a == 0 && b == 0) continue;
                            v16 v = *(const v16 *)(win + ((long)a * WI + b) * C * LB
                                                   + 16 * q);
                            i16 take = (v > m) | (v != v);
                            v16 place = (v16){0} + (float)(a * PKW + b);
                            m = (v16)(((i16)v & take) | ((i16)m & ~take));
                            k = (v16)(((i16)place & take) | ((i16)k & ~take));
                        }
                    }
                    *(v16 *)(out + o + 16 * q) = m;
                    *(v16 *)(idx + o + 16 * q) = k;
                }
            }
        }
    }
}

/* The gradient of pool_fwd: each window's g where its maximum was, +0 elsewhere
   (and on rows and columns no window covers). */
void pool_bwd(const float *restrict g, const float *restrict idx, float *restrict gin,
              int n)
{
    for (int i = 0; i < n; i++) {
        for (int y = 0; y < HI; y++)
            for (int x = 0; x < WI; x++)
                if (y >= PHO * PKH || x >= PWO * PKW)
                    for (int q = 0; q < C * LB; q++)
                        gin[(((long)i * HI + y) * WI + x) * C * LB + q] = 0.f;
        for (int y = 0; y < PHO; y++) {
            for (int x = 0; x < PWO; x++) {
                float *win = gin + (((long)i * HI + y * PKH) * WI + x * PKW) * C * LB;
                long o = (((long)i * PHO + y) * PWO + x) * C * LB;
                for (int q = 0; q < C * NB; q++) {
                    v16 gv = *(const v16 *)(g + o + 16 * q);
                    v16 k = *(const v16 *)(idx + o + 16 * q);
                    for (int a = 0; a < PKH; a++) {
                        for (int b = 0; b < PKW; b++) {
                            i16 hit = k == ((v16){0} + (float)(a * PKW + b));
                            /* 0 + g: a -0 gradient lands as +0, as PyTorch adds
                               it to zeros */
                            *(v16 *)(win + ((long)a * WI + b) * C * LB + 16 * q) =
                                (v16){0} + (v16)((i16)gv & hit);
                        }
                    }
                }
            }
        }
    }
}
#endif
"""

FLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-shared", "-fPIC")
"""Compiler flags: FMA contraction, no reassociation (each build sums in one
fixed order)."""


@dataclass(frozen=True)
class ConvShape:
    """One node's convolution: channels, image and kernel sizes, padding, batch."""

    c: int
    o: int
    hi: int
    wi: int
    kh: int
    kw: int
    ph: int
    pw: int
    batch: int

    @classmethod
    def of(
        cls, module: torch.nn.Conv2d, height: int, width: int, batch: int
    ) -> ConvShape:
        """``module``'s convolution of ``(height, width)`` images in batches of
        ``batch`` (its padding must be numbers: see :func:`eligible`)."""
        if isinstance(module.padding, str):
            raise ValueError(f"padding {module.padding!r}: the kernels need numbers")
        kh, kw = module.kernel_size
        ph, pw = module.padding
        c, o = module.in_channels, module.out_channels
        return cls(c, o, height, width, kh, kw, ph, pw, batch)

    @property
    def ho(self) -> int:
        return self.hi + 2 * self.ph - self.kh + 1

    @property
    def wo(self) -> int:
        return self.wi + 2 * self.pw - self.kw + 1

    def weights(self, n: int) -> tuple[int, ...]:
        """The weights' layout on ``n`` nodes."""
        return (n, self.o, self.kh, self.kw, self.c)

    def defines(self) -> dict[str, int]:
        nb = self.batch // LANES
        cb2 = _divisor_up_to(self.c, 8)
        return {
            "C": self.c,
            "O": self.o,
            "HI": self.hi,
            "WI": self.wi,
            "HO": self.ho,
            "WO": self.wo,
            "KH": self.kh,
            "KW": self.kw,
            "PH": self.ph,
            "PW": self.pw,
            "NB": nb,
            "OBLK": _divisor_up_to(self.o, max(1, 16 // nb)),
            "CBLK": _divisor_up_to(self.c, max(1, 16 // nb)),
            "CB2": cb2,
            "OB2": _divisor_up_to(self.o, max(1, 24 // cb2)),
        }


def _divisor_up_to(value: int, limit: int) -> int:
    """The largest divisor of ``value`` that is at most ``limit``."""
    return max(d for d in range(1, min(value, limit) + 1) if value % d == 0)


class ConvKernels:
    """The three kernels of one :class:`ConvShape` (see the module docstring).

    Tensors are float32 and contiguous: activations ``(nodes, H, W, channels,
    batch)``, weights ``(nodes, O, KH, KW, C)``, bias ``(nodes, O)``.
    """

    def __init__(self, shape: ConvShape, library: ctypes.CDLL) -> None:
        self.shape = shape
        self._lib = library  # kept alive with its functions
        p = ctypes.c_void_p
        self._fwd = library.conv_fwd
        self._fwd.argtypes = [p, p, p, p, ctypes.c_int]
        self._in_grad = library.conv_in_grad
        self._in_grad.argtypes = [p, p, p, ctypes.c_int]
        self._w_update = library.conv_w_update
        self._w_update.argtypes = [p, p, p, p, ctypes.c_int]

    def forward(
        self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor
    ) -> torch.Tensor:
        s = self.shape
        n = x.shape[0]
        check(x, inputs(s, n), "input")
        check(w, s.weights(n), "weights")
        check(bias, (n, s.o), "bias")
        out = x.new_empty(outputs(s, n))
        self._fwd(x.data_ptr(), w.data_ptr(), bias.data_ptr(), out.data_ptr(), n)
        return out

    def input_grad(self, g: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        s = self.shape
        n = g.shape[0]
        check(g, outputs(s, n), "gradient")
        check(w, s.weights(n), "weights")
        out = g.new_empty(inputs(s, n))
        self._in_grad(g.data_ptr(), w.data_ptr(), out.data_ptr(), n)
        return out

    def update_weights(
        self,
        g: torch.Tensor,
        x: torch.Tensor,
        w: torch.Tensor,
        bias: torch.Tensor | None = None,
    ) -> None:
        """``w -= `` the weight gradient of ``g`` for input ``x`` (and ``bias
        -= `` its gradient, the sum of ``g`` over positions and samples), in
        place."""
        s = self.shape
        n = g.shape[0]
        check(g, outputs(s, n), "gradient")
        check(x, inputs(s, n), "input")
        check(w, s.weights(n), "weights")
        if bias is not None:
            check(bias, (n, s.o), "bias")
        self._w_update(
            g.data_ptr(),
            x.data_ptr(),
            w.data_ptr(),
            None if bias is None else bias.data_ptr(),
            n,
        )


@dataclass(frozen=True)
class PoolShape:
    """One node's max pooling: channels, image size, window (= stride), batch."""

    c: int
    hi: int
    wi: int
    kh: int
    kw: int
    batch: int

    @property
    def ho(self) -> int:
        return self.hi // self.kh

    @property
    def wo(self) -> int:
        return self.wi // self.kw

    @property
    def o(self) -> int:
        """Output channels: the input's."""
        return self.c

    def defines(self) -> dict[str, int]:
        return {
            "C": self.c,
            "HI": self.hi,
            "WI": self.wi,
            "PKH": self.kh,
            "PKW": self.kw,
            "PHO": self.ho,
            "PWO": self.wo,
            "NB": self.batch // LANES,
        }


class PoolKernels:
    """Max pooling of one :class:`PoolShape` and its gradient, on ``(nodes, H,
    W, C, batch)`` activations: the values and gradients of PyTorch's
    ``max_pool2d`` bit for bit (the same first maximum, NaN taken as the
    maximum; ``tests/test_conv_kernels.py``). The window's argmax is kept as a
    float tensor of the output's shape."""

    def __init__(self, shape: PoolShape, library: ctypes.CDLL) -> None:
        self.shape = shape
        self._lib = library
        p = ctypes.c_void_p
        self._fwd = library.pool_fwd
        self._fwd.argtypes = [p, p, p, ctypes.c_int]
        self._bwd = library.pool_bwd
        self._bwd.argtypes = [p, p, p, ctypes.c_int]

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The pooled values and each one's place in its window."""
        s = self.shape
        n = x.shape[0]
        check(x, inputs(s, n), "input")
        out = x.new_empty(outputs(s, n))
        places = torch.empty_like(out)
        self._fwd(x.data_ptr(), out.data_ptr(), places.data_ptr(), n)
        return out, places

    def backward(self, g: torch.Tensor, places: torch.Tensor) -> torch.Tensor:
        s = self.shape
        n = g.shape[0]
        check(g, outputs(s, n), "gradient")
        check(places, outputs(s, n), "places")
        out = g.new_empty(inputs(s, n))
        self._bwd(g.data_ptr(), places.data_ptr(), out.data_ptr(), n)
        return out


def inputs(s: ConvShape | PoolShape, n: int) -> tuple[int, ...]:
    """A kernel's input layout on ``n`` nodes."""
    return (n, s.hi, s.wi, s.c, s.batch)


def outputs(s: ConvShape | PoolShape, n: int) -> tuple[int, ...]:
    """A kernel's output layout on ``n`` nodes."""
    return (n, s.ho, s.wo, s.o, s.batch)


def check(t: torch.Tensor, shape: tuple[int, ...], what: str) -> None:
    if t.dtype != torch.float32 or not t.is_contiguous() or tuple(t.shape) != shape:
        raise ValueError(
            f"{what}: need a contiguous float32 tensor of shape {shape}, "
            f"got {t.dtype} {tuple(t.shape)} (contiguous: {t.is_contiguous()})"
        )


def eligible(module: torch.nn.Module, batch: int) -> bool:
    """True when :func:`kernels_for` handles ``module`` at this batch size: a
    ``Conv2d`` of stride 1, dilation 1, one group, zero padding given as
    numbers, and a batch that is a positive multiple of :data:`LANES`."""
    return (
        type(module) is torch.nn.Conv2d
        and module.stride == (1, 1)
        and module.dilation == (1, 1)
        and module.groups == 1
        and module.padding_mode == "zeros"
        and not isinstance(module.padding, str)
        and batch > 0
        and batch % LANES == 0
    )


def pool_eligible(module: torch.nn.Module, batch: int) -> bool:
    """True when :func:`pool_kernels_for` handles ``module`` at this batch:
    a ``MaxPool2d`` whose stride is its window, without padding, dilation or
    ``ceil_mode``."""
    if type(module) is not torch.nn.MaxPool2d or module.ceil_mode:
        return False
    kernel = pair(module.kernel_size)
    return (
        pair(module.stride or module.kernel_size) == kernel
        and pair(module.padding) == (0, 0)
        and pair(module.dilation) == (1, 1)
        and batch > 0
        and batch % LANES == 0
    )


def pair(value: int | tuple[int, ...]) -> tuple[int, int]:
    """A layer's size argument (one number, or one per dimension) as two."""
    if isinstance(value, int):
        return value, value
    return int(value[0]), int(value[-1])


def kernels_for(shape: ConvShape) -> ConvKernels | None:
    """The compiled kernels of ``shape``; None unless :func:`enabled`, or
    without a working compiler or a cache directory that passes the checks."""
    if shape.batch <= 0 or shape.batch % LANES or shape.ho < 1 or shape.wo < 1:
        return None
    if not enabled():
        return None
    kernels = _load(shape)
    assert kernels is None or isinstance(kernels, ConvKernels)
    return kernels


def pool_kernels_for(shape: PoolShape) -> PoolKernels | None:
    """The compiled max pooling of ``shape``; None as for :func:`kernels_for`."""
    if shape.batch <= 0 or shape.batch % LANES or shape.ho < 1 or shape.wo < 1:
        return None
    if not enabled():
        return None
    kernels = _load(shape)
    assert kernels is None or isinstance(kernels, PoolKernels)
    return kernels


ENABLE_ENV = "FLOWERBED_C_KERNELS"
"""Environment variable that opts in to the compiled kernels (``1``)."""
CACHE_ENV = "FLOWERBED_KERNEL_CACHE"
"""Environment variable that moves the cache directory."""
ON = ("1", "true", "yes", "on")
OFF = ("", "0", "false", "no", "off")
MAX_BUILDS = 64
"""Builds of the current source kept in the cache; the least recently built
beyond it are removed (a model's shapes at one batch size take 2-4)."""


def switch(name: str, default: bool, on_means: str, off_means: str) -> bool:
    """Whether the environment variable ``name`` is on (:data:`ON`) or off
    (:data:`OFF`); ``default`` when unset or empty. ``ValueError`` naming the
    valid values, and what each side means, for anything else."""
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return default
    if value in ON:
        return True
    if value in OFF:
        return False
    on_text = f"the default: {on_means}" if default else on_means
    off_text = off_means if default else f"the default: {off_means}"
    raise ValueError(
        f"${name}={value!r}: valid values are {', '.join(ON)} ({on_text}) or "
        f"{', '.join(repr(v) for v in OFF if v)} ({off_text})"
    )


def enabled() -> bool:
    """Whether :data:`ENABLE_ENV` opts in to the compiled kernels (off when
    unset); ``ValueError`` for a value that is neither on nor off."""
    return switch(ENABLE_ENV, False, "compile the C kernels", "PyTorch")


@functools.lru_cache(maxsize=64)
def _load(shape: ConvShape | PoolShape) -> ConvKernels | PoolKernels | None:
    path = _compiled(shape.defines())
    if path is None:
        return None
    try:
        library = ctypes.CDLL(str(path))
    except OSError as err:
        log.warning("cannot load the kernels %s (%s): using the default", path, err)
        return None
    if isinstance(shape, PoolShape):
        return PoolKernels(shape, library)
    return ConvKernels(shape, library)


def cache_dir() -> Path:
    """Where compiled kernels are kept: :data:`CACHE_ENV`, else
    ``~/.cache/flowerbed/kernels``."""
    where = os.environ.get(CACHE_ENV)
    if where:
        return Path(where)
    return Path.home() / ".cache" / "flowerbed" / "kernels"


def private_cache() -> Path | None:
    """:func:`cache_dir`, created private to this user (mode 0700); None (and a
    warning saying what to fix) when it is not a directory this user owns, or
    others may write to it. A directory of this user's that others may only
    read is made private."""
    where = cache_dir()
    try:
        where.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.lstat(where)
    except OSError as err:
        log.warning("kernel cache %s: %s; using the default kernels", where, err)
        return None
    problem = None
    if not stat.S_ISDIR(st.st_mode):
        problem = "not a directory (a symbolic link or a file)"
    elif st.st_uid != os.getuid():
        problem = f"owned by uid {st.st_uid}, not by this user ({os.getuid()})"
    elif st.st_mode & 0o022:
        problem = f"others may write to it (mode {stat.S_IMODE(st.st_mode):o})"
    if problem:
        log.warning(
            "kernel cache %s is %s: not using the C kernels (using the default); "
            "remove it, or set $%s to a directory of your own",
            where,
            problem,
            CACHE_ENV,
        )
        return None
    if st.st_mode & 0o077:
        os.chmod(where, 0o700)
    return where


def _unsafe_file(path: Path) -> str | None:
    """Why ``path`` must not be loaded or trusted (None: a regular file of this
    user's that no one else may read or write)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return "missing"
    except OSError as err:
        return str(err)
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    if st.st_uid != os.getuid():
        return f"owned by uid {st.st_uid}, not by this user"
    if st.st_mode & 0o077:
        return f"mode {stat.S_IMODE(st.st_mode):o}, not private (600)"
    return None


def _source_hash() -> str:
    return hashlib.sha256(SOURCE.encode()).hexdigest()


def _verified(library: Path) -> str | None:
    """Why the build at ``library`` fails its checks (None: it passes): the
    library and its build record (``.json`` beside it) are private files of
    this user's, the record is of today's source, and the library's SHA-256 is
    the one the record holds."""
    record_path = library.with_suffix(".json")
    for path in (library, record_path):
        problem = _unsafe_file(path)
        if problem:
            return f"{path.name}: {problem}"
    try:
        record = json.loads(record_path.read_text())
        digest = hashlib.sha256(library.read_bytes()).hexdigest()
    except (OSError, ValueError) as err:
        return f"cannot read it ({err})"
    if not isinstance(record, dict) or record.get("source_sha256") != _source_hash():
        return "its record is of another source"
    if record.get("sha256") != digest:
        return "its content does not match the SHA-256 of its build record"
    return None


@functools.lru_cache(maxsize=1)
def _compiler() -> tuple[str, str] | None:
    """The C compiler and its version line, or None."""
    cc = os.environ.get("CC", "cc")
    found = shutil.which(cc)
    if found is None:
        return None
    try:
        version = subprocess.run(
            [found, "--version"], capture_output=True, text=True, timeout=30, check=True
        ).stdout.splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return None
    return found, version


@functools.lru_cache(maxsize=1)
def _cpu() -> str:
    """This CPU's model and features (a build for another CPU may not run here)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [
        line
        for line in text.splitlines()
        if line.startswith(("model name", "flags", "Features", "CPU part"))
    ]
    return "\n".join(sorted(set(keep)))


def _compiled(defines: dict[str, int]) -> Path | None:
    """The built library for ``defines``: from the cache when it passes
    :func:`_verified`, else compiled (with ``-march=native``, else, for a
    compiler that refuses it, without)."""
    compiler = _compiler()
    if compiler is None:
        return None
    where = private_cache()
    if where is None:
        return None
    cc, version = compiler
    args = [f"-D{k}={v}" for k, v in sorted(defines.items())]
    failure: object = None
    for flags in (FLAGS, tuple(f for f in FLAGS if f != "-march=native")):
        key = hashlib.sha256(
            "\0".join([SOURCE, version, _cpu(), *flags, *args]).encode()
        ).hexdigest()[:24]
        target = where / f"conv_{key}.so"
        if target.exists() or target.with_suffix(".json").exists():
            problem = _verified(target)
            if problem is None:
                return target
            log.warning(
                "kernel build %s failed its checks (%s): rebuilding", target, problem
            )
        try:
            _build(
                cc,
                [*flags, *args],
                target,
                {"compiler": version, "flags": list(flags), "defines": defines},
            )
        except subprocess.CalledProcessError as err:
            failure = err.stderr.strip() or err
            continue
        except (OSError, subprocess.SubprocessError) as err:
            failure = err
            break
        log.debug("built convolution kernels %s (%s)", target.name, " ".join(args))
        prune(where, keep=target)
        return target
    log.warning("cannot build the C kernels (%s): using the default", failure)
    return None


def _build(cc: str, args: list[str], target: Path, about: dict[str, object]) -> None:
    """Compile into a private temporary directory beside ``target``, then move
    the library and its build record (its SHA-256, the source's, ``about``)
    into place, each private to this user (mode 600)."""
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:  # mode 700
        source = Path(tmp) / "conv.c"
        source.write_text(SOURCE)
        built = Path(tmp) / "conv.so"
        subprocess.run(
            [cc, *args, "-o", str(built), str(source)],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        os.chmod(built, 0o600)
        record = Path(tmp) / "conv.json"
        fd = os.open(record, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as out:
            json.dump(
                {
                    "library": target.name,
                    "sha256": hashlib.sha256(built.read_bytes()).hexdigest(),
                    "source_sha256": _source_hash(),
                    "built": time.time(),
                    **about,
                },
                out,
            )
        # atomic each: a concurrent build wins or loses whole; a reader between
        # the two sees a record that does not match and rebuilds
        os.replace(built, target)
        os.replace(record, target.with_suffix(".json"))


STRAY_AGE_S = 60.0
"""A library without its record (or a record without its library) younger than
this may be another process's build between its two moves: left alone."""


def _stray(path: Path) -> bool:
    """Whether ``path`` is older than :data:`STRAY_AGE_S` (gone: False)."""
    try:
        return time.time() - os.lstat(path).st_mtime > STRAY_AGE_S
    except OSError:
        return False


def prune(where: Path, keep: Path | None = None) -> list[Path]:
    """Remove from the cache ``where`` the builds of other sources (older
    flowerbed versions), libraries without a readable record and records
    without a library (older than :data:`STRAY_AGE_S`), then the least recently
    built beyond :data:`MAX_BUILDS`; never ``keep``. Returns what was removed."""
    builds: list[tuple[float, Path]] = []
    doomed: list[Path] = []
    for library in where.glob("conv_*.so"):
        if library == keep:
            continue
        try:
            record = json.loads(library.with_suffix(".json").read_text())
        except (OSError, ValueError):
            if _stray(library):
                doomed.append(library)
            continue
        if (
            not isinstance(record, dict)
            or record.get("source_sha256") != _source_hash()
        ):
            doomed.append(library)
        else:
            builds.append((float(record.get("built", 0.0)), library))
    doomed += [
        r
        for r in where.glob("conv_*.json")
        if not r.with_suffix(".so").exists() and _stray(r)
    ]
    builds.sort(reverse=True)  # newest first
    room = MAX_BUILDS - 1 if keep is not None else MAX_BUILDS
    doomed += [library for _, library in builds[max(0, room) :]]
    removed = []
    for path in doomed:
        for each in {path, path.with_suffix(".json"), path.with_suffix(".so")}:
            try:
                each.unlink()
                removed.append(each)
            except FileNotFoundError:
                pass
            except OSError as err:
                log.warning("cannot remove the old kernel build %s: %s", each, err)
    return removed
