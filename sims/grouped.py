"""The forward pass of one model for many nodes at once, each with its own weights.

:class:`GroupedForward` runs the layers of the model's one trace
(:func:`flowerbed.sims.layers.trace`) on all nodes directly, each layer's
:class:`~flowerbed.sims.layers.Layer` forward: images kept as ``(batch, nodes x
channels, H, W)`` in channels-last memory, where oneDNN's grouped convolution
(``groups = nodes x groups``) is 2-3x faster than on the channels-first tensors
``torch.func.vmap``'s batching rule makes (measured here: a LeNet node-step on
digits 0.25 ms instead of 0.45-0.6 ms, at 10 to 1,000 nodes); linear layers
are one ``baddbmm`` over the node axis. Any graph of the library's layers and
residual additions runs (every model of the zoo); autograd differentiates it
where :class:`~flowerbed.sims.grouped_sgd.GroupedSGD` does not take the model.
For other models :func:`grouped_forward` answers None and they train per node.
"""

from __future__ import annotations

import weakref

import torch
from flowerbed.sims.layers import Grouped, Traced, Unsupported, built_once, trace
from torch import nn


class GroupedForward:
    """The forward pass of ``model`` for many nodes at once, each with its weights.

    Raises :class:`~flowerbed.sims.layers.Unsupported` for a model the layer
    library does not run. Call with stacked parameters (``name -> (nodes,
    *shape)``) and inputs ``(nodes, batch, *sample shape)``; returns ``(nodes,
    batch, *out)``.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.traced: Traced = trace(model)
        self.names = [name for name, _ in model.named_parameters()]  # in order

    def __call__(
        self, params: dict[str, torch.Tensor], x: torch.Tensor
    ) -> torch.Tensor:
        n, batch = x.shape[:2]
        values: dict[object, Grouped] = {}
        result: Grouped | None = None
        layers = self.traced.layers
        for node in self.traced.nodes:
            if node.op == "placeholder":
                values[node] = _grouped_input(x)
            elif node.op == "call_module":
                (arg,) = node.args
                h, grouped = values[arg]
                out, grouped_out, _ = layers[node].forward(h, grouped, params, n)
                values[node] = (out, grouped_out)
            elif node.op == "call_function":
                a, b = (values[arg] for arg in node.args)
                if a[1] != b[1]:
                    raise Unsupported("adding values of different layouts")
                values[node] = (a[0] + b[0], a[1])
            else:
                result = values[node.args[0]]
        assert result is not None
        return _per_node(result, n, batch)


def _grouped_input(x: torch.Tensor) -> Grouped:
    """``(nodes, batch, C, *spatial)`` as ``(batch, nodes x C, *spatial)``.

    Images of several nodes are laid out channels-last, ``(batch, H, W, nodes,
    C)`` in memory, where oneDNN's grouped convolution is fastest (one node's
    stay as they are: for LeNet's evaluation on digits, ~0.1 ms less than a
    copy to channels-last and back at the flatten); flat samples stay ``(nodes,
    batch, features)``.
    """
    if x.dim() == 3:
        return x, False
    if x.dim() == 5:  # images
        n, batch, c, height, width = x.shape
        if n == 1:  # one node's images are its batch: no copy (evaluation)
            return x[0], True
        packed = x.permute(1, 3, 4, 0, 2).contiguous()
        return packed.view(batch, height, width, n * c).permute(0, 3, 1, 2), True
    if x.dim() == 4:  # sequences
        n, batch, c, length = x.shape
        return x.transpose(0, 1).reshape(batch, n * c, length), True
    raise Unsupported(f"inputs of {x.dim() - 2} dimensions per sample")


def grouped_inputs(x: torch.Tensor) -> list[Grouped]:
    """Each step's inputs, ``(steps, nodes, batch, C, *spatial)``, laid out as
    :func:`_grouped_input` lays out one step's: images with one copy for all
    steps instead of one per step."""
    if x.dim() == 6:  # images
        _, n, batch, c, height, width = x.shape
        packed = x.permute(0, 2, 4, 5, 1, 3).contiguous()
        return [
            (p.view(batch, height, width, n * c).permute(0, 3, 1, 2), True)
            for p in packed.unbind(0)
        ]
    return [_grouped_input(step) for step in x.unbind(0)]


def _per_node(value: Grouped, n: int, batch: int) -> torch.Tensor:
    """The model's output as ``(nodes, batch, *out)``."""
    h, grouped = value
    if not grouped:
        return h
    if h.dim() != 2:
        raise Unsupported("an output with spatial dimensions")
    return h.reshape(batch, n, -1).transpose(0, 1)


_GROUPED: weakref.WeakKeyDictionary[nn.Module, GroupedForward | None] = (
    weakref.WeakKeyDictionary()
)
"""Grouped forward passes by model (None: the library does not run it)."""


def grouped_forward(model: nn.Module) -> GroupedForward | None:
    """The model's :class:`GroupedForward`, or None if the library does not
    run it (cached)."""
    return built_once(_GROUPED, model, GroupedForward)


def evaluation_logits(model: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """``model``'s outputs for ``x`` ``(N, *sample)`` with its own weights, the
    library's layers run for one node without autograd (2x2 max pooling as
    :func:`~flowerbed.clients.training.max_pool_2x2`); None when the library
    does not run ``model``. The central evaluation's forward pass."""
    grouped = grouped_forward(model)
    if grouped is None:
        return None
    params = {name: p.detach()[None] for name, p in model.named_parameters()}
    with torch.no_grad():
        return grouped(params, x[None])[0]
