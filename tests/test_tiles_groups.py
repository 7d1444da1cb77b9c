"""The layer-grouping cost model and DP on a hand-worked case (pure, no torch).

The model: three 1x3 convolutions (padding 1 along columns, one channel, 3 MACs
per output pixel, 4 parameters each) on a 1x8 map, and a head of 10 parameters
and no MACs; two devices of 1 MAC/s with tiles of columns 0..3 and 4..7; one
sample of 4-byte floats. Per rank (both are symmetric):

    group [i, i+1): output 4 px -> 12 MACs; input 5 px, 1 px from the peer
    group of 2 layers: outputs 4 + 5 px -> 27 MACs; input 6 px, 2 from the peer
    group of 3 layers: 4 + 5 + 6 px -> 45 MACs

A boundary exchange moves its pixels forward and their gradients back:
``2 * (4 bytes * px / bw + a)``; with bw = 4 B/s and a = 1 s: 1 px -> 4 s,
2 px -> 6 s. The first group's input is the data (no exchange).

    [0, 3]          45
    [0, 1, 3]       12 + 27 + 6  = 45
    [0, 2, 3]       27 + 12 + 4  = 43   <- best
    [0, 1, 2, 3]    12 + (12 + 4) + (12 + 4) = 44

Tail for front 3: gather rank 1's 4 px (16 B) and scatter its gradient back:
2 * (16/4 + 1) = 10 s; ring all-reduce of 12 parameters (48 B) on 2 devices:
2 * 1/2 * 48/4 + 2 * 1 * 1 = 14 s; head 0 MACs.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from flowerbed.parallel.plan import PlanError
from flowerbed.parallel.tiles.grouping import Cluster, evaluate, group_cost, plan_tiles
from flowerbed.parallel.tiles.layout import FrontGeometry, exchange_pieces, layout
from flowerbed.parallel.tiles.regions import WINDOW, Op, Rect, TileError
from fresh import python_prints

CONV = Op("conv1x3", WINDOW, (1, 3), (1, 1), (0, 1), macs_per_pixel=3, params=4)


def geometry() -> FrontGeometry:
    return FrontGeometry(
        in_shape=(1, 1, 8),
        layers=((CONV,), (CONV,), (CONV,)),
        num_layers=4,
        layer_params=(4, 4, 4, 10),
        head_macs=(27, 18, 9, 0),
        head_elements=(0, 0, 0, 0),
    )


def cluster(**changes: object) -> Cluster:
    settings: dict[str, object] = {
        "speeds": (1.0, 1.0),
        "link_bytes_per_s": 4.0,
        "latency_s": 1.0,
        "bands": 1,
    }
    settings.update(changes)
    return Cluster(**settings)  # type: ignore[arg-type]


def test_group_costs_count_the_halo_work_and_the_exchange() -> None:
    one = group_cost(geometry(), cluster(), 1, 1, 2)
    assert one.macs == (12, 12)
    assert one.compute_s == 12
    assert one.exchange_s == pytest.approx(4.0)
    assert one.exchange_bytes == 2 * 2 * 4  # 1 px each way, forward and back
    two = group_cost(geometry(), cluster(), 1, 1, 3)
    assert two.macs == (27, 27)
    assert two.exchange_s == pytest.approx(6.0)
    three = group_cost(geometry(), cluster(), 1, 0, 3)
    assert three.macs == (45, 45)
    assert three.exchange_s == 0.0  # the data is local


def test_the_dp_finds_the_hand_worked_best_grouping() -> None:
    plan = plan_tiles(geometry(), cluster(), 1, front=3)
    assert plan.bounds == (0, 2, 3)
    cost = plan.cost
    assert cost.tail.gather_s == pytest.approx(10.0)
    assert cost.tail.allreduce_s == pytest.approx(14.0)
    assert cost.total_s == pytest.approx(43 + 10 + 14)
    for bounds, seconds in (((0, 3), 45), ((0, 1, 3), 45), ((0, 1, 2, 3), 44)):
        assert evaluate(geometry(), cluster(), 1, bounds).total_s == pytest.approx(
            seconds + 24
        )


def test_a_free_link_makes_every_layer_its_own_group() -> None:
    free = cluster(link_bytes_per_s=1e15, latency_s=0.0)
    plan = plan_tiles(geometry(), free, 1, front=3)
    assert plan.bounds == (0, 1, 2, 3)
    assert plan.cost.total_s == pytest.approx(36.0)


def test_the_dp_also_chooses_how_many_layers_to_tile() -> None:
    # Free link: tiling F layers costs 12 MACs per layer per rank (one group per
    # layer), the head runs the rest on rank 0 at 1 MAC/s. Head MACs per
    # sample from layer F on: 27, 18, 9, 0 -> F = 1: 12 + 18 = 30, F = 2:
    # 24 + 9 = 33, F = 3: 36: tile one layer. A head 10/3 as heavy (90, 60,
    # 30, 0): 72, 54, 36: tile all three.
    free = cluster(link_bytes_per_s=1e15, latency_s=0.0)
    light = plan_tiles(geometry(), free, 1)
    assert (light.front, light.bounds) == (1, (0, 1))
    assert light.cost.total_s == pytest.approx(30.0)
    heavy_head = replace(geometry(), head_macs=(90, 60, 30, 0))
    heavy = plan_tiles(heavy_head, free, 1)
    assert (heavy.front, heavy.bounds) == (3, (0, 1, 2, 3))
    assert heavy.cost.total_s == pytest.approx(36.0)


def test_memory_decides_between_groupings() -> None:
    # Activations (bytes, 1 sample, 1 channel, 4 B): group [0,3): input 7 px +
    # outputs 6 + 5 + 4 px = 22 px = 88 B; [0,2,3): (6 + 5 + 4) + (5 + 4) =
    # 24 px = 96 B. States: 3 x 4 B x 12 front parameters = 144 B on each rank;
    # rank 0 also holds the gathered 1x8 map (32 B) and 3 x 4 B x 10 head
    # parameters (120 B). Rank 0: [0,3) 384 B, [0,2,3) 392 B.
    assert evaluate(geometry(), cluster(), 1, (0, 3)).memory_bytes == (384, 232)
    assert evaluate(geometry(), cluster(), 1, (0, 2, 3)).memory_bytes == (392, 240)
    tight = cluster(memory=(390.0, 390.0))
    assert plan_tiles(geometry(), tight, 1, front=3).bounds == (0, 3)
    with pytest.raises(PlanError, match="does not fit memory: rank 0 needs 384 B"):
        plan_tiles(geometry(), cluster(memory=(380.0, 1e9)), 1, front=3)
    with pytest.raises(PlanError, match=r"group plan \[0, 2, 3\] does not fit"):
        plan_tiles(geometry(), tight, 1, bounds=(0, 2, 3))


def test_bad_group_plans_are_named() -> None:
    with pytest.raises(PlanError, match="must start at 0"):
        plan_tiles(geometry(), cluster(), 1, bounds=(1, 3))
    with pytest.raises(PlanError, match="must increase strictly"):
        plan_tiles(geometry(), cluster(), 1, bounds=(0, 2, 2))
    with pytest.raises(TileError, match="only the first 3 can be tiled"):
        plan_tiles(geometry(), cluster(), 1, bounds=(0, 4))
    with pytest.raises(PlanError, match="device speeds must be finite and > 0"):
        Cluster(speeds=(1.0, math.nan))
    with pytest.raises(TileError, match="smaller than its halo"):
        # 8 devices on 8 columns: 1-px tiles under a 3-layer halo.
        evaluate(geometry(), Cluster(speeds=(1.0,) * 8, bands=1), 1, (0, 3))


def test_the_layout_lists_who_sends_what_at_each_boundary() -> None:
    lay = layout(geometry(), (0, 2, 3), (1.0, 1.0), 1)
    assert lay.tiles == ((Rect(0, 1, 0, 4), Rect(0, 1, 4, 8)),) * 2
    assert lay.pieces[0] == {}
    assert lay.pieces[1] == {(1, 0): Rect(0, 1, 4, 5), (0, 1): Rect(0, 1, 3, 4)}
    assert lay.busiest_bytes(1, 4.0) == 4.0
    assert exchange_pieces([Rect(0, 2, 0, 2)], [Rect(0, 2, 0, 2)]) == {}


def test_the_planner_imports_no_torch() -> None:

    code = (
        "import sys\n"
        "import flowerbed.parallel.tiles.grouping, flowerbed.parallel.tiles.layout\n"
        "print('torch' in sys.modules)\n"
    )
    assert python_prints(code).strip() == "False"
