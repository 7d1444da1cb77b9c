"""TiledTraining orchestrating real local processes (the board ClientApp).

A :class:`ProcessGrid` runs ``flowerbed.clients.span_app`` in four worker
processes, each emulating a slow board (so a segment lasts long enough to lose a
board in the middle of it). The strategy profiles them, plans tiles and groups,
sends plans and weights and gathers rank 0's weights per round; the tests
compare the weights with single-device training on the same batches:

- two rounds on three boards equal four single-device steps (momentum carried
  across rounds);
- two clusters of two boards, each one participant of Flower's own FedAvg,
  average to the mean of two single-device runs (one per cluster's seed);
- a board killed in the middle of round 2 fails that segment (no weights
  change), round 3 re-plans without it and repeats the lost steps, so the end
  equals single-device training of rounds 1 and 3's steps.

Bad input (memory, halo, arrays, settings) is checked without processes where
it can be.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from dataclasses import fields
from typing import Any

import numpy as np
import pytest
from flowerbed.parallel.group import free_port
from flowerbed.parallel.plan import PlanError
from flowerbed.parallel.tiles.regions import TileError
from flowerbed.sims.process_grid import ProcessGrid
from flowerbed.strategies import TiledTraining
from flowerbed.strategies.accumulation import to_arrayrecord, to_numpy
from flowerbed.strategies.span import SpanMember
from flowerbed.strategies.tile_clusters import TileClusters
from flowerbed.strategies.tile_options import TileLinks, TilePlanning
from flowerbed.strategies.tiled import Board, colocated, subnet_of
from flwr.app import ArrayRecord
from flwr.serverapp.strategy import FedAvg
from test_tiles_exact import (
    BATCH,
    CLASSES,
    DECAY,
    LR,
    MODEL,
    MOMENTUM,
    SEED,
    SHAPE,
    initial_state,
    reference,
)

HOST = "127.0.0.1"
CASE = {"norm": "group"}
STEPS = 2
GFLOPS = 0.004
"""Emulated boards: a 48x48 step of the test CNN takes ~0.5-1 s per board."""


@pytest.fixture(scope="module")
def grid() -> Iterator[ProcessGrid]:
    configs = [{"address": HOST, "emulate-gflops": GFLOPS} for _ in range(4)]
    with ProcessGrid(
        "flowerbed.clients.span_app:app", configs, unavailable_after_s=2.0
    ) as grid:
        yield grid


def tiled(cls: type[TiledTraining] = TiledTraining, **changes: Any) -> Any:
    """The test's strategy; a change named like a field of TilePlanning goes
    into its ``planning``."""
    names = {f.name for f in fields(TilePlanning)}
    planning = {k: changes.pop(k) for k in list(changes) if k in names}
    settings: dict[str, Any] = {
        "planning": TilePlanning(**planning),
        "model": MODEL,
        "model_args": CASE,
        "input_shape": SHAPE,
        "dataset": "synthetic",
        "num_classes": CLASSES,
        "batch_size": BATCH,
        "steps_per_round": STEPS,
        "lr": LR,
        "momentum": MOMENTUM,
        "weight_decay": DECAY,
        "seed": SEED,
        "fraction_evaluate": 0.0,
        "min_train_nodes": 2,
        "min_available_nodes": 2,
        "rendezvous_port": free_port(),
        "rendezvous_ports": 20,
        "join_timeout_s": 30,
        "timeout_s": 15,
        "reply_margin_s": 3,
    }
    settings.update(changes)
    return cls(**settings)


def initial() -> ArrayRecord:
    return to_arrayrecord(initial_state(CASE))


def assert_weights(found: ArrayRecord, expected: dict[str, np.ndarray]) -> None:
    arrays = to_numpy(found)
    assert set(arrays) == set(expected)
    for name, value in expected.items():
        np.testing.assert_allclose(
            arrays[name], value, rtol=1e-4, atol=1e-5, err_msg=name
        )


@pytest.mark.slow
def test_rounds_of_tiled_training_equal_single_device_training(
    grid: ProcessGrid,
) -> None:
    strategy = tiled(max_devices=3)
    result = strategy.start(grid, initial(), num_rounds=2, timeout=300)
    assert sorted(result.train_metrics_clientapp) == [1, 2]
    for metrics in result.train_metrics_clientapp.values():
        assert metrics["tiles-segment-ok"] == 1
        assert metrics["tiles-devices"] == 3
        assert metrics["num-examples"] == STEPS * BATCH
        assert metrics["tiles-front"] >= 1
        assert metrics["tiles-activation-bytes"] > 0
        # equal boards keep equal tiles, round after round (tiles.speed)
        areas = metrics["tiles-areas"]
        assert isinstance(areas, list) and max(areas) <= 1.1 * min(areas), areas
    assert_weights(result.arrays, reference(CASE, steps=2 * STEPS)["state"])
    assert strategy.step == 2 * STEPS
    # measured speeds replaced the profile's: emulated 0.004 GFLOP/s is
    # 0.004e9 / 6 forward MACs per second of forward + backward.
    for board in strategy.boards:
        assert board.speed == pytest.approx(GFLOPS * 1e9 / 6, rel=0.5)


@pytest.mark.slow
def test_a_plan_that_does_not_fit_memory_stops_before_training(
    grid: ProcessGrid,
) -> None:
    strategy = tiled(memory_budget_mb=0.01)
    with pytest.raises(PlanError, match="does not fit memory: rank 0 needs"):
        strategy.start(grid, initial(), num_rounds=1, timeout=120)
    assert strategy.step == 0


@pytest.mark.slow
def test_two_tile_clusters_are_two_participants_of_flowers_fedavg(
    grid: ProcessGrid,
) -> None:
    clusters = TileClusters(
        grid,
        [[1, 2], [3, 4]],
        lambda k: tiled(seed=SEED + k, max_devices=2),
        timeout=300,
    )
    outer = FedAvg(fraction_evaluate=0.0, min_train_nodes=2, min_available_nodes=2)
    try:
        result = outer.start(clusters, initial(), num_rounds=1, timeout=300)
    finally:
        clusters.close()
    first = reference(CASE, steps=STEPS, seed=SEED)["state"]
    second = reference(CASE, steps=STEPS, seed=SEED + 1)["state"]
    # Equal num-examples: FedAvg's weighted mean is the plain mean (integer
    # buffers, none here, would be averaged too).
    assert_weights(result.arrays, {n: (first[n] + second[n]) / 2 for n in first})
    # FedAvg averaged the clusters' replies' metrics too (weighted by num-examples)
    assert result.train_metrics_clientapp[1]["tiles-segment-ok"] == 1


class KillInRound(TiledTraining):
    """Kills one member's process a moment after round ``kill_round``'s segment
    starts (set ``grid`` and ``kill_round`` after construction)."""

    grid: ProcessGrid
    kill_round = 0
    killed: int | None = None

    def run_segment(self, messages: Any, server_round: int, *args: Any) -> Any:
        if server_round == self.kill_round:
            assert self.segment is not None
            self.killed = self.segment.boards[-1].node_id
            threading.Timer(1.0, self.grid.kill, args=(self.killed,)).start()
        return super().run_segment(messages, server_round, *args)


@pytest.mark.slow
def test_a_lost_board_fails_its_segment_and_the_next_round_runs_without_it(
    grid: ProcessGrid,
) -> None:
    strategy = tiled(KillInRound, max_devices=3, steps_per_round=3)
    strategy.grid, strategy.kill_round = grid, 2
    result = strategy.start(grid, initial(), num_rounds=3, timeout=300)
    rounds = result.train_metrics_clientapp
    assert rounds[1]["tiles-segment-ok"] == 1 and rounds[1]["tiles-devices"] == 3
    assert rounds[2]["tiles-segment-ok"] == 0
    assert rounds[2]["num-examples"] == 0
    assert rounds[3]["tiles-segment-ok"] == 1 and rounds[3]["tiles-devices"] == 2
    assert strategy.killed not in {b.node_id for b in strategy.boards}
    # Round 2's steps were not applied and round 3 repeated them: 6 steps.
    assert strategy.step == 6
    assert_weights(result.arrays, reference(CASE, steps=6)["state"])


# --- without processes -------------------------------------------------------------


def boards(count: int, memory: float = math.inf) -> list[Board]:
    return [Board(n + 1, HOST, 1e6 * (1 + n % 2), memory) for n in range(count)]


def test_the_head_goes_to_the_board_with_most_memory() -> None:
    found = TiledTraining.rank_order(
        [Board(1, HOST, 5.0, 1e9), Board(2, HOST, 1.0, 4e9), Board(3, HOST, 9.0, 1e9)]
    )
    assert [b.node_id for b in found] == [2, 1, 3]


def test_bad_plans_are_clear_errors() -> None:
    strategy = tiled()
    with pytest.raises(PlanError, match="does not fit memory: rank 0 needs"):
        strategy.plan_segment(boards(3, memory=64 * 1024))
    deep = tiled(bounds=(0, 6))
    with pytest.raises(TileError, match="smaller than its halo"):
        deep.plan_segment(boards(6))
    with pytest.raises(ValueError, match="missing"):
        strategy.check_arrays({"0.0.weight": np.zeros((4, 3, 3, 3))}, "arrays")
    state = initial_state(CASE)
    state["0.0.weight"] = np.zeros((1, 1))
    with pytest.raises(ValueError, match=r"'0.0.weight' has shape \[1, 1\]"):
        strategy.check_arrays(state, "arrays")
    with pytest.raises(ValueError, match="normalisation mode 'group'"):
        tiled(norm="group")
    with pytest.raises(ValueError, match="input_shape"):
        tiled(input_shape=(48, 48))
    with pytest.raises(ValueError, match="batch_size must be an integer >= 1"):
        tiled(batch_size=0)
    with pytest.raises(ValueError, match="link_mbps must be > 0"):
        tiled(links=TileLinks(link_mbps=0.0))


def test_the_flat_keywords_of_a_release_ago_still_work_and_warn() -> None:
    with pytest.warns(DeprecationWarning, match=r"planning=TilePlanning\("):
        old = TiledTraining(model=MODEL, model_args=CASE, max_devices=3, bands=1)
    assert old.planning == TilePlanning(max_devices=3, bands=1)
    with pytest.warns(DeprecationWarning, match=r"links=TileLinks\("):
        old = TiledTraining(model=MODEL, model_args=CASE, emulate_link=True)
    assert old.links == TileLinks(emulate_link=True)
    with pytest.raises(TypeError, match="put them in the TileLinks"):
        TiledTraining(links=TileLinks(), link_mbps=10.0)


def test_co_located_boards_share_a_subnet() -> None:
    members = [
        SpanMember(1, "192.168.1.10"),
        SpanMember(2, "192.168.1.11"),
        SpanMember(3, "10.0.0.5"),
        SpanMember(4, "192.168.1.12"),
        SpanMember(5, "pi-a.lab.example"),
    ]
    chosen = colocated(members, 24, lambda m: 1.0)
    assert sorted(m.node_id for m in chosen) == [1, 2, 4]
    assert subnet_of("192.168.1.77", 24) == "192.168.1.0/24"
    assert subnet_of("pi-b.lab.example", 24) == "dns:lab.example"


def test_tiles_follow_the_boards_measured_speeds() -> None:
    # Rank 0 is the board with the most memory (node 2); the others follow by
    # node id. A board twice as fast gets a tile twice as large, on every map.
    from flowerbed.parallel.tiles.layout import layout

    strategy = tiled(bands=1)
    segment = strategy.plan_segment(
        [Board(1, HOST, 2e6, 1e9), Board(2, HOST, 1e6, 2e9), Board(3, HOST, 1e6, 1e9)]
    )
    assert [b.node_id for b in segment.boards] == [2, 1, 3]
    assert segment.tile_plan.weights == (1e6, 2e6, 1e6)
    lay = layout(
        strategy.geometry(),
        segment.tile_plan.bounds,
        segment.tile_plan.weights,
        segment.tile_plan.bands,
    )
    for tiles in lay.tiles:
        areas = [t.area for t in tiles]
        assert areas[1] == pytest.approx(2 * areas[0], rel=0.25)
        assert areas[0] == pytest.approx(areas[2], rel=0.25)


@pytest.mark.slow
def test_tiled_training_resumes_after_its_last_round_exactly(
    grid: ProcessGrid, tmp_path: Any
) -> None:
    # Round 1 by one strategy (the server then goes down), both rounds asked of
    # a new one on the same checkpoint: it runs round 2 only and ends where one
    # device ends after both rounds' steps (SGD momentum crossing the restart).
    path = tmp_path / "tiles.ckpt"
    ran: list[int] = []

    def evaluate_fn(server_round: int, arrays: ArrayRecord) -> None:
        ran.append(server_round)

    first = tiled(max_devices=2, checkpoint_path=path)
    first.start(grid, initial(), num_rounds=1, timeout=300, evaluate_fn=evaluate_fn)
    assert path.exists() and ran == [0, 1]
    ran.clear()
    second = tiled(max_devices=2, checkpoint_path=path)
    result = second.start(
        grid, initial(), num_rounds=2, timeout=300, evaluate_fn=evaluate_fn
    )
    assert ran == [2], ran
    assert second.step == 2 * STEPS
    assert sorted(result.train_metrics_clientapp) == [1, 2]
    assert_weights(result.arrays, reference(CASE, steps=2 * STEPS)["state"])
