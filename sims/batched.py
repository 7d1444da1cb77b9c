"""Train many copies of one architecture at once, each on its own data and weights.

:func:`train_many` is :func:`flowerbed.clients.training.train_steps` for a group of
nodes that share a model architecture: their weights are stacked along a leading
node axis and every SGD step of every node is one vectorised computation (the
forward pass by ``torch.func.vmap`` over ``torch.func.functional_call``, as in
PyTorch's "Model ensembling" tutorial; the gradients by ordinary autograd), so
the per-operator overhead that dominates tiny models is paid once per step
instead of once per node and step. Each node keeps its own minibatch order (the
same seeded permutation ``train_steps`` draws), its own step count, learning
rate and FedProx term, so its result equals what ``train_steps`` computes for
it alone, within float tolerance (different kernels sum in a different order;
compare on the same convolution backend: PyTorch's oneDNN and native CPU paths
themselves differ by ~1e-3 in MobileNet's weights after one step on digits).

Under vmap a convolution becomes one grouped convolution over all nodes; oneDNN
runs those (and their backward pass) natively, where PyTorch's fallback loops
over the groups: measured here, 50 MobileNet nodes train 10x faster with oneDNN
on, so :func:`train_many` turns it on for its own computation only (per-node
training keeps it off: see :func:`flowerbed.sims.node.single_threaded`).

Models with buffers (batch-norm statistics) or random layers (dropout) cannot
be batched this way; :func:`batchable` says which can.

The forward pass of models built from standard layers (convolutions, linear
layers, activations, pooling, flatten, group norm, residual additions: every
model of the zoo) skips vmap: :class:`GroupedForward` traces the model once
with ``torch.fx`` and runs each layer on all nodes directly, images kept as
``(batch, nodes x channels, H, W)`` in channels-last memory, where oneDNN's
grouped convolution (``groups = nodes x groups``) is 2-3x faster than on the
channels-first tensors vmap's batching rule makes (measured here: a LeNet
node-step on digits 0.25 ms instead of 0.45-0.6 ms, at 10 to 1,000 nodes);
linear layers are one ``baddbmm`` over the node axis. Other models (or layers
it does not know) keep the vmap path.
"""

from __future__ import annotations

import functools
import operator
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from flowerbed.clients.training import TrainStats, minibatches
from torch import fx, nn
from torch.func import functional_call, vmap

UNBATCHABLE_LAYERS = (
    nn.modules.dropout._DropoutNd,
    nn.modules.batchnorm._NormBase,
)
"""Layers whose behaviour depends on randomness or on running statistics."""


def batchable(model: nn.Module) -> bool:
    """True when :func:`train_many` can train ``model``: no buffers or random layers."""
    if any(True for _ in model.buffers()):
        return False
    if not all(p.requires_grad for p in model.parameters()):
        return False
    return not any(isinstance(m, UNBATCHABLE_LAYERS) for m in model.modules())


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


@dataclass(frozen=True)
class NodeJob:
    """One node's share of a batched training call (``train_steps``'s arguments)."""

    weights: dict[str, torch.Tensor]
    x: np.ndarray
    y: np.ndarray
    steps: int
    batch_size: int
    lr: float
    seed: int
    proximal_mu: float = 0.0


def train_many(
    model: nn.Module, jobs: Sequence[NodeJob]
) -> list[tuple[dict[str, torch.Tensor], TrainStats]]:
    """Train every job from its own weights; return each one's weights and stats.

    Each job's weights are views of its row in one stacked tensor per array
    (not copies: the caller encodes them anyway).

    ``model`` gives the architecture only (its own weights are not used or
    changed). Jobs are grouped by batch size (one stacked computation per
    group); within a group, a job that has done its steps stops moving while the
    others go on.

    Raises
    ------
    ValueError
        When ``model`` is not :func:`batchable`, or a job has no samples or
        negative steps.
    """
    if not batchable(model):
        raise ValueError(
            f"{type(model).__name__} has buffers or random layers: train it per node"
        )
    keep_freed_memory()
    onednn = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = True  # type: ignore[assignment]
    try:
        return _train_groups(model, jobs)
    finally:
        torch.backends.mkldnn.enabled = onednn  # type: ignore[assignment]


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
"""glibc ``mallopt`` parameters (``<malloc.h>``)."""
HEAP_BLOCKS_UP_TO = 1 << 30
"""Allocations up to this size come from the heap once :func:`keep_freed_memory`
ran (glibc's default: up to 128 KiB, raised as blocks are freed, 32 MiB at most)."""


@functools.lru_cache(maxsize=1)
def keep_freed_memory() -> bool:
    """Let this process reuse freed tensor memory instead of returning it; True if done.

    A batched step allocates its activations and gradients afresh; at 1,000
    LeNet nodes several are tens of MB, above glibc's mmap threshold, so each
    is a fresh ``mmap`` whose pages the kernel faults in and zeroes, every
    step, and unmaps when freed. With the threshold at :data:`HEAP_BLOCKS_UP_TO`
    and trimming off, they come from the heap and the next step reuses them
    (measured here: ~10% more node-tasks per CPU-second at 1,000 nodes, no
    change at 10). The cost: the process keeps its peak memory for later
    instead of giving it back. glibc only (``mallopt``); elsewhere a no-op.
    Both are set together: setting the trim threshold alone also stops glibc
    from raising the mmap threshold, which is slower than doing nothing.
    """
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    if mallopt(M_MMAP_THRESHOLD, HEAP_BLOCKS_UP_TO) != 1:
        return False
    return bool(mallopt(M_TRIM_THRESHOLD, 2 * HEAP_BLOCKS_UP_TO) == 1)


def _train_groups(
    model: nn.Module, jobs: Sequence[NodeJob]
) -> list[tuple[dict[str, torch.Tensor], TrainStats]]:
    results: list[tuple[dict[str, torch.Tensor], TrainStats] | None] = [None] * len(
        jobs
    )
    groups: dict[int, list[int]] = {}
    for i, job in enumerate(jobs):
        if job.steps < 0:
            raise ValueError(f"steps must be >= 0, got {job.steps}")
        if len(job.x) == 0:
            raise ValueError("no training samples")
        batch = max(1, min(job.batch_size, len(job.x)))
        groups.setdefault(batch, []).append(i)
    for batch, members in groups.items():
        out = _train_group(model, [jobs[i] for i in members], batch)
        for i, result in zip(members, out, strict=True):
            results[i] = result
    return [r for r in results if r is not None]


def _train_group(
    model: nn.Module, jobs: Sequence[NodeJob], batch: int
) -> list[tuple[dict[str, torch.Tensor], TrainStats]]:
    names = [name for name, _ in model.named_parameters()]
    stacked = {
        name: torch.stack([job.weights[name].detach().float() for job in jobs])
        for name in names
    }
    proximal = any(job.proximal_mu for job in jobs)
    anchors = {name: t.clone() for name, t in stacked.items()} if proximal else {}
    n = len(jobs)
    steps = [job.steps for job in jobs]
    # Every node's minibatches for all its steps, as rows of one sample table:
    # a step gathers all nodes' samples with one index.
    xs = torch.from_numpy(np.concatenate([np.asarray(job.x) for job in jobs]))
    ys = torch.from_numpy(np.concatenate([np.asarray(job.y) for job in jobs]))
    offsets = np.cumsum([0] + [len(job.x) for job in jobs])
    picks = np.zeros((max(steps, default=0), n, batch), dtype=np.int64)
    for i, job in enumerate(jobs):
        order = minibatches(len(job.x), batch, job.seed)
        for step in range(job.steps):
            picks[step, i] = next(order) + offsets[i]
    lr = torch.tensor([job.lr for job in jobs], dtype=torch.float32)
    mu = torch.tensor([job.proximal_mu for job in jobs], dtype=torch.float32)
    loss_sums = torch.zeros(n, dtype=torch.float64)
    tensors = [stacked[name] for name in names]
    rates = [lr.view((-1,) + (1,) * (t.dim() - 1)) for t in tensors]

    grouped = grouped_forward(model)
    if grouped is not None:
        forward: Callable[[dict[str, torch.Tensor], torch.Tensor], torch.Tensor] = (
            grouped
        )
    else:

        def logits_of(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
            return functional_call(model, params, (x,))

        # Only the forward pass is vectorised: the loss is taken outside vmap, where
        # cross_entropy needs none of the decompositions (and their sympy import,
        # ~1 s) that its batching rule pulls in.
        forward = vmap(logits_of)
    model.train()
    for step in range(max(steps, default=0)):
        active = [i for i in range(n) if step < steps[i]]
        every = len(active) == n
        rows = torch.tensor(active)
        index = torch.from_numpy(picks[step, active].reshape(-1))
        x = xs[index].view(len(active), batch, *xs.shape[1:])
        y = ys[index].view(len(active), batch)
        params = {
            name: (t if every else t[rows]).detach().requires_grad_()
            for name, t in stacked.items()
        }
        logits = forward(params, x)
        losses = (
            nn.functional.cross_entropy(
                logits.flatten(0, 1), y.flatten(), reduction="none"
            )
            .view(len(active), -1)
            .mean(dim=1)
        )
        # Node i's loss depends on its own weights only: the gradient of the sum
        # is every node's own gradient.
        grads = dict(
            zip(
                params,
                torch.autograd.grad(losses.sum(), list(params.values())),
                strict=True,
            )
        )
        with torch.no_grad():
            gs = []
            for name in names:
                g = grads[name]
                if proximal:
                    # FedProx: d/dw (mu/2)||w - w0||^2 = mu (w - w0) (Li et al. 2020,
                    # Eq. 2), as train_steps differentiates it
                    shape = (-1,) + (1,) * (g.dim() - 1)
                    g = g + mu[rows].view(shape) * (params[name] - anchors[name][rows])
                gs.append(g)
            if every:  # w -= lr g for every array in one call
                torch._foreach_addcmul_(tensors, gs, rates, value=-1.0)
            else:
                for name, g in zip(names, gs, strict=True):
                    update = g * lr[rows].view((-1,) + (1,) * (g.dim() - 1))
                    stacked[name].index_put_((rows,), stacked[name][rows] - update)
            loss_sums.index_add_(0, rows, losses.detach().double())
    out = []
    sums = loss_sums.tolist()
    for i in range(n):
        done = steps[i]
        weights = {name: stacked[name][i] for name in names}  # row views, no copy
        stats = TrainStats(done, done * batch, sums[i] / done if done else float("nan"))
        out.append((weights, stats))
    return out
