"""A local training loop that counts its work and can stop early.

Every flowerbed node (simulated, board, phone gateway) trains through
:func:`train_steps`, so ``num-steps`` and ``num-examples`` mean the same everywhere.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn


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


def evaluate(model: nn.Module, x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Mean cross-entropy loss and accuracy of ``model`` on (x, y)."""
    model.eval()
    with torch.no_grad():
        logits = model(torch.from_numpy(np.ascontiguousarray(x)))
        target = torch.from_numpy(np.ascontiguousarray(y))
        loss = nn.functional.cross_entropy(logits, target).item()
        acc = (logits.argmax(dim=1) == target).float().mean().item()
    return float(loss), float(acc)
