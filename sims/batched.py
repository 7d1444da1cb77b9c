"""Train many copies of one architecture at once, each on its own data and weights.

:func:`train_many` is :func:`flowerbed.clients.training.train_steps` for a group of
nodes that share a model architecture: their weights are stacked along a leading
node axis and every SGD step of every node is one computation over all of them,
through the layer library (:mod:`flowerbed.sims.layers`), so the per-operator
overhead that dominates tiny models is paid once per step instead of once per
node and step. Each node keeps its own minibatch order (the same seeded
permutation ``train_steps`` draws), its own step count, learning rate and
FedProx term, so its result equals what ``train_steps`` computes for it alone,
within float tolerance (different kernels sum in a different order; compare on
the same convolution backend: PyTorch's oneDNN and native CPU paths themselves
differ by ~1e-3 in MobileNet's weights after one step on digits).

One step runs one of two ways, both from the library's layer objects:

- a chain of layers whose backward is written out (LeNet, the 1-D CNN, the MLP,
  logistic regression): :class:`~flowerbed.sims.grouped_sgd.GroupedSGD` walks
  it back by hand and moves each node's weights in place as their gradients
  come (1.3-1.5x fewer CPU-seconds per LeNet node-step than autograd, measured
  here at 10 to 1,000 nodes);
- any other graph of the library's layers (MobileNet's group norms and
  residual additions): :class:`~flowerbed.sims.grouped.GroupedForward` runs
  the forward pass and autograd the backward.

A convolution of all nodes is one grouped convolution; oneDNN runs those (and
their backward pass) natively, where PyTorch's fallback loops over the groups:
measured here, 50 MobileNet nodes train 10x faster with oneDNN on, so
:func:`train_many` turns it on for its own computation only (per-node training
keeps it off: see :func:`flowerbed.sims.node.single_threaded`).

Models the library does not run (buffers such as batch-norm statistics,
random layers such as dropout, layers or functions not in its table) are
trained per node; :func:`batchable` says which are batched.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from flowerbed.clients.training import TrainStats, minibatch_table, onednn
from flowerbed.sims.grouped import GroupedForward, grouped_forward
from flowerbed.sims.grouped_sgd import Rates, grouped_sgd
from torch import nn

__all__ = ["NodeJob", "batchable", "grouped_forward", "train_many"]


def batchable(model: nn.Module) -> bool:
    """True when :func:`train_many` can train ``model``: the layer library runs
    it (:func:`~flowerbed.sims.grouped.grouped_forward`, traced once per
    model) and every parameter is trained (looked at every call)."""
    return grouped_forward(model) is not None and all(
        p.requires_grad for p in model.parameters()
    )


@dataclass(frozen=True)
class NodeJob:
    """One node's share of a batched training call (``train_steps``'s arguments).

    ``weights`` are only read: read-only NumPy views of a record's bytes will do.
    """

    weights: Mapping[str, torch.Tensor | np.ndarray]
    x: np.ndarray
    y: np.ndarray
    steps: int
    batch_size: int
    lr: float
    seed: int
    proximal_mu: float = 0.0


def train_many(
    model: nn.Module, jobs: Sequence[NodeJob]
) -> list[tuple[dict[str, np.ndarray], TrainStats]]:
    """Train every job from its own weights; return each one's weights and stats.

    Each job's weights are NumPy views of its row in one stacked array per
    parameter (not copies: the caller encodes them anyway, and a NumPy row
    costs a fifth of a tensor's view).

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
    grouped = grouped_forward(model)
    if not batchable(model) or grouped is None:
        raise ValueError(
            f"{type(model).__name__} has buffers, random layers, layers or "
            "functions the layer library does not run (flowerbed.sims.layers."
            "LAYERS), or frozen parameters: train it per node"
        )
    keep_freed_memory()
    with onednn():
        return _train_groups(grouped, jobs)


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
    grouped: GroupedForward, jobs: Sequence[NodeJob]
) -> list[tuple[dict[str, np.ndarray], TrainStats]]:
    results: list[tuple[dict[str, np.ndarray], TrainStats] | None] = [None] * len(jobs)
    groups: dict[int, list[int]] = {}
    for i, job in enumerate(jobs):
        if job.steps < 0:
            raise ValueError(f"steps must be >= 0, got {job.steps}")
        if len(job.x) == 0:
            raise ValueError("no training samples")
        batch = max(1, min(job.batch_size, len(job.x)))
        groups.setdefault(batch, []).append(i)
    for batch, members in groups.items():
        out = _train_group(grouped, [jobs[i] for i in members], batch)
        for i, result in zip(members, out, strict=True):
            results[i] = result
    return [r for r in results if r is not None]


def _train_group(
    grouped: GroupedForward, jobs: Sequence[NodeJob], batch: int
) -> list[tuple[dict[str, np.ndarray], TrainStats]]:
    names = grouped.names
    n = len(jobs)
    # each node's own copy (moved in place), float32, stacked by NumPy: for a
    # round's arrays, ~40 against ~110 us (decoded to tensors, expanded, cloned)
    if all(job.weights is jobs[0].weights for job in jobs):  # a round's arrays
        stacked = {name: _copies(_array(jobs[0].weights[name]), n) for name in names}
    else:
        stacked = {
            name: torch.from_numpy(
                np.stack([_array(job.weights[name]) for job in jobs]).astype(
                    np.float32, copy=False
                )
            )
            for name in names
        }
    written = grouped_sgd(grouped)
    if written is not None:
        stacked = written.lay_out(stacked)
    proximal = any(job.proximal_mu for job in jobs)
    anchors = {name: t.clone() for name, t in stacked.items()} if proximal else {}
    steps = [job.steps for job in jobs]
    # Every node's minibatches for all its steps, as rows of one sample table:
    # a step gathers all nodes' samples with one index.
    xs = torch.from_numpy(np.concatenate([np.asarray(job.x) for job in jobs]))
    ys = torch.from_numpy(np.concatenate([np.asarray(job.y) for job in jobs]))
    picks = np.zeros((max(steps, default=0), n, batch), dtype=np.int64)
    offset = 0
    for i, job in enumerate(jobs):
        table = minibatch_table(len(job.x), batch, job.seed, job.steps)
        picks[: job.steps, i] = table + offset
        offset += len(job.x)
    # index_select, not xs[picks]: the same copy, 4x faster for these sizes
    every_step = torch.from_numpy(picks).view(-1)
    x_steps = xs.index_select(0, every_step).view(*picks.shape, *xs.shape[1:])
    y_steps = ys.index_select(0, every_step).view(picks.shape)
    lr = torch.tensor([job.lr for job in jobs], dtype=torch.float32)
    mu = torch.tensor([job.proximal_mu for job in jobs], dtype=torch.float32)
    loss_sums = torch.zeros(n, dtype=torch.float64)
    full_losses: list[torch.Tensor] = []  # of the steps all nodes take
    # the steps all nodes take, laid out for the written-out step with one copy
    common = min(steps, default=0)
    packed = written.pack(x_steps[:common]) if written is not None else []
    every_node = Rates(lr, mu, anchors)
    y_each = y_steps.unbind(0)
    for step in range(max(steps, default=0)):
        if step < common:  # every node takes this step
            y = y_each[step]
            if written is not None:
                losses = written.step(stacked, packed[step], y, every_node)
            else:
                losses = _autograd_step(grouped, stacked, x_steps[step], y, every_node)
            full_losses.append(losses)
            continue
        rows = torch.tensor([i for i in range(n) if step < steps[i]])
        x, y = x_steps[step, rows], y_steps[step, rows]
        params = _rows(stacked, rows)
        rates = Rates(lr[rows], mu[rows], _rows(anchors, rows))
        if written is not None:
            losses = written.step(params, written.pack(x[None])[0], y, rates)
        else:
            losses = _autograd_step(grouped, params, x, y, rates)
        for name, t in stacked.items():  # the rows were copies: put them back
            t.index_copy_(0, rows, params[name])
        loss_sums.index_add_(0, rows, losses.mean(dim=1).double())
    if full_losses:  # each step's mean losses, taken for all steps at once
        loss_sums += torch.stack(full_losses).mean(dim=2).double().sum(dim=0)
    out = []
    sums = loss_sums.tolist()
    rows_of = {  # no copy (but of weights lay_out had made channels-last)
        name: stacked[name].contiguous().numpy() for name in names
    }
    for i in range(n):
        done = steps[i]
        weights = {name: rows_of[name][i] for name in names}
        stats = TrainStats(done, done * batch, sums[i] / done if done else float("nan"))
        out.append((weights, stats))
    return out


def _array(w: torch.Tensor | np.ndarray) -> np.ndarray:
    """A node's weights as NumPy (a tensor's as float32, sharing its memory)."""
    return w.detach().float().numpy() if isinstance(w, torch.Tensor) else w


def _copies(w: np.ndarray, n: int) -> torch.Tensor:
    """``(n, *w.shape)``: ``n`` float32 copies of ``w``, contiguous, writable."""
    out = np.empty((n, *w.shape), np.float32)
    out[...] = w
    return torch.from_numpy(out)


def _rows(
    stacked: dict[str, torch.Tensor], rows: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Some nodes' rows of stacked arrays (copies)."""
    return {name: t[rows] for name, t in stacked.items()}


def _autograd_step(
    forward: GroupedForward,
    stacked: dict[str, torch.Tensor],
    x: torch.Tensor,
    y: torch.Tensor,
    rates: Rates,
) -> torch.Tensor:
    """One SGD step of every node, gradients by autograd; each sample's loss,
    ``(nodes, batch)``."""
    params = {name: t.detach().requires_grad_() for name, t in stacked.items()}
    logits = forward(params, x)
    losses = nn.functional.cross_entropy(
        logits.flatten(0, 1), y.flatten(), reduction="none"
    ).view(len(x), -1)
    # Node i's loss depends on its own weights only: the gradient of the sum is
    # every node's own gradient.
    grads = torch.autograd.grad(losses.mean(dim=1).sum(), list(params.values()))
    with torch.no_grad():
        gs = []
        for (name, w), g in zip(params.items(), grads, strict=True):
            if rates.anchors:
                # FedProx: d/dw (mu/2)||w - w0||^2 = mu (w - w0) (Li et al. 2020,
                # Eq. 2), as train_steps differentiates it
                shape = (-1,) + (1,) * (g.dim() - 1)
                g = g + rates.mu.view(shape) * (w - rates.anchors[name])
            gs.append(g)
        tensors = list(stacked.values())
        lrs = [rates.lr.view((-1,) + (1,) * (t.dim() - 1)) for t in tensors]
        torch._foreach_addcmul_(tensors, gs, lrs, value=-1.0)  # w -= lr g, all at once
    return losses.detach()
