"""The time-series workload of the pipeline issue: ``make_har`` windows and the
``har-cnn`` model, on their own and through ``flowerbed pipeline`` end to end."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from flowerbed.cli import main
from flowerbed.data import make_har


def test_windows_have_har_shape_six_classes_and_standardised_channels() -> None:
    data = make_har(600, seed=1)
    assert data.x_train.shape == (480, 9, 128) and data.x_test.shape == (120, 9, 128)
    assert data.x_train.dtype == np.float32
    assert set(np.unique(data.y_train)) == set(range(6))
    assert data.num_classes == 6
    # Standardised per channel with the training split's statistics.
    mean = data.x_train.mean(axis=(0, 2))
    std = data.x_train.std(axis=(0, 2))
    np.testing.assert_allclose(mean, 0.0, atol=1e-4)
    np.testing.assert_allclose(std, 1.0, atol=1e-3)


def test_windows_are_determined_by_the_seed() -> None:
    a, b, c = make_har(200, seed=3), make_har(200, seed=3), make_har(200, seed=4)
    np.testing.assert_array_equal(a.x_train, b.x_train)
    np.testing.assert_array_equal(a.y_train, b.y_train)
    assert not np.array_equal(a.x_train, c.x_train)


def test_the_physics_separates_the_activities() -> None:
    # Per-channel mean (gravity's direction) and standard deviation (how much the
    # body moves) are enough for a nearest-centroid rule to tell most windows
    # apart; labels drawn independently of the windows would give ~1/6.
    data = make_har(1200, seed=0)

    def features(x: np.ndarray) -> np.ndarray:
        return np.concatenate([x.mean(axis=2), x.std(axis=2)], axis=1)

    train, test = features(data.x_train), features(data.x_test)
    centroids = np.stack([train[data.y_train == k].mean(axis=0) for k in range(6)])
    distances = ((test[:, None, :] - centroids[None]) ** 2).sum(axis=2)
    accuracy = float((distances.argmin(axis=1) == data.y_test).mean())
    assert accuracy > 0.6


@pytest.mark.slow
def test_flowerbed_pipeline_trains_har_cnn_on_two_processes(tmp_path: Path) -> None:
    out = tmp_path / "out"
    argv = ["pipeline", "--devices", "rpi4b,rpi4b", "--model", "har-cnn"]
    argv += ["--rounds", "2", "--steps", "4", "--batch", "32"]
    argv += ["--micro-batches", "4", "--time-scale", "2", "--out", str(out)]
    assert main(argv) == 0
    record = json.loads((out / "results.json").read_text())
    assert record["settings"]["dataset"] == "har"
    assert sorted(record["rounds"]) == ["1", "2"]
    for metrics in record["rounds"].values():
        # Two equal boards split har-cnn's 8 layers between two stages.
        assert metrics["stages"] == 2 and sum(metrics["partition"]) == 8
        assert metrics["num-examples"] == 4 * 32 and metrics["lost-steps"] == 0
    assert record["rounds"]["2"]["train-loss"] < np.log(6)  # below chance's loss
    assert record["test_accuracy"] > 0.25  # six classes: chance is 1/6
