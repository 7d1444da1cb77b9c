"""A pipeline segment on 2-4 local processes trains exactly like one process.

With a flush per step (1F1B or GPipe), K steps of the pipeline are K steps of
SGD on the same batches: the weights match single-process training to float
rounding. The same holds across a loss: a second segment over fewer members,
its layers gathered from their own stores and a peer's replica, continues
exactly where single-process training is at that step.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import reference
from flowerbed.models import build_sequential
from flowerbed.parallel.group import free_port
from flowerbed.parallel.member import MemberContext
from flowerbed.parallel.pipeline.recovery import Holdings, layer_sources, restart_step
from flowerbed.parallel.pipeline.stage import run_segment
from flowerbed.parallel.plan import LayerSource, MemberPlan
from flowerbed.parallel.store import LayerStore
from ranks import run_ranks

pytestmark = pytest.mark.slow

MODEL = "deep-mlp"
ARGS = {"in_features": 64, "hidden": 24, "depth": 5}  # 7 layers: flatten, 5, head
LR, MOMENTUM, BATCH = 0.1, 0.9, 16


def initial() -> dict[str, np.ndarray]:
    model = build_sequential(MODEL, ARGS, seed=0)
    return {k: v.numpy().copy() for k, v in model.state_dict().items()}


def single_process(steps: int) -> dict[str, np.ndarray]:
    return reference.single_process(MODEL, ARGS, steps, BATCH, LR, MOMENTUM)


def plan(
    rank: int,
    world: int,
    port: int,
    bounds: tuple[int, ...],
    start: int,
    steps: int,
    sources: tuple[LayerSource, ...],
    schedule: str = "1f1b",
) -> MemberPlan:
    return MemberPlan(
        mode="pipeline",
        job="exact",
        segment=start + 1,
        rank=rank,
        world_size=world,
        host="127.0.0.1",
        port=port,
        start_step=start,
        steps=steps,
        batch_size=BATCH,
        micro_batches=4,
        schedule=schedule,
        replicate_every=3,
        join_timeout_s=60,
        timeout_s=60,
        model=MODEL,
        model_args=ARGS,
        dataset="digits",
        lr=LR,
        momentum=MOMENTUM,
        partition=bounds,
        sources=sources,
        options={"input-shape": [1, 8, 8]},
    )


def member(
    rank: int,
    plans: list[MemberPlan],
    stores: list[str],
    arrays: dict[str, np.ndarray],
) -> tuple[bool, str, dict, dict]:
    p = plans[rank]
    context = MemberContext(address="127.0.0.1", store_root=Path(stores[rank]))
    mine = {k: v for k, v in arrays.items() if int(k.split(".")[0]) in p.layers}
    result = run_segment(p, context, mine)
    return result.ok, result.failure, result.arrays, result.metrics


def central(layers: int) -> tuple[LayerSource, ...]:
    return tuple(LayerSource(layer, "central", -1, 0) for layer in range(layers))


def run(plans: list[MemberPlan], stores: list[str], arrays: dict) -> dict:
    results = run_ranks(member, len(plans), plans, stores, arrays, timeout=180)
    out: dict[str, np.ndarray] = {}
    for _, (status, value) in sorted(results.items()):
        assert status == "ok", value
        ok, failure, got, _ = value
        assert ok, failure
        out.update(got)
    return out


def test_a_gpipe_segment_on_four_processes_equals_single_process_training(
    tmp_path: Path,
) -> None:
    # Stage 0 holds only the parameter-free flatten layer: nothing to optimise.
    bounds, schedule = (0, 1, 3, 5, 7), "gpipe"
    world = len(bounds) - 1
    port = free_port()
    plans = [
        plan(r, world, port, bounds, 0, 6, central(7), schedule) for r in range(world)
    ]
    stores = [str(tmp_path / f"m{r}") for r in range(world)]
    got = run(plans, stores, initial())
    want = single_process(6)
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=0, atol=2e-6, err_msg=name)


def test_1f1b_on_three_then_two_processes_continues_exactly_after_a_loss(
    tmp_path: Path,
) -> None:
    # Segment 1: members A, B, C hold layers 0-2, 3-4, 5-6 for steps 0..7 and
    # replicate after steps 3 and 6 (R = 3) around the ring A -> B -> C -> A.
    stores = [str(tmp_path / name) for name in ("A", "B", "C")]
    port = free_port()
    first = [plan(r, 3, port, (0, 3, 5, 7), 0, 7, central(7)) for r in range(3)]
    run(first, stores, initial())
    # B is lost. From the stores' listings, every layer exists at step 6 among A
    # and C (B's layers as C's replica): restart there, on a new partition.
    holdings = Holdings(num_layers=7, central_step=0)
    for member_id, store in zip("AC", (stores[0], stores[2]), strict=True):
        for entry in LayerStore(store, "exact").entries():
            holdings.add(ord(member_id), entry.step, entry.layers)
    restart = restart_step(holdings, [ord("A"), ord("C")], not_after=7)
    assert restart == 6  # one step (6 -> 7) lost, fewer than R = 3
    members = [ord("A"), ord("C")]
    sources = layer_sources(holdings, (0, 4, 7), members, 6, {3: ord("B"), 4: ord("B")})
    kinds = {s.layer: (s.kind, s.rank) for s in sources}
    assert kinds[3] == ("peer", 1)  # C's replica of B's layer travels to A
    assert kinds[4] == ("self", -1)  # C keeps its replica of B's layer 4
    port = free_port()
    second = [plan(r, 2, port, (0, 4, 7), 6, 4, sources) for r in range(2)]
    got = run(second, [stores[0], stores[2]], {})
    want = single_process(10)
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=0, atol=2e-6, err_msg=name)
