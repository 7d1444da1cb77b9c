"""A user's model, loss and optimiser in span jobs (flowerbed.parallel.user_code),
and the single-device reference users check a run against
(flowerbed.parallel.reference)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import reference
import torch
from flowerbed.models import ModelCutError, build_sequential
from flowerbed.parallel import (
    ReferenceJob,
    Training,
    UserCodeError,
    build_layers,
    build_module,
    single_device,
)
from flowerbed.parallel.large_batch.allreduce import GroupRun, run_group
from flowerbed.parallel.member import MemberContext, load_module_state, module_state
from flowerbed.strategies import LargeBatchSync, PipelineTraining, TiledTraining
from flowerbed.strategies.large_batch_options import AllReduceRecipe
from flowerbed.strategies.tile_options import TilePlanning
from torch import nn

LOSS = "span_user_code:smooth_loss"
ADAM = "span_user_code:adam"


# --------------------------------------------------------------------------------
# Names: form, import, what they name
# --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"loss": "smooth_loss"}, r"not a name of the form 'package.module:attribute'"),
        ({"loss": "a.b:c d"}, "not a name of the form"),
        ({"optimizer": "torch.optim.AdamW"}, "not a name of the form"),
        ({"optimizer_args": {"betas": [0.9, 0.99]}}, "no optimizer"),
        ({"optimizer": ADAM, "optimizer_args": {"lr": 0.1}}, r"may not set \['lr'\]"),
        ({"optimizer": ADAM, "optimizer_args": {"f": object()}}, "JSON values"),
    ],
)
def test_malformed_training_names_are_refused_saying_the_valid_form(
    settings: dict, message: str
) -> None:
    with pytest.raises(UserCodeError, match=message):
        Training(**settings)


@pytest.mark.parametrize(
    ("loss", "message"),
    [
        ("no_such_lab.losses:smooth", r"module 'no_such_lab.losses' cannot be"),
        ("span_user_code:missing", r"has no attribute 'missing'"),
        ("span_user_code:NOT_CALLABLE", r"is a int, not a function or class"),
    ],
)
def test_a_loss_that_does_not_resolve_fails_when_the_strategy_is_built(
    loss: str, message: str
) -> None:
    with pytest.raises(UserCodeError, match=message):
        LargeBatchSync(training=Training(loss=loss))


def test_run_config_keys_give_the_training_and_bad_values_are_named() -> None:
    got = Training.from_run_config(
        {"loss": LOSS, "optimizer": ADAM, "optimizer-args": '{"eps": 1e-6}', "x": 1}
    )
    assert got == Training(LOSS, ADAM, {"eps": 1e-6})
    assert Training.from_run_config({}) == Training()
    with pytest.raises(UserCodeError, match="'optimizer-args' is not valid JSON"):
        Training.from_run_config({"optimizer": ADAM, "optimizer-args": "{eps: 1}"})
    with pytest.raises(UserCodeError, match="must be a JSON object"):
        Training.from_run_config({"optimizer": ADAM, "optimizer-args": "[1]"})
    with pytest.raises(UserCodeError, match="'loss' must be a string"):
        Training.from_run_config({"loss": 3})


def test_the_plan_options_carry_the_training_there_and_back() -> None:
    training = Training(LOSS, ADAM, {"eps": 1e-6})
    assert Training.from_options(training.to_options()) == training
    assert Training.from_options({}) == Training()


def test_a_factory_that_does_not_give_an_optimizer_is_named() -> None:
    params = list(nn.Linear(2, 2).parameters())
    bad = Training(optimizer="span_user_code:two_branch")
    with pytest.raises(UserCodeError, match="cannot be called as"):
        bad.make_optimizer(params, 0.1, lambda ps: None)
    lbfgs = Training(optimizer="torch.optim:LBFGS")
    with pytest.raises(UserCodeError, match="LBFGS"):
        lbfgs.make_optimizer(params, 0.1, lambda ps: None)


# --------------------------------------------------------------------------------
# Models: any module for data parallelism, cut points for pipeline and tiles
# --------------------------------------------------------------------------------


def test_large_batch_takes_a_module_that_is_not_sequential() -> None:
    strategy = LargeBatchSync(model="span_user_code:two_branch")
    assert "left.weight" in strategy.reference_state
    assert not isinstance(build_module("span_user_code:two_branch"), nn.Sequential)


def test_a_pipeline_says_what_it_cannot_cut_and_the_ways_out() -> None:
    with pytest.raises(ModelCutError) as err:
        PipelineTraining(model="span_user_code:two_branch", input_shape=(1, 8, 8))
    text = str(err.value)
    assert "is a TwoBranch, not an nn.Sequential" in text
    assert "pipeline_layers()" in text and "LargeBatchSync" in text
    with pytest.raises(ModelCutError, match=r"leaves out 2 weights .*head\.weight"):
        build_layers("span_user_code:half_cut")


def test_a_module_with_cut_points_is_cut_there() -> None:
    layers = build_layers("span_user_code:cut_net", {"hidden": 8}, seed=0)
    assert isinstance(layers, nn.Sequential) and len(layers) == 4
    strategy = PipelineTraining(
        model="span_user_code:cut_net", model_args={"hidden": 8}, input_shape=(1, 8, 8)
    )
    assert strategy.num_layers == 4
    assert sorted(strategy.reference_state) == sorted(layers.state_dict())


def test_sequential_models_build_the_same_weights_as_before() -> None:
    args = {"hidden": 8, "depth": 2}
    old = build_sequential("deep-mlp", args, seed=3).state_dict()
    new = build_layers("deep-mlp", args, seed=3).state_dict()
    assert all(torch.equal(old[k], new[k]) for k in old)


def test_every_span_strategy_takes_the_training_option() -> None:
    training = Training(LOSS, ADAM)
    for strategy in (
        PipelineTraining(model="deep-mlp", input_shape=(1, 8, 8), training=training),
        LargeBatchSync(training=training),
        TiledTraining(model="vgg", input_shape=(1, 32, 32), training=training),
    ):
        assert strategy.training is training
        assert strategy.reference_job().training is training


# --------------------------------------------------------------------------------
# Optimiser state travels between segments
# --------------------------------------------------------------------------------


def test_adam_state_saved_and_loaded_continues_as_one_process() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))

    def step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    one = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    one.load_state_dict(net.state_dict())
    opt = torch.optim.Adam(one.parameters(), lr=0.01)
    for _ in range(3):
        step(one, opt)
    saved = module_state(one, opt)
    assert "momentum:0.weight@exp_avg" in saved and "momentum:0.weight@step" in saved
    two = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    opt2 = torch.optim.Adam(two.parameters(), lr=0.01)
    load_module_state(two, opt2, {k: v.numpy() for k, v in saved.items()})
    step(one, opt)
    step(two, opt2)
    for name, value in one.state_dict().items():
        assert torch.equal(two.state_dict()[name], value), name


# --------------------------------------------------------------------------------
# Exactness with a user's loss and optimiser, against the public reference
# --------------------------------------------------------------------------------


def test_the_public_reference_is_the_tests_own_yardstick() -> None:
    args = {"in_features": 64, "hidden": 24, "depth": 3}
    job = ReferenceJob(
        model="deep-mlp", model_args=args, batch_size=16, lr=0.1, momentum=0.9
    )
    initial = build_sequential("deep-mlp", args, seed=0).state_dict()
    got = single_device(job, initial, steps=5)
    want = reference.single_process("deep-mlp", args, 5, 16, 0.1, 0.9)
    for name, value in want.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)


def two_segments(
    strategy: LargeBatchSync, initial: dict[str, np.ndarray]
) -> tuple[dict[str, np.ndarray], list[GroupRun]]:
    """Two segments of ``strategy``'s plans for nodes 1 and 2 (10 and 20
    samples/s) run in process from ``initial``, the optimiser state passing
    through the server between them as it does in a run: the last weights and
    state, and each segment's run."""
    strategy.speeds = {1: 10.0, 2: 20.0}
    strategy.addresses = {1: "127.0.0.1", 2: "127.0.0.1"}
    context = MemberContext(address="127.0.0.1", store_root=Path("/nonexistent"))
    arrays: dict[str, np.ndarray] = dict(initial)
    runs = []
    for _ in range(2):
        plans = strategy.plans([1, 2], strategy.steps_per_round)
        run = run_group(list(plans.values()), context, arrays)
        runs.append(run)
        state = {"momentum:" + k: v for k, v in run.optimizer.items()}
        arrays = {**run.arrays, **state}
        strategy.step += strategy.steps_per_round
    return arrays, runs


def test_large_batch_in_process_with_a_user_model_loss_and_adam_equals_one_device() -> (
    None
):
    """Two members, two segments (Adam's state goes through the server between
    them): the weights equal single_device on the strategy's reference_job."""
    strategy = LargeBatchSync(
        model="span_user_code:two_branch",
        batch_size=24,
        steps_per_round=3,
        training=Training(LOSS, ADAM, {"eps": 1e-6}),
        fraction_evaluate=0.0,
        recipe=AllReduceRecipe(base_lr=0.01, base_batch=24),
    )
    initial = {
        k: v.numpy()
        for k, v in build_module("span_user_code:two_branch", seed=0)
        .state_dict()
        .items()
    }
    arrays, runs = two_segments(strategy, initial)
    for run in runs:
        assert run.steps == 3
        assert any("@exp_avg" in k for k in run.optimizer)
    want = single_device(strategy.reference_job(), initial, steps=6)
    for name, value in want.items():
        np.testing.assert_allclose(arrays[name], value, rtol=1e-5, atol=2e-6)
    # and it is not the default training's result
    plain = single_device(
        ReferenceJob(**{**vars(strategy.reference_job()), "training": Training()}),
        initial,
        steps=6,
    )
    assert not np.allclose(plain["head.weight"], want["head.weight"], atol=1e-4)


def test_the_summary_line_names_the_loss_and_the_optimiser() -> None:
    assert Training().describe("SGD") == "loss cross-entropy, optimiser SGD"
    line = Training(LOSS, ADAM, {"eps": 1e-06}).describe("lars")
    assert line == f"loss {LOSS}, optimiser {ADAM}(eps=1e-06)"


@pytest.mark.parametrize("optimizer", ["lars", "lamb", "sgd"])
def test_the_reference_of_the_default_large_batch_recipe_matches_the_group(
    optimizer: str,
) -> None:
    """No user code: LARS/LAMB/momentum SGD with warm-up, two segments."""
    strategy = LargeBatchSync(
        model="deep-mlp",
        model_args={"hidden": 16, "depth": 2},
        batch_size=24,
        steps_per_round=2,
        fraction_evaluate=0.0,
        recipe=AllReduceRecipe(
            optimizer=optimizer,
            base_lr=0.05,
            base_batch=8,
            warmup_steps=3,
        ),
    )
    initial = {
        k: v.numpy()
        for k, v in build_module("deep-mlp", strategy.model_args, seed=0)
        .state_dict()
        .items()
    }
    arrays, _ = two_segments(strategy, initial)
    want = single_device(strategy.reference_job(), initial, steps=4)
    for name, value in want.items():
        np.testing.assert_allclose(arrays[name], value, rtol=1e-5, atol=2e-6)


def test_a_frozen_norm_tile_job_has_no_reference_before_its_front_is_planned() -> None:
    strategy = TiledTraining(
        model="vgg", input_shape=(1, 32, 32), planning=TilePlanning(norm="frozen")
    )
    with pytest.raises(ValueError, match="after start"):
        strategy.reference_job()
