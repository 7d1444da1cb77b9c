"""The central evaluation scores the weights it is given, round after round."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from flowerbed.clients.training import evaluate, onednn
from flowerbed.data import load_dataset
from flowerbed.models import build_model
from flowerbed.sims import grouped_sgd
from flowerbed.sims.conv_kernels import CACHE_ENV, ENABLE_ENV
from flowerbed.sims.recorder import RunRecorder
from flowerbed.sims.scenario import build_fleet_grid
from flwr.app import ArrayRecord


@pytest.fixture
def recorder() -> RunRecorder:
    grid = build_fleet_grid({"num-nodes": 2})
    return RunRecorder(grid, "lenet", load_dataset("digits", ""))


@pytest.mark.parametrize("kernels", [True, False])
def test_each_evaluation_scores_the_weights_it_is_given(
    recorder: RunRecorder,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    kernels: bool,
) -> None:
    data = load_dataset("digits", "")
    # oneDNN off, as a process whose nodes trained has it: the central
    # evaluation runs on the compiled kernels (opted in), or else turns oneDNN
    # on for itself
    monkeypatch.setattr(torch.backends.mkldnn, "enabled", False)
    if kernels:
        monkeypatch.setenv(ENABLE_ENV, "1")
        monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    else:  # the default, or as without a C compiler
        monkeypatch.delenv(ENABLE_ENV, raising=False)
        monkeypatch.setattr(grouped_sgd, "kernels_for", lambda shape: None)
    for seed in (1, 2):  # the second loads over the first's weights
        torch.manual_seed(seed)
        model = build_model("lenet", 1, 8, 10)
        metrics = recorder.evaluate_fn(0, ArrayRecord(model.state_dict()))
        assert not torch.backends.mkldnn.enabled
        with onednn():
            loss, acc = evaluate(model, data.x_test, data.y_test)
        if kernels:  # another order of the convolutions' sums
            assert metrics["loss"] == pytest.approx(loss, rel=1e-6)
        else:
            assert metrics["loss"] == loss
        assert metrics["accuracy"] == acc


def test_weights_of_another_model_are_refused(recorder: RunRecorder) -> None:
    other = build_model("lenet", 1, 16, 10)  # a wider first linear layer
    with pytest.raises(RuntimeError, match="size mismatch"):
        recorder.evaluate_fn(0, ArrayRecord(other.state_dict()))
