"""One SGD step of many nodes at once, its backward pass written out.

:class:`GroupedSGD` runs a chain of layers (convolutions, linear layers, ReLU,
2-D max pooling, flatten: LeNet, the 1-D CNN, the MLP and logistic regression
of the zoo) for every node as :class:`~flowerbed.sims.grouped.GroupedForward`
does, then walks the chain back by hand and updates each node's weights in
place, layer by layer, as soon as that layer's gradient is known. Autograd
would keep a graph, write every weight's gradient to a fresh tensor, and leave
the update to one more pass over all weights; here the learning rate is folded
into the gradient of the loss (each node's ``(softmax - onehot) * lr / batch``,
the derivative of its mean cross-entropy times its rate) and a linear layer's
weight gradient is subtracted from the weights by the matrix product that
computes it (``baddbmm_``): that gradient, as large as the weights, is never
written out and read back, and for many small nodes moving weights is much of
what a step costs (at 1,000 LeNet nodes, 21 M floats). A ReLU that
feeds a max pooling runs after it, on the pooled values (the same values and
gradients, on a quarter of the elements for 2x2 windows); a ReLU after a
convolution, linear layer or pooling works in place. Measured here for LeNet on
digits (CPU time of :func:`~flowerbed.sims.batched.train_many`, one thread):
1.3x fewer CPU-seconds than autograd at 10 nodes, 1.4x at 100, 1.5x at 1,000.
Each layer's input gradient is computed before its weights
move, so the step equals autograd's SGD step within float tolerance.

Opted in to the compiled kernels of :mod:`flowerbed.sims.conv_kernels`
(``FLOWERBED_C_KERNELS=1``; off by default), when every 2-D convolution of the
chain is one they take and the batch is whole vectors of samples,
:meth:`GroupedSGD.pack` lays the images out as ``(nodes, H, W, C, batch)`` and
the step runs the chain's node-layout layers: the kernels for the
convolutions and for max pooling over windows that do not overlap (a 10-node
LeNet step 1.46 -> ~0.72 ms here; other pooling by PyTorch on the same memory
seen as channels-last planes), one copy at the flatten.

FedProx's proximal term (Li et al., "Federated optimization in heterogeneous
networks", MLSys 2020, Eq. 2) adds ``mu (w - w0)`` to each weight's gradient:
applied as ``w -= lr mu (w - w0)`` before the loss gradient is subtracted, both
from the weights the step started with.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
from flowerbed.clients.training import log_softmax
from flowerbed.sims.conv_kernels import (
    LANES,
    ConvKernels,
    ConvShape,
    PoolKernels,
    PoolShape,
    eligible,
    kernels_for,
    pair,
    pool_eligible,
    pool_kernels_for,
)
from flowerbed.sims.grouped import Grouped, GroupedForward, Unsupported, grouped_inputs
from torch import nn

STEP_LAYERS = (
    nn.Conv1d,
    nn.Conv2d,
    nn.Linear,
    nn.ReLU,
    nn.Identity,
    nn.MaxPool2d,
    nn.Flatten,
)
"""Layers whose backward pass :class:`GroupedSGD` writes out."""


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


class GroupedSGD:
    """Plain SGD steps on a chain of :data:`STEP_LAYERS` for many nodes at once.

    Raises :class:`~flowerbed.sims.grouped.Unsupported` for a model whose
    ``torch.fx`` graph is not a chain of those layers (residual additions,
    other layers): train it with autograd.
    """

    def __init__(self, grouped: GroupedForward) -> None:
        chain: list[tuple[nn.Module, str]] = []
        previous = None
        for node in grouped.nodes:
            if node.op == "placeholder":
                previous = node
            elif node.op == "call_module":
                if node.args != (previous,) or node.kwargs:
                    raise Unsupported(f"{node.target} is not fed by the layer before")
                chain.append((grouped.modules[str(node.target)], str(node.target)))
                previous = node
            elif node.op == "output":
                if node.args != (previous,):
                    raise Unsupported("the output is not the last layer's")
            else:
                raise Unsupported(f"graph node {node.op} {node.target}")
        if not chain:
            raise Unsupported("no layers")
        chain = pool_before_relu(chain)
        layers: list[_Layer] = []
        for module, name in chain:
            # in place after a layer whose backward pass does not read its output
            in_place = bool(layers) and isinstance(layers[-1], _Weighted | _MaxPool)
            layers.append(_layer(module, name, in_place))
        self.layers = layers
        self.node_layers = _node_layers(chain, layers)
        self._node_inputs: dict[tuple[int, ...], bool] = {}

    def pack(self, x: torch.Tensor) -> list[Grouped]:
        """Each step's inputs, ``(steps, nodes, batch, *features)``, laid out
        for :meth:`step`: for the compiled kernels
        (:mod:`flowerbed.sims.conv_kernels`, opted in) when every convolution of
        the chain has them at this image size (``(nodes, H, W, C, batch)``, one copy for
        all steps), else as :func:`~flowerbed.sims.grouped.grouped_inputs` lays
        them out for oneDNN.

        The kernels take whole vectors of samples: a batch that is not is
        padded with zero images up to the next multiple of
        :data:`~flowerbed.sims.conv_kernels.LANES` when that at most doubles
        it (:meth:`step` gives the padding no gradient). Measured here for
        LeNet, a step of 100 nodes on 9-14 digits each 7.4-7.7 ms padded to 16
        against 10.2-14.6 ms on oneDNN, of 1,000 nodes on 8 each 112 against
        138 ms; on 4 or fewer oneDNN is faster (97 against 111 ms).
        """
        if x.dim() == 6 and self.node_layers is not None:
            steps, n, batch = x.shape[:3]
            padded = -(-batch // LANES) * LANES
            if padded <= 2 * batch and self._kernels_ready((padded, *x.shape[3:])):
                packed = x.new_zeros(steps, n, *x.shape[4:], x.shape[3], padded)
                packed[..., :batch] = x.permute(0, 1, 4, 5, 3, 2)
                return [(p, True) for p in packed.unbind(0)]
        return grouped_inputs(x)

    def _kernels_ready(self, sample: tuple[int, ...]) -> bool:
        """Whether the node layout runs a batch of ``(batch, C, H, W)`` images
        (the kernels of every convolution compiled: cached per size)."""
        if self.node_layers is None:
            return False
        if sample not in self._node_inputs:
            self._node_inputs[sample] = _plan_kernels(self.node_layers, *sample)
        return self._node_inputs[sample]

    def lay_out(self, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``params`` (``name -> (nodes, *shape)``) in the memory layout
        :meth:`step` moves fastest: each 2-D convolution's weights channels-last
        (``(nodes, out, kh, kw, in)`` in memory), as oneDNN takes them beside
        channels-last images; in any other layout it copies them to that one
        before each of a step's three uses (forward, input and weight gradients)
        and hands back a gradient to match (at 10 LeNet nodes, ~70 us of a
        ~1.6 ms step). Same shapes and values; copies of the weights that change.
        """
        out = dict(params)
        for layer in self.layers:
            if isinstance(layer, _Conv) and len(layer.stride) == 2:
                w = params[layer.weight_key]
                out[layer.weight_key] = (
                    w.permute(0, 1, 3, 4, 2).contiguous().permute(0, 1, 4, 2, 3)
                )
        return out

    def step(
        self,
        params: dict[str, torch.Tensor],
        x: Grouped,
        y: torch.Tensor,
        rates: Rates,
    ) -> torch.Tensor:
        """One SGD step of every node on its minibatch; returns each sample's
        cross-entropy, ``(nodes, batch)`` (a node's loss is their mean).

        ``params`` (``name -> (nodes, *shape)``, each node's rows one view of
        memory: contiguous, or as :meth:`lay_out` makes them) are updated in place;
        ``x`` is the nodes' inputs as :meth:`pack` lays them out, ``y``
        ``(nodes, batch)`` class indices.
        """
        n, batch = y.shape
        # inference mode: no autograd bookkeeping on each op's result (nothing
        # here is differentiated); ~5% of a 10-node LeNet step, same values
        with torch.inference_mode():
            h, grouped = x
            layers = self.layers
            if grouped and h.dim() == 5 and self.node_layers is not None:
                layers = self.node_layers  # as pack laid them out for the kernels
            tape: list[tuple[torch.Tensor, bool, torch.Tensor | None]] = []
            for layer in layers:
                out, grouped_out, saved = layer.forward(h, grouped, params, n)
                tape.append((h, grouped, saved))
                h, grouped = out, grouped_out
            if grouped:
                if h.dim() != 2:
                    raise Unsupported("an output with spatial dimensions")
                h = h.reshape(batch, n, -1).transpose(0, 1)
            padded = h.shape[1]  # > batch: pack's zero images, no loss
            log_p = log_softmax(h[:, :batch] if padded != batch else h)
            target = y.unsqueeze(2)
            losses = log_p.gather(2, target).view(n, batch).neg_()
            # d(mean cross-entropy)/d(logits) = (softmax - onehot) / batch, times lr
            grad: torch.Tensor | None = log_p.exp_()
            assert grad is not None
            grad.scatter_add_(2, target, grad.new_full((n, batch, 1), -1.0))
            grad.mul_(rates.loss_scale(batch))
            if padded != batch:
                full = grad.new_zeros(n, padded, grad.shape[2])
                full[:, :batch] = grad
                grad = full
            if grouped:
                grad = grad.transpose(0, 1).reshape(batch, -1)
            for i in range(len(tape) - 1, -1, -1):
                assert grad is not None
                h_in, grouped_in, saved = tape[i]
                grad = layers[i].backward(
                    grad, h_in, grouped_in, saved, params, rates, i > 0
                )
        return losses


class _Layer:
    """One layer of the chain: its forward pass for every node, and its
    backward pass, which moves its weights (if any) and returns the gradient of
    its input (``need_input``)."""

    def forward(
        self, h: torch.Tensor, grouped: bool, params: dict[str, torch.Tensor], n: int
    ) -> tuple[torch.Tensor, bool, torch.Tensor | None]:
        """Output, its layout (``True``: grouped), what backward keeps."""
        return h, grouped, None

    def backward(
        self,
        grad: torch.Tensor,
        h_in: torch.Tensor,
        grouped_in: bool,
        saved: torch.Tensor | None,
        params: dict[str, torch.Tensor],
        rates: Rates,
        need_input: bool,
    ) -> torch.Tensor | None:
        return grad


class _Weighted(_Layer):
    """A layer with weights (and maybe a bias) under ``prefix``."""

    def __init__(self, name: str, has_bias: bool) -> None:
        prefix = f"{name}." if name else ""
        self.weight_key = f"{prefix}weight"
        self.bias_key = f"{prefix}bias" if has_bias else None


class _Conv(_Weighted):
    def __init__(self, module: nn.Conv1d | nn.Conv2d, name: str) -> None:
        if module.padding_mode != "zeros" or isinstance(module.padding, str):
            raise Unsupported(f"padding {module.padding!r} {module.padding_mode}")
        super().__init__(name, module.bias is not None)
        self.stride = list(module.stride)
        self.padding = list(module.padding)  # type: ignore[arg-type]
        self.dilation = list(module.dilation)
        self.zeros = [0] * len(self.stride)
        self.groups = module.groups
        self.spatial = tuple(range(2, 2 + len(self.stride)))

    def forward(
        self, h: torch.Tensor, grouped: bool, params: dict[str, torch.Tensor], n: int
    ) -> tuple[torch.Tensor, bool, torch.Tensor | None]:
        if not grouped:
            raise Unsupported("a convolution on flat features")
        weight = _node_rows(params[self.weight_key])
        bias = params[self.bias_key].view(-1) if self.bias_key else None
        out = torch.convolution(
            h,
            weight,
            bias,
            self.stride,
            self.padding,
            self.dilation,
            False,
            self.zeros,
            self.groups * n,
        )
        return out, True, weight  # backward moves the weights through this view

    def backward(
        self,
        grad: torch.Tensor,
        h_in: torch.Tensor,
        grouped_in: bool,
        saved: torch.Tensor | None,
        params: dict[str, torch.Tensor],
        rates: Rates,
        need_input: bool,
    ) -> torch.Tensor | None:
        assert saved is not None
        n = params[self.weight_key].shape[0]
        grad_in, grad_weight, _ = torch.ops.aten.convolution_backward(
            grad,
            h_in,
            saved,
            None,
            self.stride,
            self.padding,
            self.dilation,
            False,
            self.zeros,
            self.groups * n,
            [need_input, True, False],
        )
        _proximal(params, rates, self.weight_key)
        saved.sub_(grad_weight)
        if self.bias_key:
            _proximal(params, rates, self.bias_key)
            params[self.bias_key].sub_(grad.sum(dim=(0, *self.spatial)).view(n, -1))
        return grad_in


class _Linear(_Weighted):
    def forward(
        self, h: torch.Tensor, grouped: bool, params: dict[str, torch.Tensor], n: int
    ) -> tuple[torch.Tensor, bool, torch.Tensor | None]:
        if grouped:
            raise Unsupported("a linear layer on unflattened features")
        weight = params[self.weight_key].transpose(1, 2)
        if self.bias_key is None:
            return torch.bmm(h, weight), False, None
        return torch.baddbmm(params[self.bias_key].unsqueeze(1), h, weight), False, None

    def backward(
        self,
        grad: torch.Tensor,
        h_in: torch.Tensor,
        grouped_in: bool,
        saved: torch.Tensor | None,
        params: dict[str, torch.Tensor],
        rates: Rates,
        need_input: bool,
    ) -> torch.Tensor | None:
        weight = params[self.weight_key]
        grad_in = torch.bmm(grad, weight) if need_input else None
        _proximal(params, rates, self.weight_key)
        weight.baddbmm_(grad.transpose(1, 2), h_in, alpha=-1)
        if self.bias_key:
            _proximal(params, rates, self.bias_key)
            params[self.bias_key].sub_(grad.sum(dim=1))
        return grad_in


class _ReLU(_Layer):
    def __init__(self, in_place: bool) -> None:
        # in place after a convolution, linear layer or pooling: nothing else
        # reads their output (their backward passes read their inputs)
        self.in_place = in_place

    def forward(
        self, h: torch.Tensor, grouped: bool, params: dict[str, torch.Tensor], n: int
    ) -> tuple[torch.Tensor, bool, torch.Tensor | None]:
        out = torch.relu_(h) if self.in_place else torch.relu(h)
        return out, grouped, out

    def backward(
        self,
        grad: torch.Tensor,
        h_in: torch.Tensor,
        grouped_in: bool,
        saved: torch.Tensor | None,
        params: dict[str, torch.Tensor],
        rates: Rates,
        need_input: bool,
    ) -> torch.Tensor | None:
        assert saved is not None
        return torch.ops.aten.threshold_backward(grad, saved, 0)


class _MaxPool(_Layer):
    def __init__(self, module: nn.MaxPool2d) -> None:
        self.args = (
            module.kernel_size,
            module.stride,
            module.padding,
            module.dilation,
            module.ceil_mode,
        )

    def forward(
        self, h: torch.Tensor, grouped: bool, params: dict[str, torch.Tensor], n: int
    ) -> tuple[torch.Tensor, bool, torch.Tensor | None]:
        if not grouped or h.dim() != 4:
            raise Unsupported("2-D pooling on other than images")
        out, indices = torch.ops.aten.max_pool2d_with_indices(h, *self.args)
        return out, True, indices

    def backward(
        self,
        grad: torch.Tensor,
        h_in: torch.Tensor,
        grouped_in: bool,
        saved: torch.Tensor | None,
        params: dict[str, torch.Tensor],
        rates: Rates,
        need_input: bool,
    ) -> torch.Tensor | None:
        return torch.ops.aten.max_pool2d_with_indices_backward(
            grad, h_in, *self.args, saved
        )


class _Flatten(_Layer):
    def forward(
        self, h: torch.Tensor, grouped: bool, params: dict[str, torch.Tensor], n: int
    ) -> tuple[torch.Tensor, bool, torch.Tensor | None]:
        if not grouped:
            return h, False, None  # (nodes, batch, features) is flat already
        return h.reshape(h.shape[0], n, -1).transpose(0, 1), False, None

    def backward(
        self,
        grad: torch.Tensor,
        h_in: torch.Tensor,
        grouped_in: bool,
        saved: torch.Tensor | None,
        params: dict[str, torch.Tensor],
        rates: Rates,
        need_input: bool,
    ) -> torch.Tensor | None:
        if not grouped_in:
            return grad
        if h_in.dim() == 4:  # images: one copy, straight into channels-last
            batch, _, height, width = h_in.shape
            n = grad.shape[0]
            out = torch.empty_like(h_in, memory_format=torch.channels_last)
            out.permute(0, 2, 3, 1).view(batch, height, width, n, -1).copy_(
                grad.view(n, batch, -1, height, width).permute(1, 3, 4, 0, 2)
            )
            return out
        return grad.transpose(0, 1).reshape(h_in.shape)


class _NodeConv(_Weighted):
    """A 2-D convolution by the compiled kernels, on ``(nodes, H, W, C, batch)``
    activations (:mod:`flowerbed.sims.conv_kernels`)."""

    def __init__(self, module: nn.Conv2d, name: str) -> None:
        super().__init__(name, module.bias is not None)
        self.module = module
        self.kernels: dict[tuple[int, int, int], ConvKernels] = {}
        self._zeros: dict[int, torch.Tensor] = {}

    def forward(
        self, h: torch.Tensor, grouped: bool, params: dict[str, torch.Tensor], n: int
    ) -> tuple[torch.Tensor, bool, torch.Tensor | None]:
        _, height, width, _, batch = h.shape
        kernels = self.kernels[(height, width, batch)]
        weight = _laid(params[self.weight_key])
        if self.bias_key:
            bias = params[self.bias_key]
        else:
            if n not in self._zeros:
                self._zeros[n] = h.new_zeros(n, self.module.out_channels)
            bias = self._zeros[n]
        return kernels.forward(h, weight, bias), True, weight

    def backward(
        self,
        grad: torch.Tensor,
        h_in: torch.Tensor,
        grouped_in: bool,
        saved: torch.Tensor | None,
        params: dict[str, torch.Tensor],
        rates: Rates,
        need_input: bool,
    ) -> torch.Tensor | None:
        assert saved is not None
        _, height, width, _, batch = h_in.shape
        kernels = self.kernels[(height, width, batch)]
        grad_in = kernels.input_grad(grad, saved) if need_input else None
        _proximal(params, rates, self.weight_key)
        bias = None
        if self.bias_key:
            _proximal(params, rates, self.bias_key)
            bias = params[self.bias_key]  # moved by the kernel too
        weights = params[self.weight_key]
        if saved.data_ptr() == weights.data_ptr():  # a view: moves in place
            kernels.update_weights(grad, h_in, saved, bias)
        else:  # rows of some nodes (copies): move a copy and put it back
            moved = _laid(weights)
            kernels.update_weights(grad, h_in, moved, bias)
            weights.copy_(moved.permute(0, 1, 4, 2, 3))
        return grad_in


class _NodeMaxPool(_MaxPool):
    """2-D max pooling on ``(nodes, H, W, C, batch)`` activations: by the
    compiled kernels (:class:`~flowerbed.sims.conv_kernels.PoolKernels`, windows
    that do not overlap: the same values and gradients), else by PyTorch on the
    same memory seen as a channels-last ``(nodes, C x batch, H, W)`` tensor."""

    def __init__(self, module: nn.MaxPool2d) -> None:
        super().__init__(module)
        self.module = module
        self.kernels: dict[tuple[int, int, int], PoolKernels | None] = {}

    def forward(
        self, h: torch.Tensor, grouped: bool, params: dict[str, torch.Tensor], n: int
    ) -> tuple[torch.Tensor, bool, torch.Tensor | None]:
        _, height, width, _, batch = h.shape
        kernels = self.kernels.get((height, width, batch))
        if kernels is not None:
            out, places = kernels.forward(h)
            return out, True, places
        out, indices = torch.ops.aten.max_pool2d_with_indices(_planes(h), *self.args)
        return _node_major(out, h.shape[3]), True, indices

    def backward(
        self,
        grad: torch.Tensor,
        h_in: torch.Tensor,
        grouped_in: bool,
        saved: torch.Tensor | None,
        params: dict[str, torch.Tensor],
        rates: Rates,
        need_input: bool,
    ) -> torch.Tensor | None:
        assert saved is not None
        _, height, width, _, batch = h_in.shape
        kernels = self.kernels.get((height, width, batch))
        if kernels is not None:
            return kernels.backward(grad, saved)
        out = torch.ops.aten.max_pool2d_with_indices_backward(
            _planes(grad), _planes(h_in), *self.args, saved
        )
        return _node_major(out, h_in.shape[3])


class _NodeFlatten(_Layer):
    """``(nodes, H, W, C, batch)`` to ``(nodes, batch, C x H x W)``, the order
    ``nn.Flatten`` gives."""

    def forward(
        self, h: torch.Tensor, grouped: bool, params: dict[str, torch.Tensor], n: int
    ) -> tuple[torch.Tensor, bool, torch.Tensor | None]:
        return h.permute(0, 4, 3, 1, 2).reshape(n, h.shape[4], -1), False, None

    def backward(
        self,
        grad: torch.Tensor,
        h_in: torch.Tensor,
        grouped_in: bool,
        saved: torch.Tensor | None,
        params: dict[str, torch.Tensor],
        rates: Rates,
        need_input: bool,
    ) -> torch.Tensor | None:
        n, height, width, c, batch = h_in.shape
        return grad.view(n, batch, c, height, width).permute(0, 3, 4, 2, 1).contiguous()


def _laid(w: torch.Tensor) -> torch.Tensor:
    """2-D convolution weights ``(nodes, O, C, KH, KW)`` as the kernels take
    them, ``(nodes, O, KH, KW, C)`` contiguous: a view of the weights
    :meth:`GroupedSGD.lay_out` laid out, else a copy."""
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


def _node_layers(
    chain: list[tuple[nn.Module, str]], layers: list[_Layer]
) -> list[_Layer] | None:
    """The chain's layers for the node layout (:class:`_NodeConv`), or None
    when it has no 2-D convolution or one the kernels do not take (they are
    checked for a batch of one vector), or a layer that would see images in
    another layout (a 1-D convolution, a linear layer before flattening)."""
    out: list[_Layer] = []
    images = True
    convolutions = 0
    for (module, name), layer in zip(chain, layers, strict=True):
        if not images:
            out.append(layer)
        elif isinstance(module, nn.Conv2d):
            if not eligible(module, LANES):  # its own settings: any whole batch
                return None
            out.append(_NodeConv(module, name))
            convolutions += 1
        elif isinstance(module, nn.MaxPool2d):
            pool = _NodeMaxPool(module)
            out.append(pool)
        elif isinstance(module, nn.Flatten):
            out.append(_NodeFlatten())
            images = False
        elif isinstance(module, nn.ReLU | nn.Identity):
            out.append(layer)
        else:
            return None
    return out if convolutions and not images else None


def _plan_kernels(
    layers: list[_Layer], batch: int, c: int, height: int, width: int
) -> bool:
    """Compile (or find) the kernels of every convolution for inputs of this
    size; False if one has none (not opted in, no compiler, or the batch is not
    whole vectors)."""
    for layer in layers:
        if isinstance(layer, _NodeConv):
            if layer.module.in_channels != c:
                return False
            shape = ConvShape.of(layer.module, height, width, batch)
            kernels = kernels_for(shape)
            if kernels is None:
                return False
            layer.kernels[(height, width, batch)] = kernels
            c, height, width = shape.o, shape.ho, shape.wo
        elif isinstance(layer, _NodeMaxPool):
            kernel, stride, padding, dilation, ceil_mode = layer.args
            if ceil_mode:
                return False
            if pool_eligible(layer.module, batch):  # else PyTorch pools
                kh, kw = pair(kernel)
                pool = PoolShape(c, height, width, kh, kw, batch)
                layer.kernels[(height, width, batch)] = pool_kernels_for(pool)
            k, st, pad, dil = (
                pair(kernel),
                pair(stride or kernel),
                pair(padding),
                pair(dilation),
            )
            height = (height + 2 * pad[0] - dil[0] * (k[0] - 1) - 1) // st[0] + 1
            width = (width + 2 * pad[1] - dil[1] * (k[1] - 1) - 1) // st[1] + 1
        elif isinstance(layer, _NodeFlatten):
            return True
    return False


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


def _layer(module: nn.Module, name: str, in_place: bool) -> _Layer:
    """The :class:`_Layer` of a module of the chain; ``Unsupported`` if none."""
    if not isinstance(module, STEP_LAYERS):
        raise Unsupported(f"no written-out backward for {module}")
    if isinstance(module, nn.Conv1d | nn.Conv2d):
        return _Conv(module, name)
    if isinstance(module, nn.Linear):
        return _Linear(name, module.bias is not None)
    if isinstance(module, nn.ReLU):
        return _ReLU(in_place)
    if isinstance(module, nn.MaxPool2d):
        return _MaxPool(module)
    if isinstance(module, nn.Flatten):
        if (module.start_dim, module.end_dim) != (1, -1):
            raise Unsupported("Flatten other than (1, -1)")
        return _Flatten()
    return _Layer()  # Identity


def _node_rows(w: torch.Tensor) -> torch.Tensor:
    """``w`` (``(nodes, out, ...)``) as ``(nodes x out, ...)``, a view: the
    weights move in place through it."""
    try:
        return w.view(-1, *w.shape[2:])
    except RuntimeError as err:
        raise ValueError(
            "stacked parameters must be contiguous (or as lay_out makes them) "
            "to move in place"
        ) from err


def _proximal(params: dict[str, torch.Tensor], rates: Rates, name: str) -> None:
    """``w -= lr mu (w - w0)`` for every node (FedProx), when any has a ``mu``."""
    if not rates.anchors:
        return
    w = params[name]
    shape = (-1,) + (1,) * (w.dim() - 1)
    w.sub_((rates.lr * rates.mu).view(shape) * (w - rates.anchors[name]))


_STEPS: weakref.WeakKeyDictionary[GroupedForward, GroupedSGD | None] = (
    weakref.WeakKeyDictionary()
)
"""Written-out steps by grouped forward pass (None: the model needs autograd)."""


def grouped_sgd(grouped: GroupedForward | None) -> GroupedSGD | None:
    """The written-out SGD step of a grouped model, or None if it needs autograd
    (cached)."""
    if grouped is None:
        return None
    if grouped not in _STEPS:
        try:
            _STEPS[grouped] = GroupedSGD(grouped)
        except Unsupported:
            _STEPS[grouped] = None
    return _STEPS[grouped]
