"""Span jobs resume: a restarted server goes on from the last completed round.

A first strategy runs round 1 with a ``checkpoint_path`` and stops (the server
going down); a new strategy with the same settings and path, on the same
boards, is asked for two rounds: it resumes after round 1 and ends where one
device ends after both rounds' steps (the optimiser's state, Adam's moments,
crossing the restart through the checkpoint).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flowerbed.parallel import build_layers, single_device
from flowerbed.parallel.user_code import build_module
from flowerbed.strategies import LargeBatchSync, PipelineTraining
from flowerbed.strategies.checkpoints import CheckpointError
from flowerbed.strategies.large_batch_options import AllReduceRecipe
from flowerbed.strategies.span_checkpoint import SpanCheckpoint
from flwr.app import ArrayRecord
from flwr.serverapp.strategy import Result
from test_user_code_exact import (
    PIPE_ARGS,
    PIPE_MODEL,
    PIPE_STEPS,
    _arrays,
    _close,
    _grid,
    _span_settings,
    pipe_training,
)


def _restarted(make: Any, initial: ArrayRecord, path: Path) -> tuple[Any, Result]:
    """Round 1 by one strategy, then both rounds asked of a new one, which must
    run round 2 only (its ``evaluate_fn`` sees which rounds it ran)."""
    ran: list[int] = []

    def evaluate_fn(server_round: int, arrays: ArrayRecord) -> None:
        ran.append(server_round)

    with _grid(2) as grid:
        first = make()
        first.start(grid, initial, num_rounds=1, timeout=180, evaluate_fn=evaluate_fn)
        assert path.exists() and ran == [0, 1]
        second = make()
        ran.clear()
        result = second.start(
            grid, initial, num_rounds=2, timeout=180, evaluate_fn=evaluate_fn
        )
    assert ran == [2], ran
    return second, result


@pytest.mark.slow
def test_large_batch_sync_resumes_after_its_last_round_exactly(tmp_path: Path) -> None:
    path = tmp_path / "lb.ckpt"

    def make() -> LargeBatchSync:
        return LargeBatchSync(
            model="span_user_code:two_branch",
            batch_size=24,
            steps_per_round=3,
            checkpoint_path=path,
            **_span_settings(),
            recipe=AllReduceRecipe(base_lr=0.01, base_batch=24),
        )

    model = build_module("span_user_code:two_branch", seed=0)
    initial = ArrayRecord(model.state_dict())
    strategy, result = _restarted(make, initial, path)
    assert strategy.step == 6
    assert sorted(result.train_metrics_clientapp) == [1, 2]  # round 1's kept
    want = single_device(strategy.reference_job(), _arrays(initial), steps=6)
    _close(_arrays(result.arrays), want, atol=2e-6)


@pytest.mark.slow
def test_pipeline_training_resumes_after_its_last_round_exactly(tmp_path: Path) -> None:
    path = tmp_path / "pipe.ckpt"

    def make() -> PipelineTraining:
        return pipe_training(checkpoint_path=path)

    initial = ArrayRecord(build_layers(PIPE_MODEL, PIPE_ARGS, seed=0).state_dict())
    strategy, result = _restarted(make, initial, path)
    assert strategy.step == 2 * PIPE_STEPS
    assert sorted(result.train_metrics_clientapp) == [1, 2]
    want = single_device(strategy.reference_job(), _arrays(initial), steps=8)
    _close(_arrays(result.arrays), want, atol=2e-6)


def _saved(path: Path, optimizer: dict[str, np.ndarray]) -> ArrayRecord:
    model = build_layers("deep-mlp", {"hidden": 8, "depth": 2}, seed=0)
    arrays = ArrayRecord(model.state_dict())
    SpanCheckpoint(path, "PipelineTraining").save(
        3, 30, {k: v.numpy() for k, v in arrays.items()}, optimizer, Result()
    )
    return arrays


def test_a_checkpoint_restores_round_step_model_and_optimiser(tmp_path: Path) -> None:
    momentum = {"0.weight": np.full((8, 64), 0.5, dtype=np.float32)}
    arrays = _saved(tmp_path / "c", momentum)
    resumed = SpanCheckpoint(tmp_path / "c", "PipelineTraining").resume(
        arrays, Result()
    )
    assert resumed is not None
    assert (resumed.round, resumed.step) == (3, 30)
    assert list(resumed.arrays) == list(arrays)
    np.testing.assert_array_equal(resumed.optimizer["0.weight"], momentum["0.weight"])
    assert SpanCheckpoint(tmp_path / "none", "X").resume(arrays, Result()) is None


def test_a_checkpoint_of_another_strategy_or_with_bad_state_is_refused(
    tmp_path: Path,
) -> None:
    arrays = _saved(tmp_path / "c", {"0.weight": np.full((2,), np.nan)})
    with pytest.raises(CheckpointError, match="written by 'PipelineTraining'"):
        SpanCheckpoint(tmp_path / "c", "LargeBatchSync").resume(arrays, Result())
    with pytest.raises(CheckpointError, match=r"optimizer\.0\.weight is 'NaN or Inf'"):
        SpanCheckpoint(tmp_path / "c", "PipelineTraining").resume(arrays, Result())
