"""The node layout's convolution and pooling kernels, compiled by numba.

Batched training keeps a LeNet-like chain's images in the node layout
``(nodes, H, W, C, batch)`` (:mod:`flowerbed.sims.layers`), the batch
innermost in vectors of :data:`~flowerbed.sims.conv_kernels.LANES` samples, and
runs its 2-D convolutions (forward, input gradient, weight gradient and SGD
update) and its max poolings over windows that do not overlap on kernels of
that layout. :class:`NumbaConvKernels` and :class:`NumbaPoolKernels` are those
kernels in Python compiled by numba (:mod:`flowerbed.sims._conv_numba`), with
the interface of the C kernels of :mod:`flowerbed.sims.conv_kernels`; the sizes
are arguments, so each kernel compiles once (at its first call, never at
import; ~12 s for the five here) and numba's on-disk cache (``cache=True``)
serves every later process (~0.4 s to load) and shape. The convolutions sum
in their own order (the same values as PyTorch's within float tolerance); the
pooling is PyTorch's bit for bit
(``tests/test_numba_kernels.py``).

:func:`kernels_for` and :func:`pool_kernels_for` choose: the C kernels when
opted in (``FLOWERBED_C_KERNELS=1``) and built, else these unless turned off
(``FLOWERBED_NUMBA_KERNELS=0``, :data:`ENABLE_ENV`) or numba is missing, else
None (the caller keeps PyTorch's oneDNN and its own layout).
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

import torch
from flowerbed.sims import conv_kernels
from flowerbed.sims.conv_kernels import (
    LANES,
    ConvKernels,
    ConvShape,
    PoolKernels,
    PoolShape,
    check,
    inputs,
    outputs,
)

ENABLE_ENV = "FLOWERBED_NUMBA_KERNELS"
"""Environment variable that turns the numba kernels off (``0``; on when unset)."""


def enabled() -> bool:
    """Whether :data:`ENABLE_ENV` leaves the numba kernels on (on when unset);
    ``ValueError`` for a value that is neither on nor off."""
    return conv_kernels.switch(ENABLE_ENV, True, "the numba kernels", "PyTorch")


@functools.lru_cache(maxsize=1)
def _compiled() -> tuple[ModuleType, Any] | None:
    """The numba kernels' module and numba's configuration (numba imported
    here, once); None without numba."""
    try:
        from numba.core import config
    except ImportError:
        return None
    from flowerbed.sims import _conv_numba

    return _conv_numba, config


def _call(kernel: str, *args: object) -> None:
    """Call ``kernel`` of the numba module. Its first call in a process
    compiles it (or loads it from numba's cache) with superword-level
    vectorisation (numba's ``NUMBA_SLP_VECTORIZE``, off by default, read when a
    function compiles): what keeps a kernel's vectors of samples in
    registers."""
    found = _compiled()
    assert found is not None
    module, config = found
    function = getattr(module, kernel)
    if kernel in _ready:
        function(*args)
        return
    before = config.SLP_VECTORIZE
    config.SLP_VECTORIZE = 1
    try:
        function(*args)
    finally:
        config.SLP_VECTORIZE = before
    _ready.add(kernel)


_ready: set[str] = set()
"""The kernels called (so compiled or loaded) in this process."""


def _flat(t: torch.Tensor) -> object:
    """A contiguous tensor's memory as a NumPy array (no copy)."""
    return t.numpy()


class NumbaConvKernels:
    """The three convolution kernels of one :class:`ConvShape`, compiled by
    numba; tensors as for :class:`~flowerbed.sims.conv_kernels.ConvKernels`."""

    def __init__(self, shape: ConvShape) -> None:
        self.shape = shape

    def _dims(self, n: int) -> tuple[int, ...]:
        s = self.shape
        return (n, s.c, s.o, s.hi, s.wi, s.kh, s.kw, s.ph, s.pw, s.batch)

    def forward(
        self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor
    ) -> torch.Tensor:
        s = self.shape
        n = x.shape[0]
        check(x, inputs(s, n), "input")
        check(w, s.weights(n), "weights")
        check(bias, (n, s.o), "bias")
        out = x.new_empty(outputs(s, n))
        _call(
            "conv_forward",
            _flat(x),
            _flat(w),
            _flat(bias),
            _flat(out),
            *self._dims(n),
        )
        return out

    def input_grad(self, g: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        s = self.shape
        n = g.shape[0]
        check(g, outputs(s, n), "gradient")
        check(w, s.weights(n), "weights")
        out = g.new_empty(inputs(s, n))
        _call("conv_input_grad", _flat(g), _flat(w), _flat(out), *self._dims(n))
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
        if bias is None:
            bias = g.new_empty(n, 0)
        else:
            check(bias, (n, s.o), "bias")
        _call(
            "conv_update_weights",
            _flat(g),
            _flat(x),
            _flat(w),
            _flat(bias),
            *self._dims(n),
        )


class NumbaPoolKernels:
    """Max pooling of one :class:`PoolShape` and its gradient, compiled by
    numba; as :class:`~flowerbed.sims.conv_kernels.PoolKernels` (PyTorch's
    values and gradients bit for bit)."""

    def __init__(self, shape: PoolShape) -> None:
        self.shape = shape

    def _dims(self, n: int) -> tuple[int, ...]:
        s = self.shape
        return (n, s.c, s.hi, s.wi, s.kh, s.kw, s.batch)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The pooled values and each one's place in its window."""
        s = self.shape
        n = x.shape[0]
        check(x, inputs(s, n), "input")
        out = x.new_empty(outputs(s, n))
        places = torch.empty_like(out)
        _call("pool_forward", _flat(x), _flat(out), _flat(places), *self._dims(n))
        return out, places

    def backward(self, g: torch.Tensor, places: torch.Tensor) -> torch.Tensor:
        s = self.shape
        n = g.shape[0]
        check(g, outputs(s, n), "gradient")
        check(places, outputs(s, n), "places")
        out = g.new_empty(inputs(s, n))
        _call("pool_backward", _flat(g), _flat(places), _flat(out), *self._dims(n))
        return out


def _whole(shape: ConvShape | PoolShape) -> bool:
    """Whether ``shape`` runs on the kernels: whole vectors of samples, an
    output of at least one position."""
    return (
        shape.batch > 0 and shape.batch % LANES == 0 and shape.ho >= 1 and shape.wo >= 1
    )


def kernels_for(shape: ConvShape) -> ConvKernels | NumbaConvKernels | None:
    """The convolution kernels of ``shape``: the C kernels when opted in and
    built, else numba's when :func:`enabled` and installed, else None."""
    if not _whole(shape):
        return None
    compiled = conv_kernels.kernels_for(shape)
    if compiled is not None:
        return compiled
    if not enabled() or _compiled() is None:
        return None
    return NumbaConvKernels(shape)


def pool_kernels_for(shape: PoolShape) -> PoolKernels | NumbaPoolKernels | None:
    """The max pooling of ``shape``, chosen as :func:`kernels_for` chooses."""
    if not _whole(shape):
        return None
    compiled = conv_kernels.pool_kernels_for(shape)
    if compiled is not None:
        return compiled
    if not enabled() or _compiled() is None:
        return None
    return NumbaPoolKernels(shape)
