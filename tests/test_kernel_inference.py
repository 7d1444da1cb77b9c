"""The central evaluation's forward pass on the compiled convolution kernels
(opted in) gives the model's logits (within float tolerance), for the chains it
runs, and declines the rest."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from flowerbed.clients.training import inference_pass, onednn
from flowerbed.data import load_dataset
from flowerbed.models import build_model
from flowerbed.sims import grouped_sgd
from flowerbed.sims.conv_kernels import CACHE_ENV, ENABLE_ENV
from flowerbed.sims.kernel_inference import kernel_pass
from flowerbed.sims.numba_kernels import ENABLE_ENV as NUMBA_ENV
from torch import nn


@pytest.fixture(scope="module")
def kernel_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kernels") / "cache"


@pytest.fixture(autouse=True)
def _opted_in(monkeypatch: pytest.MonkeyPatch, kernel_cache: Path) -> None:
    """The compiled kernels opted in, with a cache of the module's own."""
    monkeypatch.setenv(ENABLE_ENV, "1")
    monkeypatch.setenv(CACHE_ENV, str(kernel_cache))


def _logits(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    forward = kernel_pass(model)
    assert forward is not None
    with torch.no_grad():
        logits = forward(x)
    if logits is None:
        pytest.skip("no C compiler: the convolution kernels cannot be built")
    return logits


def test_lenet_on_digits_gives_onednns_logits() -> None:
    data = load_dataset("digits", "")
    x = torch.from_numpy(np.ascontiguousarray(data.x_test))  # 360: 22.5 chunks
    for seed in (0, 1):
        torch.manual_seed(seed)
        model = build_model("lenet", 1, 8, 10).eval()
        with torch.no_grad(), onednn():
            expected = inference_pass(model)(x)
        got = _logits(model, x)
        assert got.shape == expected.shape == (360, 10)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_odd_sizes_a_convolution_without_bias_and_relu_after_pooling() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1, bias=False),
        nn.ReLU(),
        nn.MaxPool2d(2),  # 9x9 -> 4x4: the last row and column dropped
        nn.Conv2d(3, 4, (3, 1), padding=(1, 0)),
        nn.MaxPool2d(2, 2),
        nn.ReLU(),
        nn.Identity(),
        nn.Flatten(),
        nn.Linear(4 * 2 * 2, 5),
        nn.ReLU(),
        nn.Linear(5, 3),
    ).eval()
    x = torch.randn(37, 2, 9, 9)  # 37 images: the last chunk padded
    with torch.no_grad():
        expected = model(x)
    torch.testing.assert_close(_logits(model, x), expected, rtol=1e-5, atol=1e-5)


def test_overlapping_pools_are_pooled_by_pytorch_on_the_kernels_layout() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(3, stride=2),
        nn.Flatten(),
        nn.Linear(4 * 4 * 4, 10),
    ).eval()
    x = torch.randn(20, 1, 9, 9)
    with torch.no_grad():
        expected = model(x)
    torch.testing.assert_close(_logits(model, x), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "model",
    [
        build_model("mobilenet", 1, 8, 10),  # group norm, residual additions
        nn.Sequential(nn.Conv2d(1, 2, 3, stride=2), nn.Flatten(), nn.Linear(18, 2)),
        nn.Sequential(nn.Conv2d(1, 2, 3), nn.Tanh(), nn.Flatten()),  # autograd's
        nn.Sequential(nn.Linear(8, 2), nn.Flatten()),  # a linear layer on images
        nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU()),  # no flatten: images out
    ],
)
def test_other_models_are_declined(model: nn.Module) -> None:
    assert kernel_pass(model) is None


def test_inputs_it_cannot_run_are_declined(monkeypatch: pytest.MonkeyPatch) -> None:
    model = build_model("lenet", 1, 8, 10)
    forward = kernel_pass(model)
    assert forward is not None
    assert forward(torch.zeros(4, 3, 8, 8)) is None  # 3 channels, not 1
    assert forward(torch.zeros(4, 1, 8, 8, dtype=torch.float64)) is None
    monkeypatch.setattr(grouped_sgd, "kernels_for", lambda shape: None)
    assert forward(torch.zeros(4, 1, 8, 8)) is None  # no compiler


def test_without_kernels_it_declines_every_input(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    forward = kernel_pass(build_model("lenet", 1, 8, 10))
    assert forward is not None
    monkeypatch.delenv(ENABLE_ENV)
    monkeypatch.setenv(NUMBA_ENV, "0")
    assert forward(torch.zeros(4, 1, 8, 8)) is None  # the caller runs oneDNN
