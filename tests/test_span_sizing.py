"""Segment sizing: set-up at most a share of a round (hand-computed timings)."""

from __future__ import annotations

import pytest
from flowerbed.strategies.pipeline import PipelineTraining
from flowerbed.strategies.span_sizing import (
    DEFAULT_SETUP_SHARE,
    ROUND_NEXT_STEPS,
    ROUND_SETUP_S,
    ROUND_SETUP_SHARE,
    SHARE_HEADROOM,
    SegmentSizer,
    round_setup_s,
    steps_for_share,
)


def test_round_setup_is_the_wall_time_not_spent_in_steps() -> None:
    # 20 s of wall, 100 steps of 0.1 s: 10 s of set-up.
    assert round_setup_s(20.0, 100, 0.1) == pytest.approx(10.0)
    # Steps measured longer than the wall (clock skew): no negative set-up.
    assert round_setup_s(5.0, 100, 0.1) == 0.0


def test_steps_for_a_share_solve_s_over_s_plus_kt() -> None:
    # S = 9 s, T = 0.1 s, share 0.1: k >= 9 * 0.9 / (0.1 * 0.1) = 810, and
    # 9 / (9 + 810 * 0.1) = 0.1 exactly.
    assert steps_for_share(9.0, 0.1, 0.1) == 810
    # share 0.5: k >= 9 * 0.5 / (0.5 * 0.1) = 90.
    assert steps_for_share(9.0, 0.1, 0.5) == 90
    # S = 1 s, T = 0.3 s, share 0.1: 1 * 0.9 / 0.03 = 30.
    assert steps_for_share(1.0, 0.3, 0.1) == 30
    # No set-up: one step is enough.
    assert steps_for_share(0.0, 0.1, 0.1) == 1


def test_a_share_outside_zero_one_is_refused() -> None:
    with pytest.raises(ValueError, match=r"in \(0, 1\)"):
        steps_for_share(9.0, 0.1, 1.0)
    with pytest.raises(ValueError, match="setup_share"):
        SegmentSizer(20, share=0.0)
    with pytest.raises(ValueError, match=">= 1"):
        SegmentSizer(0)


def test_the_sizer_grows_segments_to_the_share_and_reports_the_round() -> None:
    sizer = SegmentSizer(20)
    assert sizer.share == DEFAULT_SETUP_SHARE
    aim = DEFAULT_SETUP_SHARE * SHARE_HEADROOM  # 8% of the round
    # A round of 20 steps at 0.1 s in 11 s of wall: 9 s of set-up, 9/11 of it.
    metrics = sizer.measured(11.0, 20, 0.1)
    assert metrics[ROUND_SETUP_S] == pytest.approx(9.0)
    assert metrics[ROUND_SETUP_SHARE] == pytest.approx(9.0 / 11.0)
    # k = 9 * 0.92 / (0.08 * 0.1) = 1035 steps
    assert metrics[ROUND_NEXT_STEPS] == steps_for_share(9.0, 0.1, aim) == 1035
    assert sizer.steps == 1035
    # The next round (1035 steps, 9 s of set-up): 8% of it.
    metrics = sizer.measured(9.0 + 103.5, 1035, 0.1)
    assert metrics[ROUND_SETUP_SHARE] == pytest.approx(0.08)
    assert sizer.steps == 1035
    # A round whose set-up came out a quarter above the forecast still keeps
    # within the 10% share.
    metrics = sizer.measured(9.0 * 1.25 + 103.5, 1035, 0.1)
    assert metrics[ROUND_SETUP_SHARE] <= DEFAULT_SETUP_SHARE


def test_the_sizer_sizes_on_the_mean_and_never_shrinks() -> None:
    sizer = SegmentSizer(20, share=0.1 / SHARE_HEADROOM)  # aims at 10%
    sizer.measured(5.0 + 2.0, 20, 0.1)  # S = 5 s: 5 * 0.9 / 0.01 = 450
    assert sizer.steps == 450
    sizer.measured(13.0 + 45.0, 450, 0.1)  # S = 13 s; mean 9 s: 810
    assert sizer.steps == 810
    sizer.measured(1.0 + 81.0, 810, 0.1)  # S = 1 s; mean 19/3 s: 570 < 810
    assert sizer.steps == 810
    # Set-up already small: the starting steps stay.
    small = SegmentSizer(20)
    small.measured(2.0 + 0.1, 20, 0.1)  # S = 0.1 s: 12 steps would do
    assert small.steps == 20


def test_without_a_share_the_steps_stay_fixed() -> None:
    sizer = SegmentSizer(12, share=None)
    metrics = sizer.measured(11.0, 12, 0.1)
    assert metrics[ROUND_SETUP_S] == pytest.approx(9.8)
    assert sizer.steps == 12


def test_pipeline_sizes_segments_unless_steps_per_round_is_given() -> None:
    sized = PipelineTraining(model="deep-mlp", input_shape=(1, 8, 8))
    assert sized.steps_per_round == 20
    assert sized.sizer.share == DEFAULT_SETUP_SHARE
    other = PipelineTraining(model="deep-mlp", input_shape=(1, 8, 8), setup_share=0.2)
    assert other.sizer.share == 0.2
    fixed = PipelineTraining(
        model="deep-mlp", input_shape=(1, 8, 8), steps_per_round=12
    )
    assert fixed.steps_per_round == 12
    assert fixed.sizer.share is None


def test_large_batch_sizes_segments_unless_steps_per_round_is_given() -> None:
    from flowerbed.strategies.large_batch_sync import LargeBatchSync

    sized = LargeBatchSync()
    assert sized.steps_per_round == 10
    assert sized.sizer.share == DEFAULT_SETUP_SHARE
    fixed = LargeBatchSync(steps_per_round=4, setup_share=0.3)
    assert fixed.steps_per_round == 4
    assert fixed.sizer.share is None
