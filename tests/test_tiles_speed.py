"""Tile speeds that keep the fixed cost of a step apart from the cost per MAC
(flowerbed.parallel.tiles.speed), and tiles that stay put on equal boards."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from flowerbed import keys
from flowerbed.parallel.tiles.layout import layout
from flowerbed.parallel.tiles.speed import SpeedModel, two_point_rate
from flowerbed.strategies.span import SegmentOutcome, SegmentReply
from flowerbed.strategies.tiled import Board, TiledTraining
from test_tiles_strategy import CASE, HOST, initial_state, tiled


def test_two_timings_give_the_slope_and_the_intercept() -> None:
    # seconds = 0.2 + m / 1e6: at 1e5 MACs 0.3 s, at 4e5 MACs 0.6 s
    rate, fixed = two_point_rate((1e5, 0.3), (4e5, 0.6))
    assert rate == pytest.approx(1e6) and fixed == pytest.approx(0.2)
    # noise that makes the slope non-positive: the larger timing, no fixed cost
    assert two_point_rate((1e5, 0.5), (1.05e5, 0.49)) == (
        pytest.approx(1.05e5 / 0.49),
        0.0,
    )


def test_the_first_segment_s_excess_over_the_profile_is_fixed_cost() -> None:
    model = SpeedModel(rate=1e6)
    model.observe(2e5, 0.5)  # 0.2 s of MACs at the profiled rate, 0.3 s fixed
    assert model.rate == 1e6 and model.fixed_s == pytest.approx(0.3)
    assert model.predict(4e5) == pytest.approx(0.7)


def test_a_changed_tile_fits_the_line_and_smoothing_blends_it() -> None:
    model = SpeedModel(rate=1e6, smoothing=1.0)
    model.observe(2e5, 0.5)  # 0.3 + m / 1e6
    # the board is now 0.25 + m / 2e6: the line through the last two points
    model.observe(1e5, 0.25 + 1e5 / 2e6)
    model.observe(3e5, 0.25 + 3e5 / 2e6)
    assert model.rate == pytest.approx(2e6) and model.fixed_s == pytest.approx(0.25)
    half = SpeedModel(rate=2e6, fixed_s=0.25, smoothing=0.5, last=(3e5, 0.4))
    half.observe(1e5, 0.1 + 1e5 / 1e6)  # now 0.1 + m / 1e6
    # seconds per MAC blended: 1 / (0.5 / 1e6 + 0.5 / 2e6)
    assert half.rate == pytest.approx(1 / (0.5e-6 + 0.25e-6))
    assert half.fixed_s == pytest.approx(0.5 * 0.1 + 0.5 * 0.25)


def test_a_board_that_slows_down_as_a_whole_scales_both_costs() -> None:
    model = SpeedModel(rate=1e6, fixed_s=0.1, smoothing=1.0, last=(2e5, 0.3))
    model.observe(2e5, 0.6)  # twice as slow at the same tile
    assert model.rate == pytest.approx(5e5) and model.fixed_s == pytest.approx(0.2)


@pytest.mark.parametrize(
    "bad", [{"rate": 0.0}, {"rate": 1.0, "fixed_s": -1.0}, {"rate": 1, "smoothing": 0}]
)
def test_bad_models_are_named(bad: dict) -> None:
    with pytest.raises(ValueError, match="must be"):
        SpeedModel(**bad)


# --------------------------------------------------------------------------------
# Closed loop: the strategy's planner, boards whose step costs fixed + MACs / rate
# --------------------------------------------------------------------------------

FIXED_S, RATE, HEAD_SHARE = 0.4, 2e6, 0.3
"""Two equal boards: 0.4 s per step whatever the tile, 2e6 MACs/s; rank 0 also
runs the head (30% of the front's MACs)."""


def closed_loop(
    strategy: TiledTraining,
    rounds: int,
    update: Callable[[Board, float, float], None],
) -> list[list[int]]:
    """Tile areas of each round when each segment's (MACs, seconds) per board
    update its speed with ``update``."""
    boards = [Board(1, HOST, RATE, 2e9), Board(2, HOST, RATE, 1e9)]
    out = []
    for _ in range(rounds):
        segment = strategy.plan_segment(boards)
        tp = segment.tile_plan
        lay = layout(strategy.geometry(), tp.bounds, tp.weights, tp.bands)
        front = [
            strategy.batch_size * sum(t[r].macs for t in lay.traces)
            for r in range(len(boards))
        ]
        head = HEAD_SHARE * sum(front)
        for rank, board in enumerate(segment.boards):
            macs = front[rank] + (head if rank == 0 else 0.0)
            update(board, macs, FIXED_S + macs / RATE)
        out.append(strategy.tile_areas(segment))
    return out


def spread(areas: list[int]) -> float:
    return max(areas) / min(areas) - 1


def test_equal_boards_keep_equal_tiles_round_after_round() -> None:
    strategy = tiled(bands=1)
    models: dict[int, SpeedModel] = {}

    def measured(board: Board, macs: float, seconds: float) -> None:
        model = models.setdefault(board.node_id, SpeedModel(rate=RATE))
        model.observe(macs, seconds)
        board.speed = model.rate

    rounds = closed_loop(strategy, 6, measured)
    assert all(spread(areas) <= 0.10 for areas in rounds), rounds

    # the rule it replaces, MACs / seconds, takes the fixed cost for slowness:
    # the board without the head looks slower, gets less, and looks slower still
    def naive(board: Board, macs: float, seconds: float) -> None:
        board.speed = macs / seconds

    drifting = closed_loop(tiled(bands=1), 6, naive)
    assert max(spread(areas) for areas in drifting) > 0.25, drifting


def test_a_completed_segment_updates_each_board_s_speed_model() -> None:
    strategy = tiled(bands=1)
    boards = [Board(1, HOST, RATE, 2e9), Board(2, HOST, RATE, 1e9)]
    strategy.boards = boards
    strategy.speed_models = {1: SpeedModel(RATE), 2: SpeedModel(RATE)}
    strategy.segment = strategy.plan_segment(boards)
    state = initial_state(CASE)
    replies = {}
    for rank, board in enumerate(strategy.segment.boards):
        macs = 1e6 * (2 if rank == 0 else 1)  # rank 0 also runs the head
        metrics = {
            keys.TILES_MACS: macs,
            keys.TILES_COMPUTE_S: FIXED_S + macs / RATE,
            keys.TRAIN_LOSS: 1.0,
        }
        arrays = state if rank == 0 else {}
        replies[board.node_id] = SegmentReply(board.node_id, True, metrics, arrays, {})
    arrays_out, metrics = strategy.aggregate_segment(1, SegmentOutcome(replies))
    assert arrays_out is not None
    for board in boards:
        # the profile's rate stays; the excess is the step's fixed cost
        assert board.speed == RATE
        assert strategy.speed_models[board.node_id].fixed_s == pytest.approx(FIXED_S)
    areas = metrics["tiles-areas"]
    assert isinstance(areas, list) and spread(areas) <= 0.10
