"""A board's side of a tile job, without processes: bad plans and weights are
named before anything joins, the evaluator and the data behave."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from flowerbed.models import build_sequential
from flowerbed.parallel.member import (
    MemberContext,
    load_module_state,
    module_state,
    result_arrays,
)
from flowerbed.parallel.plan import MemberPlan, PlanError
from flowerbed.parallel.tiles.exact_step import TileSettings, settings_of
from flowerbed.parallel.tiles.runner import JobData, evaluate
from plans import member_plan
from torch import nn

SETTINGS = TileSettings(
    input_shape=(1, 32, 32), bounds=(0, 2, 4), weights=(1.0, 2.0), bands=1
)


def plan(**options: Any) -> MemberPlan:
    opts = {**SETTINGS.options(), **options}
    return member_plan(
        "tiles", "member", world_size=2, port=29999, steps=1, batch_size=2, options=opts
    )


def test_the_plan_options_round_trip() -> None:
    assert settings_of(plan()) == SETTINGS


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"input-shape": [32, 32]}, "must be \\[channels, h, w\\]"),
        ({"tiles-bounds": "0,2"}, "'tiles-bounds' must be a list of integers"),
        ({"tiles-weights": [1.0]}, "must list 2 positive numbers"),
        ({"tiles-weights": [1.0, float("nan")]}, "must list 2 positive numbers"),
        ({"tiles-bands": 0}, "'tiles-bands' must be an integer >= 1"),
        ({"tiles-norm": "instance"}, "normalisation mode 'instance'; valid"),
        ({"tiles-link-bytes-per-s": -1}, "must be > 0"),
    ],
)
def test_bad_plan_options_are_named(options: dict[str, Any], message: str) -> None:
    with pytest.raises(PlanError, match=message):
        settings_of(plan(**options))


def test_weights_of_another_model_are_refused() -> None:
    model = build_sequential("vgg", {"in_channels": 1, "width": 4})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    with pytest.raises(PlanError, match=r"1 arrays missing, e\.g\. \['0\.0\.bias'\]"):
        load_module_state(
            model, optimizer, {k: v for k, v in state.items() if k != "0.0.bias"}
        )
    with pytest.raises(PlanError, match=r"1 unexpected, e\.g\. \['9\.weight'\]"):
        load_module_state(
            model, None, {**state, "9.weight": state["0.0.bias"]}, strict=True
        )
    bad_momentum = {**state, "momentum:0.0.bias": np.zeros(3, dtype=np.float32)}
    with pytest.raises(PlanError, match=r"'momentum:0\.0\.bias' has shape \[3\]"):
        load_module_state(model, optimizer, bad_momentum)
    state["0.0.weight"] = np.zeros((2, 2), dtype=np.float32)
    with pytest.raises(PlanError, match=r"'0.0.weight' has shape \[2, 2\]"):
        load_module_state(model, optimizer, state)


def test_a_member_state_round_trips_with_its_momentum() -> None:
    """One SGD step (lr 0.1, momentum 0.9) leaves momentum = the gradient; the
    state reloaded into a fresh model and optimiser takes the same second step."""
    torch.manual_seed(0)
    first = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten(), nn.Linear(8, 2))
    x = torch.randn(3, 1, 4, 4)

    def step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        optimizer.zero_grad()
        model(x).square().sum().backward()
        optimizer.step()

    opt = torch.optim.SGD(first.parameters(), lr=0.1, momentum=0.9)
    step(first, opt)
    state = module_state(first, opt)
    grad = first[0].weight.grad
    assert grad is not None
    torch.testing.assert_close(state["momentum:0.weight"], grad)
    arrays, momentum = result_arrays(state)
    assert sorted(arrays) == sorted(first.state_dict())
    assert sorted(momentum) == sorted(n for n, _ in first.named_parameters())
    second = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten(), nn.Linear(8, 2))
    opt2 = torch.optim.SGD(second.parameters(), lr=0.1, momentum=0.9)
    reloaded = {**arrays, **{f"momentum:{k}": v for k, v in momentum.items()}}
    load_module_state(second, opt2, reloaded, strict=True)
    step(first, opt)
    step(second, opt2)
    for a, b in zip(first.parameters(), second.parameters(), strict=True):
        torch.testing.assert_close(a, b)


def test_a_dataset_of_another_shape_is_named() -> None:
    with pytest.raises(PlanError, match="samples of shape \\[1, 32, 32\\]"):
        JobData("digits32", (3, 32, 32), 10)
    x, y = JobData("synthetic", (3, 8, 8), 5).batch(seed=1, step=4, size=3)
    again, _ = JobData("synthetic", (3, 8, 8), 5).batch(seed=1, step=4, size=3)
    assert x.shape == (3, 3, 8, 8) and torch.equal(x, again)
    assert int(y.max()) < 5


def test_rank_zero_evaluates_the_whole_model(tmp_path: Path) -> None:
    args = {"in_channels": 1, "width": 4}
    model = build_sequential("vgg", args, seed=0)
    arrays = {k: v.numpy() for k, v in model.state_dict().items()}
    query = {"model": "vgg", "model_args": args, "dataset": "digits32"}
    result = evaluate(
        {**query, "eval-samples": 50}, MemberContext("127.0.0.1", tmp_path), arrays
    )
    assert result.metrics["num-examples"] == 50
    assert 0.0 <= float(result.metrics["accuracy"]) <= 1.0
    with pytest.raises(PlanError, match="needs a built-in dataset"):
        evaluate(
            {**query, "dataset": "synthetic"}, MemberContext("x", tmp_path), arrays
        )
