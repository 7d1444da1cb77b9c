"""The forward pass of one model for many nodes at once, each with its own weights.

:class:`GroupedForward` traces a model once with ``torch.fx`` and runs each
layer on all nodes directly: images kept as ``(batch, nodes x channels, H, W)``
in channels-last memory, where oneDNN's grouped convolution (``groups = nodes x
groups``) is 2-3x faster than on the channels-first tensors ``torch.func.vmap``'s
batching rule makes (measured here: a LeNet node-step on digits 0.25 ms instead
of 0.45-0.6 ms, at 10 to 1,000 nodes); linear layers are one ``baddbmm`` over
the node axis. It knows convolutions, linear layers, activations, pooling,
flatten, group norm and residual additions (every model of the zoo); for other
models :func:`grouped_forward` answers None and
:func:`flowerbed.sims.batched.train_many` uses vmap.
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Callable

import torch
from torch import fx, nn

ELEMENTWISE_LAYERS = (
    nn.ReLU,
    nn.ReLU6,
    nn.LeakyReLU,
    nn.ELU,
    nn.GELU,
    nn.SiLU,
    nn.Tanh,
    nn.Sigmoid,
    nn.Hardtanh,
    nn.Hardswish,
    nn.Identity,
)
"""Parameter-free layers that act on each element: any layout will do."""
CHANNEL_LAYERS = (
    nn.MaxPool1d,
    nn.MaxPool2d,
    nn.AvgPool1d,
    nn.AvgPool2d,
    nn.AdaptiveAvgPool1d,
    nn.AdaptiveAvgPool2d,
    nn.AdaptiveMaxPool1d,
    nn.AdaptiveMaxPool2d,
)
"""Parameter-free layers that act on each channel of each sample on its own."""

Grouped = tuple[torch.Tensor, bool]
"""A value of the grouped forward pass and its layout: ``True`` for
``(batch, nodes x channels, *spatial)`` (images, sequences), ``False`` for
``(nodes, batch, features)``."""


class Unsupported(Exception):
    """A model or layer :class:`GroupedForward` cannot run (use vmap instead)."""


class GroupedForward:
    """The forward pass of ``model`` for many nodes at once, each with its weights.

    Built from the model's ``torch.fx`` graph; raises :class:`Unsupported` for a
    graph with anything but the layers listed in the module docstring (and
    residual ``+``). Call with stacked parameters (``name -> (nodes, *shape)``)
    and inputs ``(nodes, batch, *sample shape)``; returns ``(nodes, batch, *out)``.
    """

    def __init__(self, model: nn.Module) -> None:
        try:
            graph = fx.symbolic_trace(model).graph
        except Exception as err:  # data-dependent control flow, custom tracing
            raise Unsupported(f"torch.fx cannot trace it ({err})") from err
        self.model = model
        self.nodes = list(graph.nodes)
        modules = dict(model.named_modules())
        for node in self.nodes:
            if node.op == "call_module":
                self._check_module(modules[str(node.target)])
            elif node.op == "call_function":
                if node.target not in (operator.add, torch.add) or node.kwargs:
                    raise Unsupported(f"function {node.target}")
            elif node.op not in ("placeholder", "output"):
                raise Unsupported(f"graph node {node.op} {node.target}")
        if sum(1 for n in self.nodes if n.op == "placeholder") != 1:
            raise Unsupported("a forward with more than one input")
        self.modules = modules

    @staticmethod
    def _check_module(module: nn.Module) -> None:
        if isinstance(module, nn.Conv1d | nn.Conv2d):
            if module.padding_mode != "zeros":
                raise Unsupported(f"padding mode {module.padding_mode!r}")
        elif isinstance(module, nn.Flatten):
            if (module.start_dim, module.end_dim) != (1, -1):
                raise Unsupported("Flatten other than (1, -1)")
        elif not isinstance(
            module, (nn.Linear, nn.GroupNorm, *ELEMENTWISE_LAYERS, *CHANNEL_LAYERS)
        ):
            raise Unsupported(f"layer {type(module).__name__}")

    def __call__(
        self, params: dict[str, torch.Tensor], x: torch.Tensor
    ) -> torch.Tensor:
        n, batch = x.shape[:2]
        values: dict[fx.Node, Grouped] = {}
        result: Grouped | None = None
        for node in self.nodes:
            if node.op == "placeholder":
                values[node] = _grouped_input(x)
            elif node.op == "call_module":
                (arg,) = node.args
                module = self.modules[str(node.target)]
                values[node] = self._layer(
                    module, str(node.target), params, values[arg]
                )  # type: ignore[index]
            elif node.op == "call_function":
                a, b = (values[arg] for arg in node.args)  # type: ignore[index]
                if a[1] != b[1]:
                    raise Unsupported("adding values of different layouts")
                values[node] = (a[0] + b[0], a[1])
            else:
                result = values[node.args[0]]  # type: ignore[index]
        assert result is not None
        return _per_node(result, n, batch)

    def _layer(
        self,
        module: nn.Module,
        name: str,
        params: dict[str, torch.Tensor],
        value: Grouped,
    ) -> Grouped:
        h, grouped = value
        prefix = f"{name}." if name else ""
        if isinstance(module, nn.Conv1d | nn.Conv2d):
            if not grouped:
                raise Unsupported("a convolution on flat features")
            weight = params[f"{prefix}weight"]
            n = weight.shape[0]
            bias = params.get(f"{prefix}bias")
            conv: Callable[..., torch.Tensor] = (
                nn.functional.conv2d
                if isinstance(module, nn.Conv2d)
                else nn.functional.conv1d
            )
            out = conv(
                h,
                weight.flatten(0, 1),
                bias.flatten() if bias is not None else None,
                module.stride,
                module.padding,
                module.dilation,
                module.groups * n,
            )
            return out, True
        if isinstance(module, nn.Linear):
            if grouped:
                raise Unsupported("a linear layer on unflattened features")
            weight = params[f"{prefix}weight"].transpose(1, 2)
            bias = params.get(f"{prefix}bias")
            if bias is None:
                return torch.bmm(h, weight), False
            return torch.baddbmm(bias.unsqueeze(1), h, weight), False
        if isinstance(module, nn.Flatten):
            if not grouped:
                return h, False  # (nodes, batch, features) is flat already
            batch = h.shape[0]
            n = _num_nodes(params)
            return h.reshape(batch, n, -1).transpose(0, 1), False
        if isinstance(module, nn.GroupNorm):
            if not grouped:
                raise Unsupported("group norm on flat features")
            n = _num_nodes(params)
            scale = params.get(f"{prefix}weight")
            shift = params.get(f"{prefix}bias")
            out = nn.functional.group_norm(
                h,
                module.num_groups * n,
                scale.flatten() if scale is not None else None,
                shift.flatten() if shift is not None else None,
                module.eps,
            )
            return out, True
        if isinstance(module, CHANNEL_LAYERS) and not grouped:
            raise Unsupported("pooling on flat features")
        return module(h), grouped


def _num_nodes(params: dict[str, torch.Tensor]) -> int:
    return next(iter(params.values())).shape[0]


def _grouped_input(x: torch.Tensor) -> Grouped:
    """``(nodes, batch, C, *spatial)`` as ``(batch, nodes x C, *spatial)``.

    Images are laid out channels-last, ``(batch, H, W, nodes, C)`` in memory,
    where oneDNN's grouped convolution is fastest; flat samples stay
    ``(nodes, batch, features)``.
    """
    if x.dim() == 3:
        return x, False
    if x.dim() == 5:  # images
        n, batch, c, height, width = x.shape
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
"""Grouped forward passes by model (None: the model needs vmap)."""


def grouped_forward(model: nn.Module) -> GroupedForward | None:
    """The model's :class:`GroupedForward`, or None if it needs vmap (cached)."""
    if model not in _GROUPED:
        try:
            _GROUPED[model] = GroupedForward(model)
        except Unsupported:
            _GROUPED[model] = None
    return _GROUPED[model]
