"""The layer library: one trace per model, one table, and the central
evaluation's forward pass on the same layers as batched training."""

from __future__ import annotations

import pytest
import torch
from flowerbed.clients.training import onednn
from flowerbed.models import build_model
from flowerbed.sims.grouped import evaluation_logits, grouped_forward
from flowerbed.sims.grouped_sgd import grouped_sgd
from flowerbed.sims.layers import (
    ChannelPool,
    Conv,
    Elementwise,
    MaxPool,
    Unsupported,
    layer_class,
    trace,
)
from torch import nn


@pytest.mark.parametrize(
    ("model", "sample"),
    [
        (lambda: build_model("lenet", 1, 8, 10), (1, 8, 8)),
        (lambda: build_model("mobilenet", 1, 8, 10), (1, 8, 8)),
        (lambda: build_model("cnn1d", 1, 40, 10), (1, 40)),
        (lambda: build_model("mlp", 1, 40, 10), (1, 40)),
        (  # overlapping windows: not 2x2, PyTorch pools
            lambda: nn.Sequential(
                nn.Conv2d(1, 4, 3, padding=1),
                nn.MaxPool2d(3, stride=2),
                nn.Tanh(),
                nn.Flatten(),
                nn.Linear(4 * 4 * 4, 10),
            ),
            (1, 9, 9),
        ),
    ],
    ids=["lenet", "mobilenet", "cnn1d", "mlp", "overlapping-pools"],
)
def test_evaluation_logits_are_the_models_outputs(
    model: nn.Module, sample: tuple[int, ...]
) -> None:
    torch.manual_seed(0)
    net = model().eval()
    x = torch.randn(37, *sample)
    with torch.no_grad(), onednn():
        expected = net(x)
        got = evaluation_logits(net, x)
    assert got is not None
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_a_model_is_traced_once() -> None:
    model = build_model("lenet", 1, 8, 10)
    assert trace(model) is trace(model)
    assert grouped_forward(model) is not None
    assert grouped_forward(model).traced is trace(model)  # type: ignore[union-attr]


def test_the_table_takes_subclasses_and_names_what_it_refuses() -> None:
    class MyConv(nn.Conv2d):
        pass

    assert layer_class(MyConv(1, 1, 3)) is Conv
    assert layer_class(nn.MaxPool2d(2)) is MaxPool
    assert layer_class(nn.AvgPool2d(2)) is ChannelPool
    assert layer_class(nn.GELU()) is Elementwise
    assert layer_class(nn.LayerNorm(3)) is None
    with pytest.raises(Unsupported, match="LayerNorm"):
        trace(nn.Sequential(nn.Linear(3, 3), nn.LayerNorm(3)))
    with pytest.raises(Unsupported, match="buffers"):
        trace(nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2)))


def test_the_written_out_step_takes_chains_whose_layers_all_have_a_backward() -> None:
    chain = nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.Flatten())
    with_tanh = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Tanh(), nn.Flatten())
    assert grouped_sgd(grouped_forward(chain)) is not None
    assert grouped_forward(with_tanh) is not None  # autograd differentiates it
    assert grouped_sgd(grouped_forward(with_tanh)) is None
