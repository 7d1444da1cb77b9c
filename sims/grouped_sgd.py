"""One SGD step of many nodes at once, its backward pass written out.

:class:`GroupedSGD` runs a chain of the layer library's layers whose backward
pass is written out (:mod:`flowerbed.sims.layers`: convolutions, linear layers,
ReLU, 2-D max pooling, flatten; LeNet, the 1-D CNN, the MLP and logistic
regression of the zoo) for every node as
:class:`~flowerbed.sims.grouped.GroupedForward` does, then walks the chain back
by each layer's ``backward`` and updates each node's weights in
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

When every 2-D convolution of the chain is one the node layout's kernels take
(numba's, :mod:`flowerbed.sims.numba_kernels`, by default; the C ones of
:mod:`flowerbed.sims.conv_kernels` opted in) and the batch is whole vectors of
samples,
:meth:`GroupedSGD.pack` lays the images out as ``(nodes, H, W, C, batch)`` and
the step runs the same layer objects in that layout (:mod:`flowerbed.sims.layers`,
the node layout): the kernels for the
convolutions and for max pooling over windows that do not overlap (a 10-node
LeNet step 1.46 -> ~0.72 ms here; other pooling by PyTorch on the same memory
seen as channels-last planes), one copy at the flatten.
"""

from __future__ import annotations

import weakref

import torch
from flowerbed.clients.training import log_softmax
from flowerbed.sims.conv_kernels import (
    LANES,
    ConvShape,
    PoolShape,
    eligible,
    pair,
    pool_eligible,
)
from flowerbed.sims.grouped import GroupedForward, grouped_inputs
from flowerbed.sims.layers import (
    Backprop,
    Conv,
    Flatten,
    Grouped,
    Layer,
    Linear,
    MaxPool,
    Rates,
    ReLU,
    Unsupported,
    Weighted,
    built_once,
    layer_of,
    pool_before_relu,
)
from flowerbed.sims.numba_kernels import kernels_for, pool_kernels_for
from torch import nn

__all__ = ["GroupedSGD", "Rates", "grouped_sgd"]


class GroupedSGD:
    """Plain SGD steps on a chain of the layer library's layers for many nodes
    at once, each layer's backward written out
    (:attr:`~flowerbed.sims.layers.Layer.WRITTEN_BACKWARD`).

    Raises :class:`~flowerbed.sims.layers.Unsupported` for a model whose trace
    is not such a chain (residual additions, layers differentiated by
    autograd): train it with autograd.
    """

    def __init__(self, grouped: GroupedForward) -> None:
        chain = grouped.traced.chain
        if chain is None:
            raise Unsupported("not a chain of layers, each fed by the one before")
        chain = pool_before_relu(chain)
        layers: list[Layer] = []
        for module, name in chain:
            layer = layer_of(module, name)
            if not layer.WRITTEN_BACKWARD:
                raise Unsupported(f"no written-out backward for {module}")
            # in place after a layer whose backward pass does not read its output
            if isinstance(layer, ReLU):
                layer.in_place = bool(layers) and isinstance(
                    layers[-1], Weighted | MaxPool
                )
            if isinstance(layer, MaxPool):  # for its backward, in inference mode
                layer.keep_indices = True
            layers.append(layer)
        self.layers = layers
        self.node_layout = _takes_node_layout(chain, layers)
        self._node_inputs: dict[tuple[int, ...], bool] = {}

    def pack(self, x: torch.Tensor) -> list[Grouped]:
        """Each step's inputs, ``(steps, nodes, batch, *features)``, laid out
        for :meth:`step`: for the node layout's kernels
        (:func:`~flowerbed.sims.numba_kernels.kernels_for`) when every
        convolution of the chain has them at this image size (``(nodes, H, W,
        C, batch)``, one copy for all steps), else as
        :func:`~flowerbed.sims.grouped.grouped_inputs` lays them out for
        oneDNN.

        The kernels take whole vectors of samples: a batch that is not is
        padded with zero images up to the next multiple of
        :data:`~flowerbed.sims.conv_kernels.LANES` when that at most doubles
        it (:meth:`step` gives the padding no gradient). Measured here for
        LeNet, a step of 100 nodes on 9-14 digits each 7.4-7.7 ms padded to 16
        against 10.2-14.6 ms on oneDNN, of 1,000 nodes on 8 each 112 against
        138 ms; on 4 or fewer oneDNN is faster (97 against 111 ms).
        """
        if x.dim() == 6 and self.node_layout:
            steps, n, batch = x.shape[:3]
            padded = -(-batch // LANES) * LANES
            if padded <= 2 * batch and self.kernels_ready((padded, *x.shape[3:])):
                packed = x.new_zeros(steps, n, *x.shape[4:], x.shape[3], padded)
                packed[..., :batch] = x.permute(0, 1, 4, 5, 3, 2)
                return [(p, True) for p in packed.unbind(0)]
        return grouped_inputs(x)

    def kernels_ready(self, sample: tuple[int, ...]) -> bool:
        """Whether the node layout runs a batch of ``(batch, C, H, W)`` images
        (every convolution has kernels: cached per size)."""
        if not self.node_layout:
            return False
        if sample not in self._node_inputs:
            self._node_inputs[sample] = _plan_kernels(self.layers, *sample)
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
            if isinstance(layer, Conv) and len(layer.stride) == 2:
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
            layers = self.layers  # each takes the layout pack chose
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
                    grad, Backprop(h_in, grouped_in, saved, params, rates, i > 0)
                )
        return losses


def _takes_node_layout(chain: list[tuple[nn.Module, str]], layers: list[Layer]) -> bool:
    """Whether the chain can run in the node layout: a 2-D convolution the
    kernels take (checked for a batch of one vector; the kernels of any
    other are refused), no layer that would see images in another layout (a
    1-D convolution, a linear layer before flattening), and a flatten."""
    convolutions = 0
    for (module, _), layer in zip(chain, layers, strict=True):
        if isinstance(layer, Flatten):
            return convolutions > 0
        if not layer.NODE_LAYOUT or isinstance(layer, Linear):
            return False
        if isinstance(layer, Conv):
            # its own settings: any whole batch
            if not isinstance(module, nn.Conv2d) or not eligible(module, LANES):
                return False
            convolutions += 1
    return False


def _plan_kernels(
    layers: list[Layer], batch: int, c: int, height: int, width: int
) -> bool:
    """Find the kernels of every convolution for inputs of this size; False if
    one has none (turned off, numba missing, or the batch is not whole
    vectors)."""
    for layer in layers:
        if isinstance(layer, Conv):
            module = layer.module
            assert isinstance(module, nn.Conv2d)  # _takes_node_layout checked it
            if module.in_channels != c:
                return False
            shape = ConvShape.of(module, height, width, batch)
            kernels = kernels_for(shape)
            if kernels is None:
                return False
            layer.kernels[(height, width, batch)] = kernels
            c, height, width = shape.o, shape.ho, shape.wo
        elif isinstance(layer, MaxPool):
            kernel, stride, padding, dilation, ceil_mode = layer.args
            if ceil_mode:
                return False
            assert isinstance(layer.module, nn.MaxPool2d)
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
        elif isinstance(layer, Flatten):
            return True
    return False


_STEPS: weakref.WeakKeyDictionary[GroupedForward, GroupedSGD | None] = (
    weakref.WeakKeyDictionary()
)
"""Written-out steps by grouped forward pass (None: the model needs autograd)."""


def grouped_sgd(grouped: GroupedForward | None) -> GroupedSGD | None:
    """The written-out SGD step of a grouped model, or None if it needs autograd
    (cached)."""
    if grouped is None:
        return None
    return built_once(_STEPS, grouped, GroupedSGD)
