"""Populations: many more devices than a round samples, and more than the data has."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from flowerbed.cli import main
from flowerbed.data import DataError
from flowerbed.sims.config import Scenario
from flowerbed.sims.population import (
    MIN_SAMPLES,
    check_cohort_memory,
    check_population,
    drawn_shard,
)
from flowerbed.sims.scenario import build_fleet_grid, run_scenario, run_server

pytestmark = pytest.mark.usefixtures("quiet_single_threaded")
"""Tiny models train fastest on one thread."""


def test_a_ten_thousand_device_population_only_pays_for_its_cohorts() -> None:
    # 0.2% of 10,000 devices: a cohort of 20 per round
    config = {"num-nodes": 10_000, "num-rounds": 2, "fraction-train": 0.002}
    config |= {"dropout": 0.0, "local-steps": 2, "seed": 4}
    grid = build_fleet_grid(config)
    try:
        outcome = run_server(grid, Scenario.from_run_config(config), write=False)
    finally:
        grid.close()
    assert [len(r.participants) for r in outcome.records] == [20, 20]
    assert all(r.failed == [] for r in outcome.records)
    # only the sampled devices ever got a context (hence data and a model)
    sampled = {p for r in outcome.records for p in r.participants}
    assert grid.nodes_contacted == len(sampled) <= 40
    assert len(list(grid.get_node_ids())) == 10_000


def test_more_nodes_than_the_test_split_can_shard_still_train() -> None:
    # digits: 360 test samples; 500 nodes used to make every node raise
    outcome = run_scenario(
        {"num-nodes": 500, "num-rounds": 1, "fraction-train": 0.02, "dropout": 0.0},
        write=False,
    )
    assert len(outcome.records[0].participants) == 10
    assert outcome.results["failed_tasks"] == 0 and outcome.results["errors"] == []


def test_a_device_draws_the_same_shard_whatever_the_population() -> None:
    labels = np.repeat(np.arange(10), 30)
    a = drawn_shard(labels, 7, "train", "iid", 0.5, seed=1)
    assert np.array_equal(a, drawn_shard(labels, 7, "train", "iid", 0.5, seed=1))
    assert len(a) == MIN_SAMPLES["train"] and len(set(a.tolist())) == len(a)
    assert not np.array_equal(a, drawn_shard(labels, 8, "train", "iid", 0.5, seed=1))
    skewed = drawn_shard(labels, 7, "test", "dirichlet", 0.5, seed=1)
    assert len(skewed) == MIN_SAMPLES["test"]


def test_a_partition_devices_cannot_draw_is_refused_when_the_data_is_short() -> None:
    check_population(1437, 718, "natural", "digits")  # 2 samples each: fits
    with pytest.raises(DataError) as err:
        check_population(1437, 719, "natural", "digits")
    message = str(err.value)
    assert "'digits' has 1437 training samples" in message
    assert "at most 718 nodes" in message and "iid, dirichlet" in message


def test_sim_shows_why_tasks_failed_and_exits_non_zero_when_all_did(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["sim", "--nodes", "3", "--rounds", "1", "--dropout", "1"]
    code = main([*args, "--out", str(tmp_path)])
    captured = capsys.readouterr()
    assert code == 1
    assert "no update was applied (1 round(s) completed): all 3 train tasks failed" in (
        captured.err
    )
    assert "in round 1: " in captured.out and "dropped out" in captured.out


def refused_one_byte_short(
    check: Callable[..., None], args: tuple[float, ...], fits: int
) -> str:
    """The message of the DataError ``check(*args)`` raises with one byte less
    than ``fits`` available, after checking that ``fits`` bytes pass."""
    check(*args, available=fits)
    with pytest.raises(DataError) as refused:
        check(*args, available=fits - 1)
    return str(refused.value)


def test_a_round_that_cannot_fit_in_memory_is_refused_naming_the_cohort_that_fits() -> (
    None
):
    # 1,000 nodes at fraction-train 0.5 sample 500; each task holds 3 model-sized
    # buffers of a 1 KiB model + 32 KiB: 500 x 35 KiB = 17,920,000 bytes.
    message = refused_one_byte_short(check_cohort_memory, (1000, 0.5, 1024), 17_920_000)
    assert "num-nodes=1000 with fraction-train=0.5: a round of 500 train" in message
    assert "(35 KiB each for a 1 KiB model)" in message
    assert "sample at most 499 nodes per round" in message
