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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from flowerbed.clients.training import TrainStats, minibatches
from torch import nn
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
    onednn = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = True  # type: ignore[assignment]
    try:
        return _train_groups(model, jobs)
    finally:
        torch.backends.mkldnn.enabled = onednn  # type: ignore[assignment]


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
    xs = [torch.from_numpy(np.ascontiguousarray(job.x)) for job in jobs]
    ys = [torch.from_numpy(np.ascontiguousarray(job.y)) for job in jobs]
    orders = [minibatches(len(job.x), batch, job.seed) for job in jobs]
    lr = torch.tensor([job.lr for job in jobs], dtype=torch.float32)
    mu = torch.tensor([job.proximal_mu for job in jobs], dtype=torch.float32)
    steps = [job.steps for job in jobs]
    loss_sums = [0.0] * n

    def logits_of(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return functional_call(model, params, (x,))

    # Only the forward pass is vectorised: the loss is taken outside vmap, where
    # cross_entropy needs none of the decompositions (and their sympy import, ~1 s)
    # that its batching rule pulls in.
    forward = vmap(logits_of)
    model.train()
    for step in range(max(steps, default=0)):
        active = [i for i in range(n) if step < steps[i]]
        idx = [next(orders[i]) for i in active]
        x = torch.stack([xs[i][j] for i, j in zip(active, idx, strict=True)])
        y = torch.stack([ys[i][j] for i, j in zip(active, idx, strict=True)])
        every = len(active) == n
        params = {
            name: (t if every else t[active]).detach().requires_grad_()
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
        rows = torch.tensor(active)
        with torch.no_grad():
            for name in names:
                g = grads[name]
                shape = (-1,) + (1,) * (g.dim() - 1)
                if proximal:
                    # FedProx: d/dw (mu/2)||w - w0||^2 = mu (w - w0) (Li et al. 2020,
                    # Eq. 2), as train_steps differentiates it
                    g = g + mu[rows].view(shape) * (params[name] - anchors[name][rows])
                update = g * lr[rows].view(shape)
                if every:
                    stacked[name].sub_(update)
                else:
                    stacked[name].index_put_((rows,), stacked[name][rows] - update)
        for i, loss in zip(active, losses.tolist(), strict=True):
            loss_sums[i] += loss
    out = []
    for i in range(n):
        done = steps[i]
        weights = {name: stacked[name][i].clone() for name in names}
        stats = TrainStats(
            done, done * batch, loss_sums[i] / done if done else float("nan")
        )
        out.append((weights, stats))
    return out
