"""The central evaluation's forward pass on the node layout's kernels.

The central evaluation (:class:`~flowerbed.sims.recorder.RunRecorder`) scores
the global model on the whole test set every round. For a model that batched
training runs on the node layout's kernels (by default numba's,
:mod:`flowerbed.sims.numba_kernels`, or the C ones opted in; LeNet: a chain
of 2-D convolutions, ReLUs, max poolings, a flatten and linear layers), the
evaluation runs the same layer objects (those of
:class:`~flowerbed.sims.grouped_sgd.GroupedSGD`) instead of oneDNN: the test
set is cut into chunks of :data:`~flowerbed.sims.conv_kernels.LANES` images
(the last one padded with zeros), each chunk one of the kernels' "nodes"
(``(chunks, H, W, C, 16)`` in memory), with the weights repeated for every
chunk. Measured here on digits'
360 test images (one thread): LeNet's two convolutions take ~0.04 and ~0.08 ms
on the C kernels against ~0.2 and ~0.17 ms on oneDNN (which pads 1 and 6
channels to blocks of 16 and reorders to and from its blocked layout), the
whole forward pass ~0.45 against ~0.87 ms. The kernels sum in their own order:
the logits agree with oneDNN's within float tolerance
(``tests/test_kernel_inference.py``).
"""

from __future__ import annotations

import weakref

import torch
from flowerbed.sims.conv_kernels import LANES
from flowerbed.sims.grouped import grouped_forward
from flowerbed.sims.grouped_sgd import GroupedSGD, grouped_sgd
from flowerbed.sims.layers import Weighted
from torch import nn


def kernel_pass(model: nn.Module) -> KernelPass | None:
    """``model``'s forward pass for inference (no autograd), its convolutions
    on the node layout's kernels; None when batched training would not run
    ``model`` on them: its trace is not a chain of layers with a written-out
    backward (:class:`~flowerbed.sims.grouped_sgd.GroupedSGD`) whose images
    the node layout takes (:attr:`~flowerbed.sims.layers.Layer.NODE_LAYOUT`:
    2-D convolutions of stride 1, dilation 1, one group and numeric zero
    padding, max pooling, ReLU, identity, then a flatten and, after it, no
    image layer). Made once per model (cached); it reads the model's weights at
    every call.
    """
    if model not in _PASSES:
        step = grouped_sgd(grouped_forward(model))
        if step is None or not step.node_layout:
            _PASSES[model] = None
        else:
            _PASSES[model] = KernelPass(model, step)
    return _PASSES[model]


_PASSES: weakref.WeakKeyDictionary[nn.Module, KernelPass | None] = (
    weakref.WeakKeyDictionary()
)
"""Each model's pass (None: not a chain :func:`kernel_pass` runs)."""


class KernelPass:
    """One model's pass (see :func:`kernel_pass`): in the node layout, the layers of
    its written-out step, the test set's chunks as the nodes."""

    def __init__(self, model: nn.Module, step: GroupedSGD) -> None:
        self.model = model
        self.step = step

    def __call__(self, x: torch.Tensor) -> torch.Tensor | None:
        """The logits of images ``x`` ``(N, C, H, W)``; None for inputs it
        cannot run (not float32 images of the first convolution's channels)
        or without the kernels (:func:`~flowerbed.sims.numba_kernels.kernels_for`
        has none: turned off, or numba missing)."""
        if x.dim() != 4 or x.dtype != torch.float32 or len(x) == 0:
            return None
        n, c, height, width = x.shape
        if not self.step.kernels_ready((LANES, c, height, width)):
            return None
        layers = self.step.layers
        chunks = -(-n // LANES)
        images = x.new_zeros(chunks * LANES, c, height, width)
        images[:n] = x
        # (chunks, H, W, C, LANES): each chunk one of the kernels' nodes, with
        # the model's weights
        h = images.view(chunks, LANES, c, height, width).permute(0, 3, 4, 2, 1)
        h = h.contiguous()
        with torch.no_grad():
            single = {
                name: p.detach()[None] for name, p in self.model.named_parameters()
            }
            chunked: dict[str, torch.Tensor] = {}  # the images' layers' weights
            params, nodes, grouped = chunked, chunks, True
            for layer in layers:
                if params is chunked and isinstance(layer, Weighted):
                    for key in (layer.weight_key, layer.bias_key):
                        if key is not None:
                            w = single[key]
                            chunked[key] = w.expand(chunks, *w.shape[1:]).contiguous()
                h, grouped, _ = layer.forward(h, grouped, params, nodes)
                if not grouped and params is chunked:
                    # flattened: each later layer one product for all images
                    h = h.reshape(1, chunks * LANES, -1)
                    params, nodes = single, 1
        return h.reshape(chunks * LANES, -1)[:n]
