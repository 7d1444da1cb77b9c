"""A local training loop that counts its work and can stop early.

Every flowerbed node (simulated, board, phone gateway) trains through
:func:`train_steps`, so ``num-steps`` and ``num-examples`` mean the same everywhere.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import fx, nn


@dataclass(frozen=True)
class TrainStats:
    """What one call of :func:`train_steps` did."""

    num_steps: int
    num_examples: int
    mean_loss: float


def train_steps(
    model: nn.Module,
    x: np.ndarray,
    y: np.ndarray,
    *,
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
    should_stop: Callable[[int], bool] | None = None,
    proximal_mu: float = 0.0,
) -> TrainStats:
    """Run up to ``steps`` SGD steps on minibatches cycling through (x, y).

    Batches come from a seeded permutation, reshuffled at each pass over the data.
    ``should_stop(steps_done)`` is asked before each step; when it answers True the
    loop stops and reports the partial work done so far.

    With ``proximal_mu`` > 0 the loss gains FedProx's proximal term
    (mu / 2) * ||w - w_global||^2, w_global being the weights at the start of the call
    (Li et al., "Federated optimization in heterogeneous networks", MLSys 2020, Eq. 2).
    """
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    if len(x) == 0:
        raise ValueError("no training samples")
    params = [p for p in model.parameters() if p.requires_grad]
    loss_fn = nn.CrossEntropyLoss()
    xt = torch.from_numpy(np.ascontiguousarray(x))
    yt = torch.from_numpy(np.ascontiguousarray(y))
    batches = minibatches(len(x), batch_size, seed)
    done = examples = 0
    loss_sum = 0.0
    anchor = [p.detach().clone() for p in model.parameters()] if proximal_mu else []
    model.train()
    while done < steps and not (should_stop is not None and should_stop(done)):
        idx = torch.from_numpy(next(batches))
        model.zero_grad(set_to_none=True)
        loss = loss_fn(model(xt[idx]), yt[idx])
        objective = loss
        if anchor:
            drift = sum(
                ((p - a) ** 2).sum()
                for p, a in zip(model.parameters(), anchor, strict=True)
            )
            objective = loss + 0.5 * proximal_mu * drift
        objective.backward()
        _sgd_step(params, lr)
        loss_sum += float(loss.detach())
        done += 1
        examples += len(idx)
    return TrainStats(done, examples, loss_sum / done if done else float("nan"))


def minibatches(num_samples: int, batch_size: int, seed: int) -> Iterator[np.ndarray]:
    """Endless minibatch indices: a seeded permutation, reshuffled at each pass.

    Batches hold ``min(batch_size, num_samples)`` indices (at least 1); a pass
    that cannot fill a whole batch is dropped and the data reshuffled.
    """
    rng = np.random.default_rng(seed)
    batch = max(1, min(batch_size, num_samples))
    order = rng.permutation(num_samples)
    cursor = 0
    while True:
        if cursor + batch > len(order):
            order, cursor = rng.permutation(num_samples), 0
        yield order[cursor : cursor + batch]
        cursor += batch


def minibatch_table(
    num_samples: int, batch_size: int, seed: int, steps: int
) -> np.ndarray:
    """The first ``steps`` batches :func:`minibatches` yields, as the rows of one
    ``(steps, batch)`` array: the same permutations from the same generator,
    drawn at once rather than batch by batch."""
    rng = np.random.default_rng(seed)
    batch = max(1, min(batch_size, num_samples))
    per_pass = num_samples // batch
    passes = max(1, -(-steps // per_pass))
    orders = [rng.permutation(num_samples)[: per_pass * batch] for _ in range(passes)]
    return np.concatenate(orders).reshape(-1, batch)[:steps]


def _sgd_step(params: Sequence[torch.Tensor], lr: float) -> None:
    """Plain SGD, w <- w - lr * grad.

    Written out rather than ``torch.optim.SGD``: building the first torch optimiser
    imports torch's compiler stack (~2 s), paid by every fresh Flower ClientApp
    process, i.e. on every message a SuperNode runs.
    """
    with torch.no_grad():
        for p in params:
            if p.grad is not None:
                p.add_(p.grad, alpha=-lr)


ROWS_ALIGN = 16
"""Rows :func:`log_softmax` pads to a multiple of: the widest float vector of
PyTorch's CPU kernels (AVX-512), and so a multiple of the narrower ones."""


def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """``torch.log_softmax(logits, dim=-1)``, taken over the first dimension of
    a ``(classes, rows)`` copy; contiguous, of the same shape.

    PyTorch's CPU kernel over the last dimension walks a row of fewer classes
    than a vector holds one element at a time (10 classes: ~24 us for 160
    rows, ~50 us for digits' 360 test images); over the first, it works on
    whole vectors of rows (~2 us, plus ~2 us per copy). Both sum a row's
    exponentials class by class, in order, with the same vectorised ``exp``:
    the values agree (measured here bit for bit for 10 classes on AVX-512).
    The rows are padded to whole vectors so that none goes through the scalar
    ``exp`` of the kernel's tail.
    """
    classes = logits.shape[-1]
    flat = logits.reshape(-1, classes)
    rows = len(flat)
    padded = -(-rows // ROWS_ALIGN) * ROWS_ALIGN
    if padded == rows:
        columns = flat.t().contiguous()
    else:
        columns = flat.new_zeros(classes, padded)
        columns[:, :rows] = flat.t()
    out = torch.log_softmax(columns, dim=0)[:, :rows]
    # back to rows in memory: what is taken from it may feed matrix products,
    # whose kernels (and roundings) follow the layout
    return out.t().contiguous().view(logits.shape)


def evaluate(model: nn.Module, x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Mean cross-entropy loss and accuracy of ``model`` on (x, y).

    The forward pass is the model's, with 2x2 max pooling as
    :func:`max_pool_2x2` (:func:`inference_pass`), and the loss's log-softmax
    :func:`log_softmax`: the same values.
    """
    model.eval()
    with torch.no_grad():
        logits = inference_pass(model)(torch.from_numpy(np.ascontiguousarray(x)))
    return scores(logits, y)


def scores(logits: torch.Tensor, y: np.ndarray) -> tuple[float, float]:
    """Mean cross-entropy loss and accuracy of ``logits`` ``(N, classes)``
    for class indices ``y``, as :func:`evaluate` reports them."""
    with torch.no_grad():
        target = torch.from_numpy(np.ascontiguousarray(y))
        # cross_entropy is nll_loss of log_softmax: the same value
        loss = nn.functional.nll_loss(log_softmax(logits), target).item()
        acc = (logits.argmax(dim=1) == target).float().mean().item()
    return float(loss), float(acc)


@contextlib.contextmanager
def onednn() -> Iterator[None]:
    """PyTorch's oneDNN (mkldnn) convolutions on for the ``with`` block, then as
    they were.

    ``torch.backends.mkldnn.flags(enabled=True)`` would also reset oneDNN's
    other flags (deterministic, TF32) and warn about TF32 on every call.
    """
    was = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = True  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.backends.mkldnn.enabled = was  # type: ignore[assignment]


def max_pool_2x2(x: torch.Tensor, height_dim: int = -2) -> torch.Tensor:
    """``max_pool2d(x, 2)``: the maximum of each 2x2 window, as two elementwise
    maxima (of row pairs, then of column pairs) over strided views.

    Rows are dimension ``height_dim`` of ``x``, columns the one after it (the
    last two by default; the compiled kernels' layout ``(nodes, H, W, C,
    batch)`` has them at 1 and 2). The same values (a maximum is exact; NaN
    propagates as in ``max_pool2d``); a trailing odd row or column is dropped,
    as ``max_pool2d`` drops it. PyTorch's CPU kernel without indices (what
    inference runs) walks each channel's plane on its own and is slow on small
    planes: measured here on digits' 360 test images, LeNet's two poolings 0.73
    and 0.47 ms that way, 0.08 and 0.07 ms here.
    """
    lead = (slice(None),) * (height_dim % x.dim())
    height = x.shape[len(lead)] // 2 * 2
    width = x.shape[len(lead) + 1] // 2 * 2
    rows = torch.maximum(
        x[(*lead, slice(0, height, 2), slice(None, width))],
        x[(*lead, slice(1, height, 2), slice(None, width))],
    )
    return torch.maximum(
        rows[(*lead, slice(None), slice(0, None, 2))],
        rows[(*lead, slice(None), slice(1, None, 2))],
    )


_INFERENCE: weakref.WeakKeyDictionary[nn.Module, Callable[..., torch.Tensor]] = (
    weakref.WeakKeyDictionary()
)
"""Inference passes by model (see :func:`inference_pass`)."""


def inference_pass(model: nn.Module) -> Callable[..., torch.Tensor]:
    """``model``'s forward pass with its 2x2 max pooling as :func:`max_pool_2x2`.

    Traced once per model with ``torch.fx`` (cached); it shares the model's
    modules, so later weights (``load_state_dict``) are used. Without autograd
    only: ``max_pool_2x2``'s gradient would differ from ``max_pool2d``'s on ties.
    The model itself when it has no such pooling or ``torch.fx`` cannot trace it.
    """
    if model not in _INFERENCE:
        _INFERENCE[model] = _with_max_pool_2x2(model)
    return _INFERENCE[model]


def is_max_pool_2x2(module: nn.Module) -> bool:
    """A plain ``nn.MaxPool2d`` over 2x2 windows of stride 2."""
    return (
        type(module) is nn.MaxPool2d
        and module.kernel_size in (2, (2, 2))
        and module.stride in (2, (2, 2))
        and module.padding in (0, (0, 0))
        and module.dilation in (1, (1, 1))
        and not module.ceil_mode
        and not module.return_indices
    )


def _with_max_pool_2x2(model: nn.Module) -> Callable[..., torch.Tensor]:
    if not any(is_max_pool_2x2(m) for m in model.modules()):
        return model
    try:
        traced = fx.symbolic_trace(model)
    except Exception:  # data-dependent control flow, custom tracing
        return model
    graph = traced.graph
    for node in list(graph.nodes):
        if node.op == "call_module" and is_max_pool_2x2(
            traced.get_submodule(str(node.target))
        ):
            with graph.inserting_before(node):
                pooled = graph.call_function(max_pool_2x2, node.args)
            node.replace_all_uses_with(pooled)
            graph.erase_node(node)
    traced.recompile()
    return traced
