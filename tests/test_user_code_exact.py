"""Exactness with a user's model, loss and optimiser, on real gloo groups.

Each job runs its members as separate processes joined by torch.distributed
(gloo on 127.0.0.1) and must end where :func:`flowerbed.parallel.single_device`
ends on the job's ``reference_job()``-style description: a pipeline of a module
that names its cut points, large-batch DDP of a module that is not an
``nn.Sequential``, and fused tiles — each with label-smoothed cross-entropy and
Adam, whose state crosses from one segment to the next as it would through the
server.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flowerbed.parallel import ReferenceJob, Training, build_layers, single_device
from flowerbed.parallel.group import free_port
from flowerbed.parallel.large_batch import allreduce
from flowerbed.parallel.member import MemberContext
from flowerbed.parallel.pipeline.stage import run_segment
from flowerbed.parallel.plan import LayerSource, MemberPlan
from flowerbed.parallel.tiles import runner
from flowerbed.parallel.user_code import build_module
from flowerbed.strategies import LargeBatchSync, PipelineTraining
from flowerbed.strategies.large_batch_options import AllReduceRecipe
from flowerbed.strategies.pipeline_options import PipelinePlanning
from flowerbed.strategies.span_options import SpanGroup
from ranks import run_ranks
from test_tiles_exact import plan_of, settings

pytestmark = pytest.mark.slow

HOST = "127.0.0.1"
TRAINING = Training("span_user_code:smooth_loss", "span_user_code:adam", {"eps": 1e-6})
PREFIX = "momentum:"


def _state(arrays: dict, optimizer: dict) -> dict[str, np.ndarray]:
    return {**arrays, **{PREFIX + k: v for k, v in optimizer.items()}}


def _close(
    got: dict[str, np.ndarray], want: dict[str, np.ndarray], atol: float
) -> None:
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=atol, err_msg=name)


# --------------------------------------------------------------------------------
# Pipeline: a module with cut points, two segments
# --------------------------------------------------------------------------------

PIPE_MODEL, PIPE_ARGS = "span_user_code:cut_net", {"hidden": 24}
PIPE_BATCH, PIPE_LR, PIPE_STEPS = 16, 0.01, 4


def pipe_plan(rank: int, port: int, start: int) -> MemberPlan:
    return MemberPlan(
        mode="pipeline",
        job="user-code",
        segment=start + 1,
        rank=rank,
        world_size=2,
        host=HOST,
        port=port,
        start_step=start,
        steps=PIPE_STEPS,
        batch_size=PIPE_BATCH,
        micro_batches=4,
        schedule="1f1b",
        replicate_every=2,
        join_timeout_s=60,
        timeout_s=60,
        model=PIPE_MODEL,
        model_args=PIPE_ARGS,
        dataset="digits",
        lr=PIPE_LR,
        partition=(0, 2, 4),
        sources=tuple(LayerSource(layer, "central", -1, start) for layer in range(4)),
        options={"input-shape": [1, 8, 8], **TRAINING.to_options()},
    )


def pipe_member(rank: int, ports: list[int], store: str, arrays: dict) -> dict:
    context = MemberContext(address=HOST, store_root=Path(store) / str(rank))
    out: dict[str, np.ndarray] = {}
    for segment, port in enumerate(ports):
        plan = pipe_plan(rank, port, segment * PIPE_STEPS)
        mine = {
            k: v
            for k, v in arrays.items()
            if int(k.split(".")[0].split(":")[-1]) in plan.layers
        }
        result = run_segment(plan, context, mine)
        assert result.ok, result.failure
        out = _state(result.arrays, result.optimizer)
        arrays = {**arrays, **out}  # the central copy the server would send back
    return out


def test_a_pipeline_of_a_module_with_cut_points_and_a_user_loss_and_adam_is_exact(
    tmp_path: Path,
) -> None:
    initial = {
        k: v.numpy().copy()
        for k, v in build_layers(PIPE_MODEL, PIPE_ARGS, seed=0).state_dict().items()
    }
    ports = [free_port(), free_port()]
    results = run_ranks(pipe_member, 2, ports, str(tmp_path), initial, timeout=240)
    got: dict[str, np.ndarray] = {}
    for rank in range(2):
        status, value = results[rank]
        assert status == "ok", value
        got.update({k: v for k, v in value.items() if not k.startswith(PREFIX)})
        assert any("@exp_avg" in k for k in value)
    job = ReferenceJob(
        model=PIPE_MODEL,
        model_args=PIPE_ARGS,
        batch_size=PIPE_BATCH,
        lr=PIPE_LR,
        training=TRAINING,
        layered=True,
    )
    _close(got, single_device(job, initial, steps=2 * PIPE_STEPS), atol=2e-6)


# --------------------------------------------------------------------------------
# Large batch: DDP of a module that is not an nn.Sequential
# --------------------------------------------------------------------------------


def lb_member(rank: int, plans: list[MemberPlan], arrays: dict) -> dict:
    context = MemberContext(address=HOST, store_root=Path("/nonexistent"))
    result = allreduce.run(plans[rank], context, arrays)
    assert result.ok, result.failure
    return _state(result.arrays, result.optimizer)


def test_large_batch_ddp_of_any_module_with_a_user_loss_and_adam_is_exact() -> None:
    strategy = LargeBatchSync(
        model="span_user_code:two_branch",
        batch_size=24,
        steps_per_round=3,
        training=TRAINING,
        rendezvous_port=free_port(),
        rendezvous_ports=1,
        fraction_evaluate=0.0,
        recipe=AllReduceRecipe(base_lr=0.01, base_batch=24),
    )
    strategy.speeds, strategy.addresses = {1: 10.0, 2: 25.0}, {1: HOST, 2: HOST}
    initial = {
        k: v.numpy().copy()
        for k, v in build_module(strategy.model, seed=0).state_dict().items()
    }
    plans = list(strategy.plans([1, 2], 3).values())
    results = run_ranks(lb_member, 2, plans, initial, timeout=240)
    for rank in range(2):
        status, value = results[rank]
        assert status == "ok", value
        got = {k: v for k, v in value.items() if not k.startswith(PREFIX)}
        _close(got, single_device(strategy.reference_job(), initial, 3), atol=2e-6)


# --------------------------------------------------------------------------------
# Tiles: the head's loss is the user's
# --------------------------------------------------------------------------------

TILE_CASE: dict[str, Any] = {"weights": [1, 2], "norm": "none"}


def tile_member(rank: int, port: int, store: str) -> dict:
    from test_tiles_exact import initial_state

    plan = plan_of(TILE_CASE, rank, 2, port)
    plan = plan.with_changes(options={**plan.options, **TRAINING.to_options()})
    context = MemberContext(address=HOST, store_root=Path(store) / str(rank))
    result = runner.run(plan, context, initial_state(TILE_CASE))
    assert result.ok, result.failure
    return dict(result.arrays)


def test_tiles_with_a_user_loss_and_adam_are_exact(tmp_path: Path) -> None:
    from test_tiles_exact import (
        BATCH,
        CLASSES,
        LR,
        MODEL,
        SEED,
        SHAPE,
        STEPS,
        initial_state,
        model_args,
    )

    results = run_ranks(tile_member, 2, free_port(), str(tmp_path), timeout=240)
    status, got = results[0]
    assert status == "ok", got
    assert results[1][0] == "ok", results[1][1]
    job = ReferenceJob(
        model=MODEL,
        model_args=model_args(TILE_CASE),
        dataset="synthetic",
        batch_size=BATCH,
        seed=SEED,
        lr=LR,
        training=TRAINING,
        input_shape=SHAPE,
        num_classes=CLASSES,
        layered=True,
    )
    assert settings(TILE_CASE, 2).norm == "sync"
    _close(got, single_device(job, initial_state(TILE_CASE), steps=STEPS), atol=2e-6)


# --------------------------------------------------------------------------------
# Through Flower: the span ClientApp receives the names in its plan and imports
# them; the strategy's result equals its reference_job() on one device
# --------------------------------------------------------------------------------


def _grid(count: int) -> Any:
    from flowerbed.sims.process_grid import ProcessGrid

    configs = [{"address": HOST, "emulate-gflops": 0.5} for _ in range(count)]
    return ProcessGrid(
        "flowerbed.clients.span_app:app", configs, unavailable_after_s=2.0
    )


def _span_settings() -> dict[str, Any]:
    return {
        "fraction_evaluate": 0.0,
        "min_train_nodes": 2,
        "min_available_nodes": 2,
        "group": SpanGroup(
            rendezvous_port=free_port(),
            rendezvous_ports=20,
            join_timeout_s=30,
            timeout_s=20,
            reply_margin_s=3,
        ),
        "training": TRAINING,
    }


def _arrays(record: Any) -> dict[str, np.ndarray]:
    return {k: v.numpy() for k, v in record.items()}


def test_large_batch_sync_on_span_clientapps_trains_any_module_with_user_code() -> None:
    from flwr.app import ArrayRecord

    strategy = LargeBatchSync(
        model="span_user_code:two_branch",
        batch_size=24,
        steps_per_round=3,
        **_span_settings(),
        recipe=AllReduceRecipe(base_lr=0.01, base_batch=24),
    )
    initial = ArrayRecord(build_module(strategy.model, seed=0).state_dict())
    with _grid(2) as grid:
        result = strategy.start(grid, initial, num_rounds=2, timeout=180)
    assert strategy.step == 6
    want = single_device(strategy.reference_job(), _arrays(initial), steps=6)
    _close(_arrays(result.arrays), want, atol=2e-6)


def pipe_training(**options: Any) -> PipelineTraining:
    """PipelineTraining of the cut-point module in two stages of two layers on
    two span ClientApps, with the user's loss and Adam, and ``options``."""
    return PipelineTraining(
        model=PIPE_MODEL,
        model_args=PIPE_ARGS,
        input_shape=(1, 8, 8),
        batch_size=PIPE_BATCH,
        steps_per_round=PIPE_STEPS,
        lr=PIPE_LR,
        planning=PipelinePlanning(stage_sizes=(2, 2)),
        **_span_settings(),
        **options,
    )


def test_pipeline_training_on_span_clientapps_cuts_a_module_at_its_cut_points() -> None:
    from flwr.app import ArrayRecord

    strategy = pipe_training()
    initial = ArrayRecord(build_layers(PIPE_MODEL, PIPE_ARGS, seed=0).state_dict())
    with _grid(2) as grid:
        result = strategy.start(grid, initial, num_rounds=2, timeout=180)
    assert strategy.step == 2 * PIPE_STEPS
    want = single_device(strategy.reference_job(), _arrays(initial), steps=8)
    _close(_arrays(result.arrays), want, atol=2e-6)
