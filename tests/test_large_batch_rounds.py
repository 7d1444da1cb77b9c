"""LargeBatchRounds: shares by speed, the pseudo-gradient by hand, 138 phones."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest
from flowerbed import keys
from flowerbed.sims.config import Scenario
from flowerbed.sims.links import SwitchedEthernet
from flowerbed.sims.scenario import build_fleet_grid, run_server
from flowerbed.strategies import LargeBatchRounds
from flowerbed.strategies.accumulation import to_arrayrecord
from flwr.app import ConfigRecord


def test_shares_follow_measured_samples_per_second() -> None:
    s = LargeBatchRounds(batch_size=12)
    s.sample_rates = {1000: 30.0, 1001: 10.0}
    # node 1002 never measured: counts as the mean (20)
    assert s.share_batch([1000, 1001, 1002]) == {1000: 6, 1001: 2, 1002: 4}
    # the configs the nodes get: their share, one step, the client rate
    grid = build_fleet_grid({"num-nodes": 3}, ["galaxy-s10plus"] * 3)
    arrays = to_arrayrecord({"w": np.zeros(2, np.float32)})
    messages = list(s.configure_train(1, arrays, ConfigRecord(), grid))
    configs = {m.metadata.dst_node_id: m.content[keys.CONFIG] for m in messages}
    assert {n: c[keys.BATCH_SIZE] for n, c in configs.items()} == s.shares
    assert s.shares == {1000: 6, 1001: 2, 1002: 4}
    assert {c[keys.LEARNING_RATE] for c in configs.values()} == {1.0}
    assert {c[keys.LOCAL_STEPS] for c in configs.values()} == {1}


def test_server_step_is_the_optimiser_on_the_pseudo_gradient() -> None:
    """x = (1, 2); the averaged reply (0.9, 2.2) at client_lr 0.5, k = 1 means
    g = (x - avg) / 0.5 = (0.2, -0.4). Plain SGD (momentum 0) at the scaled rate
    0.1 * 512 / 256 = 0.2: x' = x - 0.2 g = (0.96, 2.08)."""
    s = LargeBatchRounds(
        batch_size=512,
        base_batch=256,
        base_lr=0.1,
        client_lr=0.5,
        optimizer="sgd",
        momentum=0.0,
    )
    s._set_global(to_arrayrecord({"w": np.array([1.0, 2.0], np.float32)}))
    new = s.server_step({"w": np.array([0.9, 2.2], np.float32)})
    np.testing.assert_allclose(new["w"], [0.96, 2.08], rtol=1e-6)
    assert new["w"].dtype == np.float32
    assert s.server_steps == 1


def test_bad_settings_are_named() -> None:
    with pytest.raises(ValueError, match="optimizer 'adam'; valid choices"):
        LargeBatchRounds(optimizer="adam")
    with pytest.raises(ValueError, match="client_lr must be > 0"):
        LargeBatchRounds(client_lr=0.0)


def lamb_rounds(
    train: int, available: int, batch: int, **options: Any
) -> LargeBatchRounds:
    """LargeBatchRounds training a batch of ``batch`` on ``train`` of at least
    ``available`` nodes with LAMB on the server at 0.02 for that batch, no
    evaluation round."""
    return LargeBatchRounds(
        fraction_evaluate=0.0,
        min_train_nodes=train,
        min_available_nodes=available,
        batch_size=batch,
        optimizer="lamb",
        base_lr=0.02,
        base_batch=batch,
        **options,
    )


def digits_lenet(nodes: int, rounds: int) -> dict[str, Any]:
    """The run config of ``rounds`` rounds of LeNet on digits over ``nodes``
    nodes, no dropout, seed 1."""
    return {
        "dataset": "digits",
        "model": "lenet",
        "num-nodes": nodes,
        "num-rounds": rounds,
        "dropout": 0.0,
        "seed": 1,
    }


def run_on_one_switch(
    config: dict[str, Any], devices: list[str], strategy: LargeBatchRounds
) -> Any:
    """The outcome of ``strategy`` on the in-process engine: ``config`` on a fleet
    of ``devices`` joined by one switched Ethernet."""
    grid = build_fleet_grid(config, devices)
    grid.network = SwitchedEthernet()
    try:
        return run_server(
            grid, Scenario.from_run_config(config), strategy=strategy, write=False
        )
    finally:
        grid.close()


@pytest.mark.slow
def test_138_simulated_phones_train_with_one_large_batch(tmp_path) -> None:
    """Requirement 4's configuration on the in-process engine: 138 Galaxy S10+
    phones on one switch, 4 digits each per round (B = 552), LAMB on the server."""
    config = {**digits_lenet(138, 12), "output-dir": str(tmp_path)}
    strategy = lamb_rounds(138, 138, 552)
    outcome = run_on_one_switch(config, ["galaxy-s10plus"] * 138, strategy)
    records = outcome.records
    assert len(records) == 12
    assert all(len(r.participants) == 138 for r in records)
    assert records[-1].accuracy > records[0].accuracy + 0.3
    assert strategy.server_steps == 12


def six_phones(rounds: int, **options: Any) -> tuple[Any, LargeBatchRounds]:
    """Four Galaxy S10+ and two low-end phones (8x slower) on one switch, a large
    batch of 96; the run's outcome and the strategy."""
    devices = ["galaxy-s10plus"] * 4 + ["low-end-phone"] * 2
    strategy = lamb_rounds(4, 6, 96, **options)
    return run_on_one_switch(digits_lenet(6, rounds), devices, strategy), strategy


def test_over_selection_keeps_the_first_replies_so_a_slow_phone_does_not_stall() -> (
    None
):
    """FedAvg's sample is 4 of the six phones, 1.5x over-selection sends to all
    six and each round closes at the first four replies, so no round waits for
    a low-end phone."""
    outcome, strategy = six_phones(3, fraction_train=4 / 6, over_selection=1.5)
    slow = {4, 5}  # partition ids of the low-end phones
    for record in outcome.records:
        assert len(record.participants) == 4
        assert not slow & set(record.participants)
    # every round took the fast phones' time: shares are by speed from round 2,
    # but even round 1 (equal shares) closes before a low-end phone replies
    assert strategy.server_steps == 3


def test_a_deadline_cuts_slow_phones_once_then_their_shares_fit_it() -> None:
    """Equal shares of 96 in round 1 (16 each) and a 15 ms deadline that only
    the fast phones meet. The slow ones' rates are then bounded by 16 samples /
    15 ms (censored), their shares shrink, and from round 2 on all six finish
    within the deadline (without the bound they were never measured and missed
    every round, 32 samples lost each time)."""
    deadline = 0.015
    outcome, strategy = six_phones(4, deadline_s=deadline)
    records = outcome.records
    assert sorted(records[0].participants) == [0, 1, 2, 3]
    assert all(len(r.participants) == 6 for r in records[1:])
    times = [r.virtual_time_s for r in records]
    assert times[0] == pytest.approx(deadline, rel=0.05)
    assert all(b - a < deadline for a, b in itertools.pairwise(times))
    fast, slow = strategy.shares[1000], strategy.shares[1004]
    assert slow < fast / 2 and sum(strategy.shares.values()) == 96


@pytest.mark.slow
def test_board_clientapps_train_their_shares(tmp_path) -> None:
    """Three board ClientApps (flowerbed.clients.board_app, real processes) on
    digits partitions: each round they train the shares the server sends."""
    import numpy as np
    from flowerbed.data import load_dataset, partition
    from flowerbed.models import build_model
    from flowerbed.sims.process_grid import ProcessGrid
    from flwr.app import ArrayRecord

    data = load_dataset("digits")
    paths = []
    for i, idx in enumerate(partition(data.y_train, 3, seed=1)):
        path = tmp_path / f"board{i}.npz"
        x = np.round(data.x_train[idx] * 255).astype(np.uint8)
        np.savez(path, x=x, y=data.y_train[idx])
        paths.append(path)
    configs = [{"dataset-path": str(p)} for p in paths]
    strategy = lamb_rounds(3, 3, 48)
    start = ArrayRecord(build_model("lenet", 1, 8, 10).state_dict())
    with ProcessGrid(
        "flowerbed.clients.board_app:app", configs, {"model": "lenet"}
    ) as grid:
        result = strategy.start(grid, start, num_rounds=3, timeout=120)
    assert sorted(result.train_metrics_clientapp) == [1, 2, 3]
    for metrics in result.train_metrics_clientapp.values():
        assert metrics["large-batch"] == 48 and metrics["participants"] == 3
    assert sum(strategy.shares.values()) == 48
    assert not np.array_equal(
        result.arrays["features.0.weight"].numpy(), start["features.0.weight"].numpy()
    )
