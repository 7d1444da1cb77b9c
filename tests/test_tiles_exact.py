"""Fused-tile training equals single-device training, on 2, 4 and 6 processes.

Every rank is a real process joined by ``torch.distributed`` (gloo over
127.0.0.1, free ports). Per world size one set of processes runs several cases
in turn (one fresh group each), to keep the test's cost to a few spawns:

- forward: every group's output tile equals the same pixels of the full map;
- gradients: after one step the (all-reduced) gradients of every rank's
  weights equal single-device gradients;
- training: three SGD steps (momentum, weight decay) through the board's
  runner (:func:`flowerbed.parallel.tiles.runner.run`) end with rank 0 holding the
  weights single-device training reaches on the same batches.

The model has every kind of window the tracer handles: 3x3 "same" convs, a
stride-2 conv, a dilated conv, max and average pooling, and a normalisation
(none, group norm, batch norm with shared statistics, or frozen batch norm).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from flowerbed.models import build_sequential
from flowerbed.parallel.group import free_port, joined_group
from flowerbed.parallel.member import MemberContext
from flowerbed.parallel.plan import MemberPlan
from flowerbed.parallel.tiles.exact_step import TiledMember, TileSettings, front_names
from flowerbed.parallel.tiles.layout import layout
from flowerbed.parallel.tiles.region_ops import freeze_front_norms, front_geometry
from flowerbed.parallel.tiles.runner import JobData, run
from ranks import run_ranks
from torch import nn

pytestmark = pytest.mark.slow

HOST = "127.0.0.1"
MODEL = "test_tiles_exact:small_cnn"
SHAPE = (3, 48, 48)
BOUNDS = (0, 2, 4, 6)
BATCH = 3
SEED = 7
STEPS = 3
LR, MOMENTUM, DECAY = 0.05, 0.9, 1e-4
CLASSES = 5


def small_cnn(norm: str = "none", width: int = 4) -> nn.Sequential:
    """Six tileable layers (48x48 -> 6x6) and a linear head."""

    def normed(channels: int) -> nn.Module:
        if norm == "group":
            return nn.GroupNorm(2, channels)
        if norm in ("batch", "frozen"):
            return nn.BatchNorm2d(channels)
        return nn.Identity()

    w = width
    return nn.Sequential(
        nn.Sequential(nn.Conv2d(3, w, 3, padding=1), normed(w), nn.ReLU()),
        nn.Sequential(nn.Conv2d(w, w, 3, padding=1), nn.LeakyReLU(0.1)),
        nn.MaxPool2d(2),
        nn.Sequential(nn.Conv2d(w, 2 * w, 3, 2, 1), normed(2 * w), nn.ReLU()),
        nn.Sequential(nn.Conv2d(2 * w, 2 * w, 3, padding=2, dilation=2), nn.SiLU()),
        nn.AvgPool2d(2),
        nn.Sequential(nn.Flatten(), nn.Linear(2 * w * 6 * 6, CLASSES)),
    )


def settings(case: dict[str, Any], world: int) -> TileSettings:
    return TileSettings(
        input_shape=SHAPE,
        bounds=BOUNDS,
        weights=tuple(case["weights"]),
        bands=2 if world > 2 else 1,
        norm="frozen" if case["norm"] == "frozen" else "sync",
        num_classes=CLASSES,
    )


def model_args(case: dict[str, Any]) -> dict[str, Any]:
    return {"norm": case["norm"]}


def initial_state(case: dict[str, Any]) -> dict[str, np.ndarray]:
    model = build_sequential(MODEL, model_args(case), seed=SEED)
    # Non-trivial batch-norm statistics, so frozen mode is tested for real.
    for module in model.modules():
        if isinstance(module, nn.BatchNorm2d):
            assert module.running_mean is not None and module.running_var is not None
            module.running_mean.uniform_(-0.5, 0.5)
            module.running_var.uniform_(0.5, 2.0)
    return {k: v.numpy().copy() for k, v in model.state_dict().items()}


def plan_of(case: dict[str, Any], rank: int, world: int, port: int) -> MemberPlan:
    return MemberPlan(
        mode="tiles",
        job="exact",
        segment=1,
        rank=rank,
        world_size=world,
        host=HOST,
        port=port,
        start_step=0,
        steps=STEPS,
        batch_size=BATCH,
        seed=SEED,
        join_timeout_s=60,
        timeout_s=60,
        model=MODEL,
        model_args=model_args(case),
        dataset="synthetic",
        lr=LR,
        momentum=MOMENTUM,
        weight_decay=DECAY,
        options=settings(case, world).options(),
    )


def tiled_rank(
    rank: int, world: int, ports: list[int], cases: list[dict[str, Any]], tmp: str
) -> list[dict[str, Any]]:
    """Runs in each rank's process: every case, one group each."""
    out: list[dict[str, Any]] = []
    port_iter = iter(ports)
    for case in cases:
        plan = plan_of(case, rank, world, next(port_iter))
        state = initial_state(case)
        found: dict[str, Any] = {}
        # forward tiles and one step's gradients (learning rate 0: no update)
        tiles = settings(case, world)
        model = build_sequential(MODEL, model_args(case))
        model.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()})
        geometry = front_geometry(model, SHAPE, tiles.norm, costs=False)
        lay = layout(geometry, BOUNDS, tiles.weights, tiles.bands)
        member = TiledMember(model, lay, rank, tiles)
        frozen = torch.optim.SGD(member.modules().parameters(), lr=0.0)
        x, y = JobData("synthetic", SHAPE, CLASSES).batch(SEED, 0, BATCH)
        with joined_group(plan, HOST):
            found["tiles"] = [t.detach().numpy() for t in member.forward(x).outputs]
            member.step(x, y, frozen, 0)
        found["grads"] = {
            n: p.grad.numpy().copy()
            for n, p in member.modules().named_parameters()
            if p.grad is not None
        }
        if case.get("train"):
            arrays = (
                state
                if rank == 0
                else {n: state[n] for n in front_names(list(state), BOUNDS[-1])}
            )
            context = MemberContext(address=HOST, store_root=Path(tmp) / str(rank))
            result = run(plan.with_changes(port=next(port_iter)), context, arrays)
            found["ok"] = result.ok
            found["failure"] = result.failure
            found["arrays"] = result.arrays
            found["loss"] = result.metrics.get("train-loss")
        out.append(found)
    return out


def initial_model(case: dict[str, Any]) -> nn.Sequential:
    """The single-device model of ``case`` in its initial state, training, its
    front's norms frozen when the case's are."""
    model = build_sequential(MODEL, model_args(case))
    model.load_state_dict(
        {k: torch.from_numpy(v) for k, v in initial_state(case).items()}
    )
    model.train()
    if case["norm"] == "frozen":
        freeze_front_norms(model, BOUNDS[-1])
    return model


def reference(
    case: dict[str, Any], steps: int = STEPS, seed: int = SEED
) -> dict[str, Any]:
    """Single-device: the front's maps, one step's gradients, ``steps`` steps'
    weights (batches of ``seed``)."""
    model = initial_model(case)
    data = JobData("synthetic", SHAPE, CLASSES)
    x, y = data.batch(SEED, 0, BATCH)
    maps, h = [], x
    with torch.no_grad():
        probe = build_sequential(MODEL, model_args(case))
        probe.load_state_dict(model.state_dict())
        probe.train()
        if case["norm"] == "frozen":
            freeze_front_norms(probe, BOUNDS[-1])
        for i, layer in enumerate(probe):
            h = layer(h)
            if i + 1 in BOUNDS[1:]:
                maps.append(h.numpy())
    F.cross_entropy(model(x), y).backward()
    grads = {
        n: p.grad.numpy().copy()
        for n, p in model.named_parameters()
        if p.grad is not None
    }
    trained = initial_model(case)
    sgd = torch.optim.SGD(
        trained.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=DECAY
    )
    for step in range(steps):
        xs, ys = data.batch(seed, step, BATCH)
        sgd.zero_grad()
        F.cross_entropy(trained(xs), ys).backward()
        sgd.step()
    return {
        "maps": maps,
        "grads": grads,
        "state": {k: v.numpy() for k, v in trained.state_dict().items()},
    }


def check_world(world: int, cases: list[dict[str, Any]], tmp_path: Path) -> None:
    ports = [free_port() for _ in range(2 * len(cases))]
    results = run_ranks(
        tiled_rank, world, world, ports, cases, str(tmp_path), timeout=300
    )
    for rank in range(world):
        status, value = results[rank]
        assert status == "ok", f"rank {rank}: {status}: {value}"
    for index, case in enumerate(cases):
        expected = reference(case)
        tiles = settings(case, world)
        model = build_sequential(MODEL, model_args(case))
        geometry = front_geometry(model, SHAPE, tiles.norm, costs=False)
        lay = layout(geometry, BOUNDS, tiles.weights, tiles.bands)
        for rank in range(world):
            found = results[rank][1][index]
            for g, full in enumerate(expected["maps"]):
                t = lay.tiles[g][rank]
                np.testing.assert_allclose(
                    found["tiles"][g],
                    full[:, :, t.top : t.bottom, t.left : t.right],
                    rtol=1e-4,
                    atol=1e-5,
                    err_msg=f"{case}: rank {rank}, group {g}",
                )
            names = set(found["grads"])
            front = set(front_names(list(expected["grads"]), BOUNDS[-1]))
            assert names == (set(expected["grads"]) if rank == 0 else front)
            for name in names:
                np.testing.assert_allclose(
                    found["grads"][name],
                    expected["grads"][name],
                    rtol=1e-4,
                    atol=1e-6,
                    err_msg=f"{case}: rank {rank}, gradient of {name}",
                )
        if case.get("train"):
            head = results[0][1][index]
            assert head["ok"], head["failure"]
            assert set(head["arrays"]) == set(expected["state"])
            for name, value in expected["state"].items():
                np.testing.assert_allclose(
                    head["arrays"][name],
                    value,
                    rtol=1e-4,
                    atol=1e-5,
                    err_msg=f"{case}: weights of {name} after {STEPS} steps",
                )
            for rank in range(1, world):
                assert results[rank][1][index]["ok"]
                assert results[rank][1][index]["arrays"] == {}


def test_two_processes_equal_tiles(tmp_path: Path) -> None:
    check_world(2, [{"weights": [1, 1], "norm": "none", "train": True}], tmp_path)


def test_four_processes_unequal_tiles_group_norm_and_batch_norm(tmp_path: Path) -> None:
    check_world(
        4,
        [
            {"weights": [1, 2, 1, 3], "norm": "group", "train": True},
            {"weights": [1, 1, 1, 1], "norm": "batch"},
        ],
        tmp_path,
    )


def test_six_processes_equal_and_unequal_tiles_shared_and_frozen_batch_norm(
    tmp_path: Path,
) -> None:
    check_world(
        6,
        [
            {"weights": [1] * 6, "norm": "batch", "train": True},
            {"weights": [3, 1, 1, 2, 1, 2], "norm": "frozen", "train": True},
            {"weights": [2, 1, 1, 1, 1, 3], "norm": "none"},
        ],
        tmp_path,
    )
