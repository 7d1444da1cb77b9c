"""A user's own model, loss and optimiser factory, importable by every process
of the span-job tests (``tests`` is on ``sys.path``: pyproject's pytest
``pythonpath``, inherited by spawned ranks)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def smooth_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy with label smoothing 0.1 (mean over the batch)."""
    return F.cross_entropy(logits, target, label_smoothing=0.1)


def adam(params: list[nn.Parameter], lr: float, **kwargs: float) -> torch.optim.Adam:
    """An optimiser factory of the form the span strategies call."""
    return torch.optim.Adam(params, lr=lr, **kwargs)


NOT_CALLABLE = 3


class TwoBranch(nn.Module):
    """Not an nn.Sequential: two branches added, then a head."""

    def __init__(self, in_features: int = 64, hidden: int = 16) -> None:
        super().__init__()
        self.left = nn.Linear(in_features, hidden)
        self.right = nn.Linear(in_features, hidden)
        self.head = nn.Linear(hidden, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.flatten(1)
        return self.head(torch.relu(self.left(x)) + torch.tanh(self.right(x)))


def two_branch(in_features: int = 64, hidden: int = 16) -> TwoBranch:
    return TwoBranch(in_features, hidden)


class CutNet(nn.Module):
    """Not an nn.Sequential, but it names its cut points."""

    def __init__(self, hidden: int = 24) -> None:
        super().__init__()
        self.flatten = nn.Flatten()
        self.body = nn.Sequential(nn.Linear(64, hidden), nn.ReLU())
        self.middle = nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU())
        self.head = nn.Linear(hidden, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.middle(self.body(self.flatten(x))))

    def pipeline_layers(self) -> nn.Sequential:
        return nn.Sequential(self.flatten, self.body, self.middle, self.head)


def cut_net(hidden: int = 24) -> CutNet:
    return CutNet(hidden)


class HalfCut(CutNet):
    """Its cut points leave out the head: not a valid cut."""

    def pipeline_layers(self) -> nn.Sequential:
        return nn.Sequential(self.flatten, self.body, self.middle)


def half_cut() -> HalfCut:
    return HalfCut()
