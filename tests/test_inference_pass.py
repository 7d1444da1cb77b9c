"""Evaluation runs the model's forward pass with 2x2 max pooling as two elementwise
maxima: the same values as ``max_pool2d``, faster on small planes."""

from __future__ import annotations

import pytest
import torch
from flowerbed.clients.training import evaluate, inference_pass, max_pool_2x2
from flowerbed.models import build_model
from torch import nn


@pytest.mark.parametrize("shape", [(3, 4, 8, 8), (2, 5, 5, 7), (4, 4, 2), (1, 1, 3, 3)])
def test_max_pool_2x2_equals_max_pool2d(shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    x = torch.randn(shape)
    x.view(-1)[3] = float("nan")  # propagated, as max_pool2d propagates it
    expected = nn.functional.max_pool2d(x, 2)
    assert torch.equal(max_pool_2x2(x).isnan(), expected.isnan())
    assert torch.equal(max_pool_2x2(x).nan_to_num(), expected.nan_to_num())


def test_max_pool_2x2_equals_max_pool2d_on_channels_last_tensors() -> None:
    x = torch.randn(2, 6, 4, 4).contiguous(memory_format=torch.channels_last)
    assert torch.equal(max_pool_2x2(x), nn.functional.max_pool2d(x, 2))


def test_inference_pass_is_the_models_forward_and_follows_new_weights() -> None:
    torch.manual_seed(0)
    model = build_model("lenet", 1, 8, 10).eval()
    x = torch.randn(7, 1, 8, 8)
    fast = inference_pass(model)
    assert fast is not model  # its two poolings were swapped
    with torch.no_grad():
        assert torch.equal(fast(x), model(x))
        model.load_state_dict({k: 2 * v for k, v in model.state_dict().items()})
        assert torch.equal(inference_pass(model)(x), model(x))
    y = torch.randint(0, 10, (7,))
    loss, acc = evaluate(model, x.numpy(), y.numpy())
    with torch.no_grad():
        logits = model(x)
    assert loss == pytest.approx(nn.functional.cross_entropy(logits, y).item())
    assert acc == pytest.approx((logits.argmax(1) == y).float().mean().item())


def test_other_pooling_keeps_the_model_as_it_is() -> None:
    overlapping = nn.Sequential(nn.MaxPool2d(3, stride=2), nn.Flatten())
    assert inference_pass(overlapping) is overlapping
    assert inference_pass(nn.Linear(2, 2)).__class__ is nn.Linear
