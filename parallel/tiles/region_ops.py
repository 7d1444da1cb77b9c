"""A model's tiled front in torch: layer geometry, ops on regions, shared norms.

:func:`front_geometry` reads an ``nn.Sequential`` into the pure description the
planner uses (:class:`~flowerbed.parallel.tiles.layout.FrontGeometry`): the
operations of every top-level layer that can be tiled, and the costs of the rest.
:class:`RegionOp` runs one operation on the region a device holds
(:class:`~flowerbed.parallel.tiles.regions.OpRegion`): it slices what the op reads,
pads only at true image borders (zeros; ``-inf`` for max pooling) and applies the
op with no padding of its own, so the result equals the same pixels of the
full-map computation.

Supported inside the tiled front (anything else ends the front; asking to tile it
is a :class:`~flowerbed.parallel.tiles.regions.TileError` naming the layer):

- windows: ``Conv2d`` (zero padding, any stride/dilation/groups),
  ``MaxPool2d`` and ``AvgPool2d`` (no ``ceil_mode``; average pooling with
  padding only with ``count_include_pad``);
- point-wise: the activations in :data:`POINTWISE_TYPES`, ``Identity``;
- normalisation: ``GroupNorm`` and ``BatchNorm2d`` (see below);
- ``nn.Sequential`` of these (its children are flattened).

Normalisation. Batch norm normalises by statistics over the
batch and the *whole* map, group norm over a group of channels and the whole map
of each sample; a tile's own pixels give different statistics. In ``sync`` mode
(default) :class:`SharedNorm` makes them exact: every device sums ``x`` and
``x**2`` over the pixels it *owns* (each pixel of the map counted once across
devices), one all-reduce gives the full-map mean and variance, and every device
normalises its whole region (halo included) with them. Backward needs two more
full-map sums (of ``g = dy * gamma`` and ``g * x_hat``): each device sums its
local contributions over its *whole* region (halo gradients are partial sums of
the same pixels' gradients), one all-reduce, and the mean terms are subtracted on
owned pixels only, so each is counted once::

    dx = rstd * (g - [owned] * (sum(g) + x_hat * sum(g * x_hat)) / M)

(the batch-norm backward of Ioffe and Szegedy, ICML 2015, Sec. 3, with its
sums split across devices). Running statistics are updated as torch does
(unbiased variance, ``momentum``). In ``frozen`` mode batch norm uses its
running statistics (``eval()`` behaviour; a point-wise affine map, no
communication, exact against single-device training with the same layers
frozen); its weight and bias still train. Group norm is always ``sync``.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .layout import FrontGeometry
from .regions import (
    NEG_INF,
    NORM,
    POINTWISE,
    WINDOW,
    ZERO,
    Op,
    OpRegion,
    TileError,
    map_shapes,
)

NORM_SYNC = "sync"
NORM_FROZEN = "frozen"
NORM_MODES = (NORM_SYNC, NORM_FROZEN)

POINTWISE_TYPES: tuple[type[nn.Module], ...] = (
    nn.ReLU,
    nn.ReLU6,
    nn.LeakyReLU,
    nn.ELU,
    nn.SELU,
    nn.CELU,
    nn.GELU,
    nn.SiLU,
    nn.Mish,
    nn.Sigmoid,
    nn.Tanh,
    nn.Hardswish,
    nn.Hardsigmoid,
    nn.Hardtanh,
    nn.Softplus,
    nn.PReLU,
    nn.Identity,
)
"""Element-wise layers the tracer accepts (PReLU: one or per-channel slopes)."""
SUPPORTED = (
    "Conv2d (zero padding), MaxPool2d, AvgPool2d (no ceil_mode), BatchNorm2d, "
    "GroupNorm, "
    + ", ".join(t.__name__ for t in POINTWISE_TYPES)
    + ", and nn.Sequential of these"
)
"""What the tracer knows, for error messages."""


def _pair(value: Any) -> tuple[int, int]:
    if isinstance(value, int):
        return value, value
    return int(value[0]), int(value[1])


def _params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


def _unsupported(name: str, module: nn.Module, why: str = "") -> TileError:
    detail = f" ({why})" if why else ""
    return TileError(
        f"layer {name} ({type(module).__name__}) cannot be tiled{detail}; the tile "
        f"tracer supports {SUPPORTED}. Keep it in the head: tile only the layers "
        "before it"
    )


def op_of(name: str, module: nn.Module, in_channels: int, norm: str) -> Op:
    """The geometry of one leaf module (TileError for what is not supported)."""
    label = f"{name} ({type(module).__name__})"
    if isinstance(module, nn.Conv2d):
        if module.padding_mode != "zeros":
            raise _unsupported(name, module, f"padding_mode {module.padding_mode!r}")
        kernel, stride = _pair(module.kernel_size), _pair(module.stride)
        dilation = _pair(module.dilation)
        if isinstance(module.padding, str):
            if module.padding == "valid":
                padding = (0, 0)
            else:  # "same" (stride 1): symmetric only when d*(k-1) is even
                total = [dilation[a] * (kernel[a] - 1) for a in (0, 1)]
                if any(t % 2 for t in total):
                    raise _unsupported(name, module, "asymmetric 'same' padding")
                padding = (total[0] // 2, total[1] // 2)
        else:
            padding = _pair(module.padding)
        geometry = (kernel, stride, padding, dilation)
        return Op(
            label,
            WINDOW,
            *geometry,
            out_channels=module.out_channels,
            macs_per_pixel=module.out_channels
            * (module.in_channels // module.groups)
            * kernel[0]
            * kernel[1],
            params=_params(module),
        )
    if isinstance(module, nn.MaxPool2d | nn.AvgPool2d):
        if module.ceil_mode:
            raise _unsupported(name, module, "ceil_mode=True")
        if isinstance(module, nn.MaxPool2d) and module.return_indices:
            raise _unsupported(name, module, "return_indices=True")
        padding = _pair(module.padding)
        if (
            isinstance(module, nn.AvgPool2d)
            and not module.count_include_pad
            and any(padding)
        ):
            raise _unsupported(name, module, "padding with count_include_pad=False")
        kernel = _pair(module.kernel_size)
        stride = _pair(module.stride if module.stride is not None else kernel)
        dilation = _pair(getattr(module, "dilation", 1))
        geometry = (kernel, stride, padding, dilation)
        return Op(
            label,
            WINDOW,
            *geometry,
            pad_value=NEG_INF if isinstance(module, nn.MaxPool2d) else ZERO,
        )
    if isinstance(module, nn.BatchNorm2d):
        if norm == NORM_FROZEN:
            if not module.track_running_stats:
                raise _unsupported(
                    name, module, "frozen batch norm needs track_running_stats"
                )
            return Op(label, POINTWISE, params=_params(module))
        return Op(label, NORM, params=_params(module), stats=module.num_features)
    if isinstance(module, nn.GroupNorm):
        return Op(
            label,
            NORM,
            params=_params(module),
            stats=module.num_groups,
            stats_per_sample=True,
        )
    if isinstance(module, POINTWISE_TYPES):
        return Op(label, POINTWISE, params=_params(module))
    raise _unsupported(name, module)


def leaves(name: str, module: nn.Module) -> list[tuple[str, nn.Module]]:
    """A top-level layer's leaf modules in order (nested Sequentials flattened)."""
    if isinstance(module, nn.Sequential):
        found: list[tuple[str, nn.Module]] = []
        for child_name, child in module.named_children():
            found += leaves(f"{name}.{child_name}", child)
        return found
    return [(name, module)]


def layer_ops(
    index: int, layer: nn.Module, in_channels: int, norm: str
) -> list[tuple[Op, nn.Module]]:
    """Ops of top-level layer ``index`` with their modules (TileError if any is
    not supported)."""
    ops = []
    channels = in_channels
    for name, module in leaves(str(index), layer):
        op = op_of(name, module, channels, norm)
        channels = op.channels(channels)
        ops.append((op, module))
    return ops


def check_norm(norm: str) -> str:
    if norm not in NORM_MODES:
        raise TileError(
            f"normalisation mode {norm!r}; valid choices: {', '.join(NORM_MODES)}"
        )
    return norm


def front_geometry(
    model: nn.Sequential,
    in_shape: Sequence[int],
    norm: str = NORM_SYNC,
    *,
    costs: bool = True,
) -> FrontGeometry:
    """The planner's view of ``model`` for samples of ``in_shape`` (C, H, W).

    The tileable front is the longest prefix of top-level layers whose ops are
    all supported and whose maps stay at least 1x1; the last layer always stays
    in the head (it produces the logits the loss needs). ``costs=False`` skips
    the head's MAC and activation counts (a forward pass; members do not need
    them) and leaves them 0.
    """
    check_norm(norm)
    if len(in_shape) != 3:
        raise TileError(f"input shape {list(in_shape)} must be (channels, h, w)")
    shape = (int(in_shape[0]), int(in_shape[1]), int(in_shape[2]))
    layers: list[tuple[Op, ...]] = []
    stop = ""
    current = shape
    for index, layer in enumerate(model):
        if index == len(model) - 1:
            stop = f"layer {index} is the model's last (the head keeps it)"
            break
        try:
            ops = [op for op, _ in layer_ops(index, layer, current[0], norm)]
            current = map_shapes(ops, current)[-1]
        except TileError as err:
            stop = str(err)
            break
        layers.append(tuple(ops))
    if costs:
        macs, elements = per_layer_costs(model, torch.zeros((1, *shape)))
    else:
        macs, elements = [0] * len(model), [0] * len(model)
    tileable = len(layers)
    head_macs = tuple(sum(macs[f:]) for f in range(tileable + 1))
    head_elements = tuple(sum(elements[f:]) for f in range(tileable + 1))
    return FrontGeometry(
        in_shape=shape,
        layers=tuple(layers),
        num_layers=len(model),
        layer_params=tuple(_params(layer) for layer in model),
        head_macs=head_macs,
        head_elements=head_elements,
        stop=stop,
    )


def per_layer_costs(
    model: nn.Sequential, sample: torch.Tensor
) -> tuple[list[int], list[int]]:
    """Per top-level layer: forward MACs and activation elements per sample
    (outputs of its leaf modules), for one sample ``sample`` (batch of 1)."""
    from flowerbed.models import count_macs

    macs, elements = [], []
    x = sample
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for layer in model:
                macs.append(count_macs(layer, x))
                total = 0

                def hook(_m: nn.Module, _i: object, out: object) -> None:
                    nonlocal total
                    if isinstance(out, torch.Tensor):
                        total += out.numel()

                handles = [
                    m.register_forward_hook(hook)
                    for _, m in leaves("", layer)
                    if not isinstance(m, nn.Sequential)
                ]
                try:
                    x = layer(x)
                finally:
                    for handle in handles:
                        handle.remove()
                elements.append(total)
    finally:
        model.train(was_training)
    return macs, elements


# --------------------------------------------------------------------------------
# Running ops on regions
# --------------------------------------------------------------------------------

Collective = Callable[[torch.Tensor], None]
"""Sums a tensor in place across the job's devices (an all-reduce)."""


def _no_collective(_: torch.Tensor) -> None:
    return None


@dataclass
class NormContext:
    """What a shared normalisation needs besides its module: the all-reduce, the
    map's full pixel count and the device's owned cell (relative to its region)."""

    reduce: Collective
    map_pixels: int
    owned: tuple[int, int, int, int]


class _SharedNorm(torch.autograd.Function):
    """Batch/group normalisation with statistics summed across devices.

    ``x`` is viewed as ``(N, S, K, h, w)``: ``S`` statistic groups per sample
    (group norm: groups; batch norm: channels, with ``N`` folded in by the
    caller's sum axes), ``K`` channels per group.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        spec: tuple[str, int, float],
        norm: NormContext,
        running: tuple[torch.Tensor, torch.Tensor, float] | None,
    ) -> torch.Tensor:
        kind, groups, eps = spec
        n, c, h, w = x.shape
        view = x.reshape(n, groups, c // groups, h, w)
        top, bottom, left, right = norm.owned
        owned = view[:, :, :, top:bottom, left:right].double()
        axes = (0, 2, 3, 4) if kind == "batch" else (2, 3, 4)
        count = norm.map_pixels * (c // groups) * (n if kind == "batch" else 1)
        sums = torch.cat(
            [owned.sum(axes).reshape(-1), owned.square().sum(axes).reshape(-1)]
        )
        norm.reduce(sums)
        half = sums.numel() // 2
        mean = sums[:half] / count
        var = (sums[half:] / count - mean.square()).clamp_min(0.0)
        rstd = (var + eps).rsqrt()
        shape = (1, groups, 1, 1, 1) if kind == "batch" else (n, groups, 1, 1, 1)
        x_hat = ((view.double() - mean.reshape(shape)) * rstd.reshape(shape)).to(
            x.dtype
        )
        x_hat = x_hat.reshape(n, c, h, w)
        if running is not None:
            running_mean, running_var, factor = running
            with torch.no_grad():
                running_mean.mul_(1 - factor).add_(factor * mean.to(running_mean.dtype))
                unbiased = var * count / max(count - 1, 1)
                running_var.mul_(1 - factor).add_(
                    factor * unbiased.to(running_var.dtype)
                )
        out = x_hat
        if weight is not None:
            out = out * weight.reshape(1, c, 1, 1)
        if bias is not None:
            out = out + bias.reshape(1, c, 1, 1)
        ctx.save_for_backward(x_hat, rstd, weight)
        ctx.spec, ctx.norm, ctx.count = spec, norm, count
        ctx.has_bias = bias is not None
        return out

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        x_hat, rstd, weight = ctx.saved_tensors
        kind, groups, _ = ctx.spec
        norm: NormContext = ctx.norm
        n, c, h, w = dy.shape
        d_weight = (dy * x_hat).sum((0, 2, 3)) if weight is not None else None
        d_bias = dy.sum((0, 2, 3)) if ctx.has_bias else None
        g = dy * weight.reshape(1, c, 1, 1) if weight is not None else dy
        gv = g.reshape(n, groups, c // groups, h, w).double()
        xv = x_hat.reshape(n, groups, c // groups, h, w).double()
        axes = (0, 2, 3, 4) if kind == "batch" else (2, 3, 4)
        sums = torch.cat([gv.sum(axes).reshape(-1), (gv * xv).sum(axes).reshape(-1)])
        norm.reduce(sums)
        half = sums.numel() // 2
        shape = (1, groups, 1, 1, 1) if kind == "batch" else (n, groups, 1, 1, 1)
        mean_g = (sums[:half] / ctx.count).reshape(shape)
        mean_gx = (sums[half:] / ctx.count).reshape(shape)
        r = rstd.reshape(shape)
        dx = gv * r
        top, bottom, left, right = norm.owned
        owned = (
            slice(None),
            slice(None),
            slice(None),
            slice(top, bottom),
            slice(left, right),
        )
        dx[owned] -= r * (mean_g + xv[owned] * mean_gx)
        return dx.to(dy.dtype).reshape(n, c, h, w), d_weight, d_bias, None, None, None


def shared_norm(
    module: nn.BatchNorm2d | nn.GroupNorm, x: torch.Tensor, norm: NormContext
) -> torch.Tensor:
    """Apply ``module`` to a region ``x`` with full-map statistics (module doc)."""
    weight = module.weight if module.affine else None
    bias = module.bias if module.affine else None
    running = None
    if isinstance(module, nn.GroupNorm):
        spec = ("group", module.num_groups, module.eps)
    else:
        spec = ("batch", module.num_features, module.eps)
        if module.training and module.track_running_stats:
            assert module.running_mean is not None and module.running_var is not None
            assert module.num_batches_tracked is not None
            module.num_batches_tracked.add_(1)
            factor = (
                1.0 / float(module.num_batches_tracked)
                if module.momentum is None
                else module.momentum
            )
            running = (module.running_mean, module.running_var, factor)
        elif not module.training and module.track_running_stats:
            return F.batch_norm(
                x,
                module.running_mean,
                module.running_var,
                weight,
                bias,
                False,
                0.0,
                module.eps,
            )
    out: torch.Tensor = _SharedNorm.apply(x, weight, bias, spec, norm, running)
    return out


class RegionOp:
    """One op of a group as one device runs it on its region (module doc)."""

    def __init__(self, module: nn.Module, norm_mode: str) -> None:
        if getattr(module, "inplace", False):
            module = copy.copy(module)
            module.inplace = False  # type: ignore[assignment]
        self.module = module
        self.norm_mode = norm_mode

    def __call__(
        self, region: OpRegion, x: torch.Tensor, reduce: Collective = _no_collective
    ) -> torch.Tensor:
        op, m = region.op, self.module
        _, h, w = region.in_shape
        if op.kind == WINDOW:
            inner = region.need.clip(h, w).relative_to(region.held)
            xs = x[:, :, inner.top : inner.bottom, inner.left : inner.right]
            top, bottom, left, right = region.padding
            if top or bottom or left or right:
                value = -math.inf if op.pad_value == NEG_INF else 0.0
                xs = F.pad(xs, (left, right, top, bottom), value=value)
            return self._window(xs)
        inner = region.out.relative_to(region.held)
        xs = x[:, :, inner.top : inner.bottom, inner.left : inner.right]
        if op.kind == POINTWISE:
            if isinstance(m, nn.BatchNorm2d):  # frozen: running statistics
                return F.batch_norm(
                    xs,
                    m.running_mean,
                    m.running_var,
                    m.weight,
                    m.bias,
                    False,
                    0.0,
                    m.eps,
                )
            out: torch.Tensor = m(xs)
            return out
        assert op.kind == NORM and isinstance(m, nn.BatchNorm2d | nn.GroupNorm)
        owned = region.owned.relative_to(region.out).as_tuple()
        context = NormContext(reduce, region.out_shape[1] * region.out_shape[2], owned)
        return shared_norm(m, xs, context)

    def _window(self, xs: torch.Tensor) -> torch.Tensor:
        m = self.module
        if isinstance(m, nn.Conv2d):
            return F.conv2d(xs, m.weight, m.bias, m.stride, 0, m.dilation, m.groups)
        if isinstance(m, nn.MaxPool2d):
            return F.max_pool2d(xs, m.kernel_size, m.stride, 0, m.dilation)
        assert isinstance(m, nn.AvgPool2d)
        return F.avg_pool2d(
            xs,
            m.kernel_size,
            m.stride,
            0,
            False,
            True,
            m.divisor_override,
        )


def run_group(
    ops: Sequence[RegionOp],
    regions: Sequence[OpRegion],
    x: torch.Tensor,
    reduce: Collective = _no_collective,
) -> torch.Tensor:
    """A device's forward through one fused group: input region -> its tile."""
    for op, region in zip(ops, regions, strict=True):
        x = op(region, x, reduce)
    return x


def freeze_front_norms(model: nn.Sequential, front: int) -> None:
    """Put the batch norms of the first ``front`` layers in eval mode (the
    single-device equivalent of ``frozen`` mode)."""
    for layer in list(model)[:front]:
        for module in layer.modules():
            if isinstance(module, nn.BatchNorm2d):
                module.eval()
