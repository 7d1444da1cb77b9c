"""The central evaluation's forward pass, its convolutions on the compiled kernels.

The central evaluation (:class:`~flowerbed.sims.recorder.RunRecorder`) scores
the global model on the whole test set every round. For a model that is a
chain of 2-D convolutions, ReLUs, 2x2 max poolings, a flatten and linear layers
(LeNet: :data:`CHAIN_LAYERS`), the convolutions can run on the kernels that
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
from flowerbed.clients.training import is_max_pool_2x2
from flowerbed.sims.conv_kernels import (
    LANES,
    ConvKernels,
    ConvShape,
    eligible,
    kernels_for,
)
from flowerbed.sims.grouped_sgd import pool_before_relu
from torch import fx, nn

CHAIN_LAYERS = (nn.Conv2d, nn.ReLU, nn.MaxPool2d, nn.Flatten, nn.Linear, nn.Identity)
"""What the chain may hold (convolutions and poolings as :func:`kernel_pass`
says; a flatten of all dimensions after the first; after it, no image layer)."""


def kernel_pass(model: nn.Module) -> KernelPass | None:
    """``model``'s forward pass for inference (no autograd), its convolutions
    on the compiled kernels; None when ``model`` is not a chain of
    :data:`CHAIN_LAYERS` whose convolutions the kernels take (stride 1,
    dilation 1, one group, numeric zero padding) and whose poolings are 2x2
    windows of stride 2. Made once per model (cached); it reads the model's
    weights at every call.
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
    try:
        traced = fx.symbolic_trace(model)
    except Exception:  # data-dependent control flow, custom tracing
        return None
    chain: list[nn.Module] = []
    previous = None
    images = True
    for node in traced.graph.nodes:
        if node.op == "placeholder" and previous is None:
            previous = node
        elif node.op == "call_module" and node.args == (previous,) and not node.kwargs:
            module = traced.get_submodule(str(node.target))
            if not _runs(module, images):
                return None
            images = images and not isinstance(module, nn.Flatten)
            chain.append(module)
            previous = node
        elif node.op == "output" and node.args == (previous,):
            return _pool_before_relu(chain) if not images and chain else None
        else:
            return None
    return None


def _pool_before_relu(chain: list[nn.Module]) -> list[nn.Module]:
    """The chain with each ReLU that feeds a max pooling moved after it, as
    :func:`~flowerbed.sims.grouped_sgd.pool_before_relu` moves it: the same
    values (exactly, NaN included) from a quarter of the ReLUs."""
    return [module for module, _ in pool_before_relu([(m, "") for m in chain])]


def _runs(module: nn.Module, images: bool) -> bool:
    """Whether the pass runs ``module`` where images (or, after the flatten,
    rows of features) arrive."""
    if type(module) not in CHAIN_LAYERS:
        return False
    if isinstance(module, nn.Conv2d):
        return images and eligible(module, LANES)
    if isinstance(module, nn.MaxPool2d):
        return images and is_max_pool_2x2(module)
    if isinstance(module, nn.Flatten):
        return images and (module.start_dim, module.end_dim) == (1, -1)
    if isinstance(module, nn.Linear):
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
                    h = _max_pool_2x2(h)
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


def _max_pool_2x2(h: torch.Tensor) -> torch.Tensor:
    """2x2 max pooling of stride 2 of ``(chunks, H, W, C, LANES)`` images, as
    :func:`~flowerbed.clients.training.max_pool_2x2`: two elementwise maxima
    (exact), a trailing odd row or column dropped."""
    height, width = h.shape[1] // 2 * 2, h.shape[2] // 2 * 2
    rows = torch.maximum(h[:, 0:height:2, :width], h[:, 1:height:2, :width])
    return torch.maximum(rows[:, :, 0::2], rows[:, :, 1::2])


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
