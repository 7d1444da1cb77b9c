"""The central evaluation's forward pass, its convolutions on the compiled kernels.

The central evaluation (:class:`~flowerbed.sims.recorder.RunRecorder`) scores
the global model on the whole test set every round. For a model that is a
chain of 2-D convolutions, ReLUs, 2x2 max poolings, a flatten and linear layers
(LeNet: the layers of :mod:`flowerbed.sims.layers` the node layout runs, from
the model's one trace), the convolutions can run on the kernels that
batched training compiles when opted in (:mod:`flowerbed.sims.conv_kernels`,
``FLOWERBED_C_KERNELS=1``) instead of oneDNN: the test set is cut into chunks
of :data:`~flowerbed.sims.conv_kernels.LANES` images (the last one padded with
zeros), each chunk one of the kernels' "nodes" (``(chunks, H, W, C, 16)`` in
memory), with the weights repeated for every chunk. Measured here on digits'
360 test images (one thread): LeNet's two convolutions take ~0.04 and ~0.08 ms
on the kernels against ~0.2 and ~0.17 ms on oneDNN (which pads 1 and 6
channels to blocks of 16 and reorders to and from its blocked layout), the
whole forward pass ~0.45 against ~0.87 ms. The kernels sum in their own order:
the logits agree with oneDNN's within float tolerance
(``tests/test_kernel_inference.py``).
"""

from __future__ import annotations

import weakref

import torch
from flowerbed.clients.training import is_max_pool_2x2, max_pool_2x2
from flowerbed.sims.conv_kernels import (
    LANES,
    ConvKernels,
    ConvShape,
    eligible,
    kernels_for,
)
from flowerbed.sims.layers import (
    Conv,
    Flatten,
    Linear,
    MaxPool,
    Unsupported,
    layer_of,
    pool_before_relu,
    trace,
)
from torch import nn


def kernel_pass(model: nn.Module) -> KernelPass | None:
    """``model``'s forward pass for inference (no autograd), its convolutions
    on the compiled kernels; None when ``model``'s trace is not a chain of
    layers the node layout runs
    (:attr:`~flowerbed.sims.layers.Layer.NODE_LAYOUT`), with convolutions the
    kernels take (stride 1, dilation 1, one group, numeric zero padding),
    poolings of 2x2 windows of stride 2, a flatten of all dimensions after the
    first, and after it no image layer. Made once per model (cached); it reads
    the model's weights at every call.
    """
    if model not in _PASSES:
        chain = _chain(model)
        _PASSES[model] = None if chain is None else KernelPass(chain)
    return _PASSES[model]


_PASSES: weakref.WeakKeyDictionary[nn.Module, KernelPass | None] = (
    weakref.WeakKeyDictionary()
)
"""Each model's pass (None: not a chain :func:`kernel_pass` runs)."""


def _chain(model: nn.Module) -> list[nn.Module] | None:
    """The model's chain, each ReLU that feeds a max pooling moved after it
    (:func:`~flowerbed.sims.layers.pool_before_relu`: the same values, exactly,
    NaN included, from a quarter of the ReLUs); None if the pass does not run
    it."""
    try:
        chain = trace(model).chain
    except Unsupported:
        return None
    if chain is None:
        return None
    images = True
    for module, name in chain:
        if not _runs(module, name, images):
            return None
        images = images and not isinstance(module, nn.Flatten)
    return None if images else [module for module, _ in pool_before_relu(chain)]


def _runs(module: nn.Module, name: str, images: bool) -> bool:
    """Whether the pass runs ``module`` where images (or, after the flatten,
    rows of features) arrive."""
    layer = layer_of(module, name)  # in the table: the trace checked it
    if not layer.NODE_LAYOUT:
        return False
    if isinstance(layer, Conv):
        return images and isinstance(module, nn.Conv2d) and eligible(module, LANES)
    if isinstance(layer, MaxPool):
        return images and is_max_pool_2x2(module)
    if isinstance(layer, Flatten):
        return images
    if isinstance(layer, Linear):
        return not images
    return True  # ReLU, Identity


class KernelPass:
    """One model's pass (see :func:`kernel_pass`)."""

    def __init__(self, chain: list[nn.Module]) -> None:
        self.chain = chain

    def __call__(self, x: torch.Tensor) -> torch.Tensor | None:
        """The logits of images ``x`` ``(N, C, H, W)``; None for inputs it
        cannot run (not float32 images of the first convolution's channels)
        or without the kernels (not opted in, or no C compiler)."""
        if x.dim() != 4 or x.dtype != torch.float32 or len(x) == 0:
            return None
        kernels = _kernels(self.chain, *x.shape[1:])
        if kernels is None:
            return None
        n, c, height, width = x.shape
        chunks = -(-n // LANES)
        images = x.new_zeros(chunks * LANES, c, height, width)
        images[:n] = x
        # (chunks, H, W, C, LANES): each chunk one of the kernels' nodes
        h = images.view(chunks, LANES, c, height, width).permute(0, 3, 4, 2, 1)
        h = h.contiguous()
        convolutions = iter(kernels)
        with torch.no_grad():
            for module in self.chain:
                if isinstance(module, nn.Conv2d):
                    h = _convolve(next(convolutions), module, h)
                elif isinstance(module, nn.ReLU):  # on a tensor made here
                    h = torch.relu_(h)
                elif isinstance(module, nn.MaxPool2d):
                    h = max_pool_2x2(h, height_dim=1)  # (chunks, H, W, C, LANES)
                elif isinstance(module, nn.Flatten):  # each image's (C, H, W)
                    h = h.permute(0, 4, 3, 1, 2).reshape(chunks * LANES, -1)
                elif isinstance(module, nn.Linear):
                    h = module(h)
        return h[:n]


def _convolve(kernels: ConvKernels, module: nn.Conv2d, h: torch.Tensor) -> torch.Tensor:
    """``module`` on every chunk: its weights ``(O, C, KH, KW)`` as the
    kernels take them, ``(O, KH, KW, C)``, repeated for each chunk."""
    chunks = len(h)
    weight = module.weight.detach().permute(0, 2, 3, 1)
    weights = weight.expand(chunks, *weight.shape).contiguous()
    if module.bias is None:
        bias = h.new_zeros(chunks, module.out_channels)
    else:
        bias = module.bias.detach().expand(chunks, module.out_channels).contiguous()
    return kernels.forward(h, weights, bias)


def _kernels(
    chain: list[nn.Module], c: int, height: int, width: int
) -> list[ConvKernels] | None:
    """The kernels of the chain's convolutions for ``(c, height, width)``
    images, in order (built once per shape); None if one cannot be built."""
    out = []
    for module in chain:
        if isinstance(module, nn.Conv2d):
            if module.in_channels != c:
                return None
            shape = ConvShape.of(module, height, width, LANES)  # numeric: see _runs
            kernels = kernels_for(shape)
            if kernels is None:
                return None
            out.append(kernels)
            c, height, width = shape.o, shape.ho, shape.wo
        elif isinstance(module, nn.MaxPool2d):
            height, width = height // 2, width // 2
    return out
