"""DDP members on 3 local processes: identical replicas, equal to one large batch."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from flowerbed.models import build_sequential
from flowerbed.parallel.group import free_port
from flowerbed.parallel.job_data import batch_indices, load_job_dataset
from flowerbed.parallel.large_batch.allreduce import (
    build_member_model,
    evaluate,
    make_optimizer,
    profile,
    run,
)
from flowerbed.parallel.large_batch.recipe import LrSchedule, share_bounds
from flowerbed.parallel.member import MemberContext
from flowerbed.parallel.plan import MemberPlan, PlanError
from ranks import run_ranks
from torch import nn

HOST = "127.0.0.1"
SHARES = [2, 4, 6]
BATCH = sum(SHARES)
SCHEDULE = LrSchedule(base_lr=0.05, base_batch=4, batch_size=BATCH, warmup_steps=2)
MODEL_ARGS = {"hidden": 16, "depth": 3}


def plan_of(rank: int, port: int, **changes: object) -> MemberPlan:
    fields: dict = {
        "mode": "allreduce",
        "job": "ddp-test",
        "segment": 1,
        "rank": rank,
        "world_size": len(SHARES),
        "host": HOST,
        "port": port,
        "start_step": 0,
        "steps": 3,
        "batch_size": BATCH,
        "seed": 5,
        "join_timeout_s": 60.0,
        "timeout_s": 30.0,
        "model": "deep-mlp",
        "model_args": MODEL_ARGS,
        "dataset": "digits",
        "momentum": 0.9,
        "batch_share": share_bounds(SHARES)[rank],
        "options": {
            "optimizer": "lars",
            "trust": 0.02,
            "schedule": SCHEDULE.to_config(),
        },
    }
    fields.update(changes)
    return MemberPlan(**fields)


def initial() -> dict[str, np.ndarray]:
    model = build_sequential("deep-mlp", MODEL_ARGS, seed=11)
    return {k: v.numpy().copy() for k, v in model.state_dict().items()}


def member(rank: int, ports: list[int], root: str) -> list[dict]:
    """Three segments from the same weights: exact, fp16 and PowerSGD gradients."""
    replies = []
    for port, compression in zip(ports, ("none", "fp16", "powersgd"), strict=True):
        plan = plan_of(rank, port, segment=len(replies) + 1)
        plan = plan.with_changes(options={**plan.options, "compression": compression})
        out = run(plan, MemberContext(address=HOST, store_root=Path(root)), initial())
        replies.append({"ok": out.ok, "arrays": out.arrays, "metrics": out.metrics})
    return replies


def one_large_batch() -> dict[str, np.ndarray]:
    """The same 3 steps on one process with the whole batch of 12 each step."""
    plan = plan_of(0, 1)
    model = build_member_model(plan, initial())
    optimizer = make_optimizer(plan)
    data = load_job_dataset("digits")
    x = torch.from_numpy(data.x_train)
    y = torch.from_numpy(data.y_train).long()
    params = dict(model.named_parameters())
    views = {n: p.detach().numpy() for n, p in params.items()}
    for step in range(3):
        idx = torch.from_numpy(batch_indices(5, step, len(x), BATCH))
        nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
        grads = {n: p.grad.numpy() for n, p in params.items()}  # type: ignore[union-attr]
        optimizer.step(views, grads, SCHEDULE.lr(step))
        model.zero_grad(set_to_none=True)
    return {k: v.numpy() for k, v in model.state_dict().items()}


@pytest.mark.slow
def test_replicas_are_identical_and_equal_one_batch_of_their_sum(
    tmp_path: Path,
) -> None:
    ports = [free_port(), free_port(), free_port()]
    results = run_ranks(member, 3, ports, str(tmp_path), timeout=240)
    assert all(status == "ok" for status, _ in results.values()), {
        r: (s, v if s != "ok" else "") for r, (s, v) in results.items()
    }
    exact = [results[r][1][0] for r in range(3)]
    assert all(r["ok"] for r in exact)
    for name, array in exact[0]["arrays"].items():
        for other in exact[1:]:
            np.testing.assert_array_equal(other["arrays"][name], array)
    reference = one_large_batch()
    start = initial()
    for name, array in reference.items():
        np.testing.assert_allclose(
            exact[0]["arrays"][name], array, rtol=1e-5, atol=1e-6
        )
        assert not np.array_equal(array, start[name])
    m = exact[2]["metrics"]
    assert m["num-examples"] == 6 * 3 and m["num-steps"] == 3
    assert len(m["span-step-compute-s"]) == 3 and len(m["span-step-comm-s"]) == 3
    assert m["span-lr"] == pytest.approx(SCHEDULE.lr(2))
    # DDP's fp16 hook: gradients travel as float16; replicas still agree exactly,
    # and land close to (not on) the exact large batch
    half = [results[r][1][1] for r in range(3)]
    for name, array in half[0]["arrays"].items():
        for other in half[1:]:
            np.testing.assert_array_equal(other["arrays"][name], array)
        np.testing.assert_allclose(array, reference[name], rtol=1e-2, atol=1e-3)
    # PowerSGD (rank 1, exact all-reduce for the first step, then low-rank):
    # lossy, but every replica applies the same decompressed gradient
    low_rank = [results[r][1][2] for r in range(3)]
    assert all(r["ok"] for r in low_rank)
    for name, array in low_rank[0]["arrays"].items():
        for other in low_rank[1:]:
            np.testing.assert_array_equal(other["arrays"][name], array)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"batch_share": ()}, "non-empty batch_share"),
        ({"options": {"optimizer": "adam"}}, "valid choices: sgd, lars, lamb"),
        ({"model": "no-such"}, "unknown model .no-such.; valid choices"),
    ],
)
def test_bad_plans_are_named_before_joining(changes: dict, message: str) -> None:
    plan = plan_of(0, free_port(), **changes)
    context = MemberContext(address=HOST, store_root=Path("/nonexistent"))
    with pytest.raises(PlanError, match=message):
        run(plan, context, initial())


def test_weights_of_another_model_are_refused() -> None:
    plan = plan_of(0, free_port())
    with pytest.raises(PlanError, match="weights do not fit model 'deep-mlp'"):
        build_member_model(plan, {"fc.weight": np.zeros((2, 2), np.float32)})


def test_profile_measures_speed_and_evaluate_scores_the_model() -> None:
    context = MemberContext(address=HOST, store_root=Path("/nonexistent"))
    query = {"model": "deep-mlp", "model_args": MODEL_ARGS, "dataset": "digits"}
    speed = profile({**query, "batch": 8, "repeats": 2}, context)
    assert speed.ok and speed.metrics["samples-per-s"] > 0
    assert speed.info["address"] == HOST
    scored = evaluate(query, context, initial())
    data = load_job_dataset("digits")
    assert scored.metrics["num-examples"] == len(data.x_test)
    assert 0.0 <= scored.metrics["eval-acc"] <= 1.0
