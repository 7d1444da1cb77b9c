"""Batch norm in phone training programs: trained as it is, or replaced by group norm.

``flowerbed export-android`` handles a model's BatchNorm layers in one of three ways
(``--batchnorm``):

- ``train`` (the default): the layers stay batch norm. The training program normalises
  each batch by its own statistics, as ``torch.nn.BatchNorm*d`` does in training mode
  (Ioffe & Szegedy, ICML 2015, Alg. 1), and carries the running statistics as *state*:
  the program takes each layer's ``running_mean`` and ``running_var`` as inputs and
  returns them updated,

      running_mean <- (1 - momentum) * running_mean + momentum * batch_mean
      running_var  <- (1 - momentum) * running_var  + momentum * batch_var_unbiased

  (PyTorch's update rule, ``torch.nn.BatchNorm2d`` documentation), so the phone feeds
  each step's output to the next step and sends the final statistics back with the
  weights, under their ``state_dict`` names. Flower averages them like any other array
  (FedAvg of batch-norm statistics, as in McMahan et al.'s FedAvg). The evaluation
  program normalises with the running statistics, as ``model.eval()`` does.
  ``num_batches_tracked`` is not needed with a ``momentum`` (PyTorch reads it only when
  ``momentum=None``) and is not float32, so it is removed from the model
  (:func:`prepare_batchnorm`); a layer with ``momentum=None`` is refused.
- ``groupnorm``: every BatchNorm is replaced by a GroupNorm (Wu & He, ECCV 2018) with
  the same ``weight`` and ``bias`` (:func:`replace_batchnorm`).
- ``refuse``: a model with batch norm is refused.

The exported graphs use batch norm written in primitive operators
(:class:`PrimitiveBatchNorm`): ``torch.export`` turns ``nn.BatchNorm2d`` in training
mode into ``_native_batch_norm_legit_functional``, which is not in the core ATen
operator set ExecuTorch lowers, and its decomposition does not functionalise; means,
products and
``rsqrt`` have portable kernels forward and backward.
"""

from __future__ import annotations

from typing import Literal

import torch
from flowerbed.clients.export_android_cli import BATCHNORM_MODES
from flowerbed.models import group_norm
from torch import nn

BatchNormMode = Literal["train", "groupnorm", "refuse"]
"""One of :data:`BATCHNORM_MODES` (``export-android --batchnorm``)."""

_BatchNorm = nn.modules.batchnorm._BatchNorm


def batchnorm_layers(model: nn.Module) -> list[str]:
    """Names of ``model``'s BatchNorm1d/2d/3d layers, in module order."""
    return [name for name, m in model.named_modules() if isinstance(m, _BatchNorm)]


def replace_batchnorm(model: nn.Module) -> list[str]:
    """Replace every BatchNorm1d/2d/3d of ``model`` by a GroupNorm, in place.

    Group norm normalises each sample on its own (Wu & He, ECCV 2018) and has the same
    ``weight`` and ``bias`` parameters under the same names, which are copied; the
    running statistics are dropped. Call it on the ServerApp's model too, so the
    arrays Flower sends are the program's parameters.

    Returns the names of the layers replaced.
    """
    replaced = []
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, _BatchNorm):
                norm = group_norm(child.num_features, child.affine, child.eps)
                if child.affine:
                    with torch.no_grad():
                        norm.weight.copy_(child.weight)
                        norm.bias.copy_(child.bias)
                setattr(module, child_name, norm)
                replaced.append(f"{name}.{child_name}" if name else child_name)
    return replaced


def prepare_batchnorm(model: nn.Module, mode: BatchNormMode = "train") -> list[str]:
    """Make ``model``'s batch norm what a phone program of ``mode`` trains, in place.

    Apply it to the ServerApp's model as well, so that the arrays Flower sends are
    exactly the program's parameters and state. Load a torch checkpoint (which holds
    ``num_batches_tracked``) before calling it; arrays that phones trained can be
    loaded after it.

    - ``"train"``: removes ``num_batches_tracked`` from every BatchNorm (``state_dict``
      keeps the weights and the float32 running statistics);
    - ``"groupnorm"``: :func:`replace_batchnorm`;
    - ``"refuse"``: changes nothing.

    Returns the names of the BatchNorm layers found (replaced, for ``"groupnorm"``).

    Raises
    ------
    ValueError
        For an unknown ``mode`` (the message lists the choices); for ``"train"``, a
        layer with ``momentum=None`` (a cumulative average needs the int64 batch
        counter); for ``"refuse"``, any BatchNorm layer.
    """
    if mode not in BATCHNORM_MODES:
        raise ValueError(
            f"batchnorm must be one of {', '.join(BATCHNORM_MODES)}, got {mode!r}"
        )
    layers = batchnorm_layers(model)
    if mode == "groupnorm":
        return replace_batchnorm(model)
    if mode == "refuse":
        if layers:
            raise ValueError(
                f"model has batch norm layers {layers}; export them with "
                "--batchnorm train (running statistics carried as state) or groupnorm"
            )
        return []
    cumulative = [
        n
        for n, m in model.named_modules()
        if isinstance(m, _BatchNorm) and m.track_running_stats and m.momentum is None
    ]
    if cumulative:
        raise ValueError(
            f"batch norm layers {cumulative} have momentum=None (a cumulative average "
            "over an int64 batch counter, which phones do not exchange); give them a "
            "momentum (PyTorch's default is 0.1) or export with --batchnorm groupnorm"
        )
    for module in model.modules():
        if isinstance(module, _BatchNorm) and module.num_batches_tracked is not None:
            module.register_buffer("num_batches_tracked", None)
    return layers


def state_names(model: nn.Module) -> list[str]:
    """The running statistics a ``"train"`` program carries, in its order: for each
    BatchNorm that tracks them, ``<layer>.running_mean`` then ``.running_var``."""
    return [
        f"{name}.{stat}"
        for name, m in model.named_modules()
        if isinstance(m, _BatchNorm) and m.track_running_stats
        for stat in ("running_mean", "running_var")
    ]


class PrimitiveBatchNorm(nn.Module):
    """A BatchNorm layer in primitive operators, its running statistics passed in.

    It holds the layer's own ``weight`` and ``bias`` parameters (so their names do not
    change). Before each call, the program sets :attr:`running` (the running mean and
    variance, or None for a layer that does not track them); in training mode the call
    leaves the updated statistics in :attr:`updated`. In evaluation mode
    (:attr:`evaluating`) a layer that tracks statistics normalises with them.
    """

    def __init__(self, norm: nn.modules.batchnorm._BatchNorm) -> None:
        super().__init__()
        self.weight = norm.weight
        self.bias = norm.bias
        self.eps = float(norm.eps)
        self.momentum = float(norm.momentum) if norm.momentum is not None else 0.0
        self.tracks = bool(norm.track_running_stats)
        self.evaluating = False
        self.running: tuple[torch.Tensor, torch.Tensor] | None = None
        self.updated: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dims = [0, *range(2, x.dim())]
        shape = [1, x.shape[1]] + [1] * (x.dim() - 2)
        if self.evaluating and self.tracks:
            assert self.running is not None
            mean, var = self.running
            centred = x - mean.reshape(shape)
        else:
            mean = x.mean(dims)
            centred = x - mean.reshape(shape)
            # The biased variance normalises, as in torch; the product form avoids
            # var's backward, whose symbolic sample count ExecuTorch cannot emit.
            var = (centred * centred).mean(dims)
            if self.tracks and not self.evaluating:
                assert self.running is not None
                running_mean, running_var = self.running
                unbiased = x.detach().var(dims, correction=1)
                m = self.momentum
                self.updated = (
                    running_mean * (1 - m) + mean.detach() * m,
                    running_var * (1 - m) + unbiased * m,
                )
        y = centred * torch.rsqrt(var.reshape(shape) + self.eps)
        if self.weight is not None:
            y = y * self.weight.reshape(shape) + self.bias.reshape(shape)
        return y


def to_primitive_batchnorm(model: nn.Module) -> list[PrimitiveBatchNorm]:
    """Replace ``model``'s BatchNorm layers by :class:`PrimitiveBatchNorm`, in place
    (use it on a copy). Returns those that track statistics, in :func:`state_names`
    order."""
    tracking = []
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, _BatchNorm):
                layer = PrimitiveBatchNorm(child)
                setattr(module, child_name, layer)
    for module in model.modules():
        if isinstance(module, PrimitiveBatchNorm) and module.tracks:
            tracking.append(module)
    return tracking


def feed_state(
    layers: list[PrimitiveBatchNorm],
    state: tuple[torch.Tensor, ...],
    *,
    evaluating: bool,
) -> None:
    """Give each layer its running statistics from ``state`` (two per layer)."""
    for i, layer in enumerate(layers):
        layer.running = (state[2 * i], state[2 * i + 1])
        layer.evaluating = evaluating
        layer.updated = None


def updated_state(layers: list[PrimitiveBatchNorm]) -> list[torch.Tensor]:
    """The statistics the layers left after a training-mode call, in state order."""
    out: list[torch.Tensor] = []
    for layer in layers:
        assert layer.updated is not None
        out.extend(layer.updated)
    return out
