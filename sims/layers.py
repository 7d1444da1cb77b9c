"""The layer library of batched simulation: one trace, one table, one object per layer.

A model is traced once with ``torch.fx`` (:func:`trace`, cached per model); each
of its layers becomes one :class:`Layer` of :data:`LAYERS`, the one table of
what batched training and the central evaluation run. A layer object holds its
forward pass for every node at once and, where written out, its backward
pass, which moves the layer's weights in place and returns its input's
gradient. Its users:

- :class:`~flowerbed.sims.grouped.GroupedForward` runs every layer's forward
  (any graph of table layers and residual additions); autograd differentiates
  it where the written-out step does not take the model (the autograd
  fallback);
- :class:`~flowerbed.sims.grouped_sgd.GroupedSGD` runs a chain of layers that
  all have a written-out backward, forward then back by hand;
- the central evaluation runs GroupedForward for one node
  (:func:`~flowerbed.sims.grouped.evaluation_logits`), or, on the node
  layout's kernels, GroupedSGD's layers in the node layout
  (:mod:`flowerbed.sims.kernel_inference`).

A model with anything else (a layer not in the table, a function other than
``+``, buffers) is not batched: each node trains it on its own
(:func:`flowerbed.clients.training.train_steps`).

Layouts. Values pass between layers in one of two layouts by default: *grouped*,
``(batch, nodes x channels, *spatial)`` (images in channels-last memory, where
oneDNN's grouped convolution with ``groups = nodes x groups`` is fastest;
sequences), and *flat*, ``(nodes, batch, features)``, where a linear layer is
one ``baddbmm`` over the node axis. On the node layout's kernels (numba's by
default, :mod:`flowerbed.sims.numba_kernels`), a written-out step keeps images in a
third, the *node layout* ``(nodes, H, W, C, batch)`` (five dimensions), where
the convolutions and max poolings run on the kernels their objects hold. Each
table entry says which it takes:

===================  =======  ====  ==========  ==========
layer                grouped  flat  backward    node layout
===================  =======  ====  ==========  ==========
Conv1d, Conv2d       yes      no    written     Conv2d
Linear               no       yes   written     yes
ReLU, Identity       yes      yes   written     yes
MaxPool2d            yes      no    written     yes
Flatten(1, -1)       yes      yes   written     yes
GroupNorm            yes      no    autograd    no
other activations    yes      yes   autograd    no
other pooling        yes      no    autograd    no
===================  =======  ====  ==========  ==========

To add a layer: write its :class:`Layer` (``forward`` for the layouts it
takes, raising :class:`Unsupported` for the others; ``backward`` if written
out, with ``WRITTEN_BACKWARD = True``) and add its module type to
:data:`LAYERS`; ``tests/test_batched.py`` compares every path with per-node
training.

FedProx's proximal term (Li et al., "Federated optimization in heterogeneous
networks", MLSys 2020, Eq. 2) adds ``mu (w - w0)`` to each weight's gradient:
a written-out backward applies it as ``w -= lr mu (w - w0)`` before the loss
gradient is subtracted, both from the weights the step started with.
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, TypeVar

import torch
from flowerbed.clients.training import is_max_pool_2x2, max_pool_2x2
from flowerbed.sims.conv_kernels import ConvKernels, PoolKernels
from torch import fx, nn

if TYPE_CHECKING:
    from flowerbed.sims.numba_kernels import NumbaConvKernels, NumbaPoolKernels

Grouped = tuple[torch.Tensor, bool]
"""A value between layers and its layout: ``True`` for grouped ``(batch, nodes x
channels, *spatial)``, ``False`` for flat ``(nodes, batch, features)``."""


class Unsupported(Exception):
    """A model or layer the library does not run (train it per node)."""


K = TypeVar("K")
V = TypeVar("V")


def built_once(
    cache: MutableMapping[K, V | None], key: K, build: Callable[[K], V]
) -> V | None:
    """``build(key)``, kept in ``cache``; None (kept too) when ``build`` raises
    :class:`Unsupported`."""
    if key not in cache:
        try:
            cache[key] = build(key)
        except Unsupported:
            cache[key] = None
    return cache[key]


@dataclass(frozen=True)
class Rates:
    """Each node's learning rate and FedProx term for one step.

    ``lr`` and ``mu`` are ``(nodes,)``; ``anchors`` holds the weights each node
    started its task with (``name -> (nodes, *shape)``), needed when any ``mu``
    is non-zero.
    """

    lr: torch.Tensor
    mu: torch.Tensor
    anchors: dict[str, torch.Tensor]
    _scales: dict[int, torch.Tensor] = field(
        default_factory=dict, compare=False, repr=False
    )

    def loss_scale(self, batch: int) -> torch.Tensor:
        """``lr / batch``, ``(nodes, 1, 1)``: what each node's gradient of its
        summed cross-entropy is scaled by (made once per batch size: a step
        with the same rates reuses it)."""
        if batch not in self._scales:
            self._scales[batch] = (self.lr / batch).view(-1, 1, 1)
        return self._scales[batch]


@dataclass(frozen=True)
class Backprop:
    """What a layer's backward pass is given besides the gradient of its output."""

    h_in: torch.Tensor
    """The layer's input."""
    grouped_in: bool
    """Its layout (``True``: grouped)."""
    saved: torch.Tensor | None
    """What the forward pass kept for the backward pass."""
    params: dict[str, torch.Tensor]
    """Every node's weights (``name -> (nodes, *shape)``), moved in place."""
    rates: Rates
    need_input: bool
    """Whether the gradient of the input is wanted (not for the first layer)."""


class Layer:
    """One layer for every node at once: its forward pass and, when
    ``WRITTEN_BACKWARD``, its backward pass, which moves its weights (if any)
    and returns the gradient of its input (``need_input``).

    The base class is the identity.
    """

    WRITTEN_BACKWARD: ClassVar[bool] = True
    """Whether :meth:`backward` is written out (else autograd differentiates
    :meth:`forward`)."""
    NODE_LAYOUT: ClassVar[bool] = True
    """Whether the compiled kernels' node layout ``(nodes, H, W, C, batch)``
    runs this layer (:mod:`flowerbed.sims.grouped_sgd`,
    :mod:`flowerbed.sims.kernel_inference`)."""

    def __init__(self, module: nn.Module, name: str) -> None:
        self.module = module

    def forward(
        self, h: torch.Tensor, grouped: bool, params: dict[str, torch.Tensor], n: int
    ) -> tuple[torch.Tensor, bool, torch.Tensor | None]:
        """Output, its layout (``True``: grouped), what backward keeps."""
        return h, grouped, None

    def backward(self, grad: torch.Tensor, ctx: Backprop) -> torch.Tensor | None:
        return grad


class Weighted(Layer):
    """A layer with weights (and maybe a bias) under its module's name."""

    def __init__(self, module: nn.Module, name: str) -> None:
        super().__init__(module, name)
        prefix = f"{name}." if name else ""
        self.weight_key = f"{prefix}weight"
        has_bias = getattr(module, "bias", None) is not None
        self.bias_key = f"{prefix}bias" if has_bias else None


class Conv(Weighted):
    """``nn.Conv1d`` and ``nn.Conv2d`` on grouped values: one convolution of
    ``groups x nodes`` groups."""

    def __init__(self, module: nn.Module, name: str) -> None:
        assert isinstance(module, nn.Conv1d | nn.Conv2d)
        if module.padding_mode != "zeros" or isinstance(module.padding, str):
            raise Unsupported(f"padding {module.padding!r} {module.padding_mode}")
        super().__init__(module, name)
        self.stride = list(module.stride)
        self.padding = list(module.padding)  # type: ignore[arg-type]
        self.dilation = list(module.dilation)
        self.zeros = [0] * len(self.stride)
        self.groups = module.groups
        self.out_channels = module.out_channels
        self.spatial = tuple(range(2, 2 + len(self.stride)))
        # the node layout's kernels by (H, W, batch), as the written-out step
        # plans them; zero biases by node count for a convolution without one
        self.kernels: dict[tuple[int, int, int], ConvKernels | NumbaConvKernels] = {}
        self._zeros: dict[int, torch.Tensor] = {}

    def forward(
        self, h: torch.Tensor, grouped: bool, params: dict[str, torch.Tensor], n: int
    ) -> tuple[torch.Tensor, bool, torch.Tensor | None]:
        if not grouped:
            raise Unsupported("a convolution on flat features")
        if h.dim() == 5:  # the node layout
            _, height, width, _, batch = h.shape
            kernels = self.kernels[(height, width, batch)]
            laid = _laid(params[self.weight_key])
            if self.bias_key:
                node_bias = params[self.bias_key]
            else:
                if n not in self._zeros:
                    self._zeros[n] = h.new_zeros(n, self.out_channels)
                node_bias = self._zeros[n]
            return kernels.forward(h, laid, node_bias), True, laid
        weight = node_rows(params[self.weight_key])
        bias = params[self.bias_key].view(-1) if self.bias_key else None
        out = torch.convolution(h, weight, bias, *self._settings(n))
        return out, True, weight  # backward moves the weights through this view

    def backward(self, grad: torch.Tensor, ctx: Backprop) -> torch.Tensor | None:
        assert ctx.saved is not None
        if ctx.h_in.dim() == 5:  # the node layout
            return self._node_backward(grad, ctx, ctx.saved)
        n = ctx.params[self.weight_key].shape[0]
        grad_in, grad_weight, _ = torch.ops.aten.convolution_backward(
            grad,
            ctx.h_in,
            ctx.saved,
            None,
            *self._settings(n),
            [ctx.need_input, True, False],
        )
        proximal(ctx.params, ctx.rates, self.weight_key)
        ctx.saved.sub_(grad_weight)
        if self.bias_key:
            proximal(ctx.params, ctx.rates, self.bias_key)
            ctx.params[self.bias_key].sub_(grad.sum(dim=(0, *self.spatial)).view(n, -1))
        return grad_in

    def _settings(
        self, n: int
    ) -> tuple[list[int], list[int], list[int], bool, list[int], int]:
        """The convolution's stride, padding, dilation, transposed (no), output
        padding and groups, as ``aten.convolution`` and its backward take them,
        for ``n`` nodes."""
        return (
            self.stride,
            self.padding,
            self.dilation,
            False,
            self.zeros,
            self.groups * n,
        )

    def _node_backward(
        self, grad: torch.Tensor, ctx: Backprop, saved: torch.Tensor
    ) -> torch.Tensor | None:
        """:meth:`backward` in the node layout (``saved``: the laid-out weights)."""
        _, height, width, _, batch = ctx.h_in.shape
        kernels = self.kernels[(height, width, batch)]
        grad_in = kernels.input_grad(grad, saved) if ctx.need_input else None
        proximal(ctx.params, ctx.rates, self.weight_key)
        bias = None
        if self.bias_key:
            proximal(ctx.params, ctx.rates, self.bias_key)
            bias = ctx.params[self.bias_key]  # moved by the kernel too
        weights = ctx.params[self.weight_key]
        if saved.data_ptr() == weights.data_ptr():  # a view: moves in place
            kernels.update_weights(grad, ctx.h_in, saved, bias)
        else:  # rows of some nodes (copies): move a copy and put it back
            moved = _laid(weights)
            kernels.update_weights(grad, ctx.h_in, moved, bias)
            weights.copy_(moved.permute(0, 1, 4, 2, 3))
        return grad_in


class Linear(Weighted):
    """``nn.Linear`` on flat values: one batched matrix product over the nodes.

    Its backward subtracts the weight gradient by the product that computes it
    (``baddbmm_``): that gradient, as large as the weights, is never written
    out and read back.
    """

    def forward(
        self, h: torch.Tensor, grouped: bool, params: dict[str, torch.Tensor], n: int
    ) -> tuple[torch.Tensor, bool, torch.Tensor | None]:
        if grouped:
            raise Unsupported("a linear layer on unflattened features")
        weight = params[self.weight_key].transpose(1, 2)
        if self.bias_key is None:
            return torch.bmm(h, weight), False, None
        return torch.baddbmm(params[self.bias_key].unsqueeze(1), h, weight), False, None

    def backward(self, grad: torch.Tensor, ctx: Backprop) -> torch.Tensor | None:
        weight = ctx.params[self.weight_key]
        grad_in = torch.bmm(grad, weight) if ctx.need_input else None
        proximal(ctx.params, ctx.rates, self.weight_key)
        weight.baddbmm_(grad.transpose(1, 2), ctx.h_in, alpha=-1)
        if self.bias_key:
            proximal(ctx.params, ctx.rates, self.bias_key)
            ctx.params[self.bias_key].sub_(grad.sum(dim=1))
        return grad_in


class ReLU(Layer):
    """``nn.ReLU``, in either layout; in place when ``in_place`` (set by a
    written-out step after a convolution, linear layer or pooling, whose
    backward passes read their input, not their output)."""

    in_place = False

    def forward(
        self, h: torch.Tensor, grouped: bool, params: dict[str, torch.Tensor], n: int
    ) -> tuple[torch.Tensor, bool, torch.Tensor | None]:
        out = torch.relu_(h) if self.in_place else torch.relu(h)
        return out, grouped, out

    def backward(self, grad: torch.Tensor, ctx: Backprop) -> torch.Tensor | None:
        assert ctx.saved is not None
        return torch.ops.aten.threshold_backward(grad, ctx.saved, 0)


class MaxPool(Layer):
    """``nn.MaxPool2d`` on grouped images (each node's channels are channels).

    It keeps the indices of the maxima for a written-out backward
    (``keep_indices``, set by the written-out step) or when autograd records;
    else (evaluation) 2x2 windows of stride 2 are pooled by
    :func:`~flowerbed.clients.training.max_pool_2x2`, the same values, several
    times faster than PyTorch's kernel on small planes.
    """

    keep_indices = False

    def __init__(self, module: nn.Module, name: str) -> None:
        assert isinstance(module, nn.MaxPool2d)
        if module.return_indices:
            raise Unsupported("max pooling that returns its indices")
        super().__init__(module, name)
        self.args = (
            module.kernel_size,
            module.stride,
            module.padding,
            module.dilation,
            module.ceil_mode,
        )
        self.windows_2x2 = is_max_pool_2x2(module)
        # the node layout's kernels by (H, W, batch) (None: PyTorch pools)
        self.kernels: dict[
            tuple[int, int, int], PoolKernels | NumbaPoolKernels | None
        ] = {}

    def forward(
        self, h: torch.Tensor, grouped: bool, params: dict[str, torch.Tensor], n: int
    ) -> tuple[torch.Tensor, bool, torch.Tensor | None]:
        if not grouped or h.dim() not in (4, 5):
            raise Unsupported("2-D pooling on other than images")
        if h.dim() == 5:  # the node layout: for a written-out backward
            _, height, width, _, batch = h.shape
            kernels = self.kernels.get((height, width, batch))
            if kernels is not None:
                out, places = kernels.forward(h)
                return out, True, places
            pooled, indices = torch.ops.aten.max_pool2d_with_indices(
                _planes(h), *self.args
            )
            return _node_major(pooled, h.shape[3]), True, indices
        if self.keep_indices or torch.is_grad_enabled():
            out, indices = torch.ops.aten.max_pool2d_with_indices(h, *self.args)
            return out, True, indices
        if self.windows_2x2:
            return max_pool_2x2(h), True, None
        return nn.functional.max_pool2d(h, *self.args), True, None

    def backward(self, grad: torch.Tensor, ctx: Backprop) -> torch.Tensor | None:
        assert ctx.saved is not None
        if ctx.h_in.dim() == 5:  # the node layout
            _, height, width, _, batch = ctx.h_in.shape
            kernels = self.kernels.get((height, width, batch))
            if kernels is not None:
                return kernels.backward(grad, ctx.saved)
            out = torch.ops.aten.max_pool2d_with_indices_backward(
                _planes(grad), _planes(ctx.h_in), *self.args, ctx.saved
            )
            return _node_major(out, ctx.h_in.shape[3])
        return torch.ops.aten.max_pool2d_with_indices_backward(
            grad, ctx.h_in, *self.args, ctx.saved
        )


class Flatten(Layer):
    """``nn.Flatten()`` (all dimensions after the first): grouped to flat."""

    def __init__(self, module: nn.Module, name: str) -> None:
        assert isinstance(module, nn.Flatten)
        if (module.start_dim, module.end_dim) != (1, -1):
            raise Unsupported("Flatten other than (1, -1)")
        super().__init__(module, name)

    def forward(
        self, h: torch.Tensor, grouped: bool, params: dict[str, torch.Tensor], n: int
    ) -> tuple[torch.Tensor, bool, torch.Tensor | None]:
        if not grouped:
            return h, False, None  # (nodes, batch, features) is flat already
        if h.dim() == 5:  # the node layout: each image's (C, H, W) in order
            return h.permute(0, 4, 3, 1, 2).reshape(n, h.shape[4], -1), False, None
        return h.reshape(h.shape[0], n, -1).transpose(0, 1), False, None

    def backward(self, grad: torch.Tensor, ctx: Backprop) -> torch.Tensor | None:
        if not ctx.grouped_in:
            return grad
        if ctx.h_in.dim() == 5:  # the node layout
            n, height, width, c, batch = ctx.h_in.shape
            out = grad.view(n, batch, c, height, width).permute(0, 3, 4, 2, 1)
            return out.contiguous()
        if ctx.h_in.dim() == 4:  # images: one copy, straight into channels-last
            batch, _, height, width = ctx.h_in.shape
            n = grad.shape[0]
            out = torch.empty_like(ctx.h_in, memory_format=torch.channels_last)
            out.permute(0, 2, 3, 1).view(batch, height, width, n, -1).copy_(
                grad.view(n, batch, -1, height, width).permute(1, 3, 4, 0, 2)
            )
            return out
        return grad.transpose(0, 1).reshape(ctx.h_in.shape)


class Elementwise(Layer):
    """A parameter-free layer acting on each element (activations): the
    module itself, in either layout; differentiated by autograd."""

    WRITTEN_BACKWARD = False
    NODE_LAYOUT = False

    def forward(
        self, h: torch.Tensor, grouped: bool, params: dict[str, torch.Tensor], n: int
    ) -> tuple[torch.Tensor, bool, torch.Tensor | None]:
        return self.module(h), grouped, None


class ChannelPool(Elementwise):
    """A parameter-free layer acting on each channel of each sample on its own
    (pooling): the module itself, on grouped values only."""

    def forward(
        self, h: torch.Tensor, grouped: bool, params: dict[str, torch.Tensor], n: int
    ) -> tuple[torch.Tensor, bool, torch.Tensor | None]:
        if not grouped:
            raise Unsupported("pooling on flat features")
        return self.module(h), True, None


class GroupNorm(Layer):
    """``nn.GroupNorm`` on grouped values: ``groups x nodes`` groups, each
    node's scale and shift; differentiated by autograd."""

    WRITTEN_BACKWARD = False
    NODE_LAYOUT = False

    def __init__(self, module: nn.Module, name: str) -> None:
        assert isinstance(module, nn.GroupNorm)
        super().__init__(module, name)
        prefix = f"{name}." if name else ""
        self.num_groups, self.eps = module.num_groups, module.eps
        self.scale_key = f"{prefix}weight" if module.affine else None
        self.shift_key = f"{prefix}bias" if module.affine else None

    def forward(
        self, h: torch.Tensor, grouped: bool, params: dict[str, torch.Tensor], n: int
    ) -> tuple[torch.Tensor, bool, torch.Tensor | None]:
        if not grouped:
            raise Unsupported("group norm on flat features")
        scale = params[self.scale_key].flatten() if self.scale_key else None
        shift = params[self.shift_key].flatten() if self.shift_key else None
        out = nn.functional.group_norm(h, self.num_groups * n, scale, shift, self.eps)
        return out, True, None


LAYERS: dict[type[nn.Module], type[Layer]] = {
    nn.Conv1d: Conv,
    nn.Conv2d: Conv,
    nn.Linear: Linear,
    nn.ReLU: ReLU,
    nn.Identity: Layer,
    nn.MaxPool2d: MaxPool,
    nn.Flatten: Flatten,
    nn.GroupNorm: GroupNorm,
    **dict.fromkeys(
        (
            nn.ReLU6,
            nn.LeakyReLU,
            nn.ELU,
            nn.GELU,
            nn.SiLU,
            nn.Tanh,
            nn.Sigmoid,
            nn.Hardtanh,
            nn.Hardswish,
        ),
        Elementwise,
    ),
    **dict.fromkeys(
        (
            nn.MaxPool1d,
            nn.AvgPool1d,
            nn.AvgPool2d,
            nn.AdaptiveAvgPool1d,
            nn.AdaptiveAvgPool2d,
            nn.AdaptiveMaxPool1d,
            nn.AdaptiveMaxPool2d,
        ),
        ChannelPool,
    ),
}
"""The one table of what the library runs: module type -> its :class:`Layer`
(a subclass of a listed type takes its nearest listed base's)."""


def layer_class(module: nn.Module) -> type[Layer] | None:
    """The :class:`Layer` class of ``module`` in :data:`LAYERS`, or None."""
    for cls in type(module).__mro__:
        if cls in LAYERS:
            return LAYERS[cls]
    return None


def layer_of(module: nn.Module, name: str) -> Layer:
    """``module``'s :class:`Layer` (its weights under ``name``); raises
    :class:`Unsupported` for a module the table does not hold or settings its
    layer does not run."""
    cls = layer_class(module)
    if cls is None:
        raise Unsupported(f"layer {type(module).__name__}")
    return cls(module, name)


ADDITIONS = (operator.add, torch.add)
"""The functions a traced graph may call: residual additions."""


@dataclass(frozen=True)
class Traced:
    """A model as the library runs it: its ``torch.fx`` graph's nodes, each
    module call's :class:`Layer`, and the graph as a chain of layers in order
    when it is one (each layer fed by the one before, the last one's output
    the model's), else None."""

    nodes: list[fx.Node]
    layers: dict[fx.Node, Layer]
    chain: list[tuple[nn.Module, str]] | None


def trace(model: nn.Module) -> Traced:
    """``model`` traced once (cached per model); raises :class:`Unsupported`
    for a model the library does not run: ``torch.fx`` cannot trace it, it has
    buffers, a layer not in :data:`LAYERS`, a function but ``+``, or more than
    one input."""
    if model not in _TRACES:
        try:
            _TRACES[model] = _trace(model)
        except Unsupported as err:
            _TRACES[model] = err
    traced = _TRACES[model]
    if isinstance(traced, Unsupported):
        raise traced
    return traced


_TRACES: weakref.WeakKeyDictionary[nn.Module, Traced | Unsupported] = (
    weakref.WeakKeyDictionary()
)
"""Each model's trace, or why the library does not run it."""


def _trace(model: nn.Module) -> Traced:
    if any(True for _ in model.buffers()):
        raise Unsupported("buffers (running statistics)")
    try:
        graph = fx.symbolic_trace(model).graph
    except Exception as err:  # data-dependent control flow, custom tracing
        raise Unsupported(f"torch.fx cannot trace it ({err})") from err
    modules = dict(model.named_modules())
    nodes = list(graph.nodes)
    layers: dict[fx.Node, Layer] = {}
    chain: list[tuple[nn.Module, str]] | None = []
    previous = None
    for node in nodes:
        if node.op == "placeholder":
            if previous is not None:
                raise Unsupported("a forward with more than one input")
            previous = node
        elif node.op == "call_module":
            module = modules[str(node.target)]
            layers[node] = layer_of(module, str(node.target))
            if chain is not None and node.args == (previous,) and not node.kwargs:
                chain.append((module, str(node.target)))
            else:
                chain = None
            previous = node
        elif node.op == "call_function":
            if node.target not in ADDITIONS or node.kwargs:
                raise Unsupported(f"function {node.target}")
            chain = None
        elif node.op == "output":
            if node.args != (previous,):
                chain = None
        else:
            raise Unsupported(f"graph node {node.op} {node.target}")
    return Traced(nodes, layers, chain or None)


def pool_before_relu(
    chain: list[tuple[nn.Module, str]],
) -> list[tuple[nn.Module, str]]:
    """The chain with each ReLU that feeds a 2-D max pooling moved after it.

    The same values: ReLU is non-decreasing, so the maximum of a window's ReLUs
    is the ReLU of its maximum; and the same gradients: where the window's
    maximum is positive both pick the same element (the first maximum), else
    both pass no gradient. The ReLU and its backward pass then run on the
    pooled tensor, a quarter of the size for 2x2 windows.
    """
    out = list(chain)
    for i in range(len(out) - 1):
        if type(out[i][0]) is nn.ReLU and isinstance(out[i + 1][0], nn.MaxPool2d):
            out[i], out[i + 1] = out[i + 1], out[i]
    return out


def node_rows(w: torch.Tensor) -> torch.Tensor:
    """``w`` (``(nodes, out, ...)``) as ``(nodes x out, ...)``, a view: the
    weights move in place through it."""
    try:
        return w.view(-1, *w.shape[2:])
    except RuntimeError as err:
        raise ValueError(
            "stacked parameters must be contiguous (or as lay_out makes them) "
            "to move in place"
        ) from err


def proximal(params: dict[str, torch.Tensor], rates: Rates, name: str) -> None:
    """``w -= lr mu (w - w0)`` for every node (FedProx), when any has a ``mu``."""
    if not rates.anchors:
        return
    w = params[name]
    shape = (-1,) + (1,) * (w.dim() - 1)
    w.sub_((rates.lr * rates.mu).view(shape) * (w - rates.anchors[name]))


def _laid(w: torch.Tensor) -> torch.Tensor:
    """2-D convolution weights ``(nodes, O, C, KH, KW)`` as the kernels take
    them, ``(nodes, O, KH, KW, C)`` contiguous: a view of weights laid out
    channels-last (:meth:`~flowerbed.sims.grouped_sgd.GroupedSGD.lay_out`),
    else a copy."""
    return w.permute(0, 1, 3, 4, 2).contiguous()


def _planes(h: torch.Tensor) -> torch.Tensor:
    """``(nodes, H, W, C, batch)`` as channels-last ``(nodes, C x batch, H, W)``
    (a view)."""
    n, height, width, c, batch = h.shape
    return h.permute(0, 3, 4, 1, 2).reshape(n, c * batch, height, width)


def _node_major(planes: torch.Tensor, c: int) -> torch.Tensor:
    """Channels-last ``(nodes, C x batch, H, W)`` back as ``(nodes, H, W, C,
    batch)`` (a view when the memory is channels-last, as pooling leaves it)."""
    n, cb, height, width = planes.shape
    return planes.permute(0, 2, 3, 1).reshape(n, height, width, c, cb // c)
