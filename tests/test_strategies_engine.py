"""Each straggler mechanism on the in-process engine.

Fleet: two Pixel 7 phones, a low-end phone (about ten times slower to compute) and
a node that never answers. Expectations are derived from the durations the engine
itself reports for one task on each device (``probe``), never hard-coded.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from flowerbed import keys
from flowerbed.data import load_dataset
from flowerbed.models import build_model
from flowerbed.strategies import DeadlineFedAvg, FedBuff, RuntimeWeightedFedAvg
from flowerbed.strategies.round_metrics import (
    ROUND_CLOCK_S,
    ROUND_DEADLINE_S,
    ROUND_LATE_UPDATES,
    ROUND_PARTICIPANTS,
    ROUND_STALENESS,
    ROUND_STRAGGLERS,
)
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict

engine = pytest.importorskip("flowerbed.sims.scenario")

STEPS = 4
FLEET = ["pixel-7", "pixel-7", "low-end-phone", "offline"]
RUN_CONFIG: dict[str, Any] = {
    "model": "lenet",
    "dataset": "digits",
    "local-steps": STEPS,
    "batch-size": 16,
    "dropout": 0.0,
    "seed": 1,
}


pytestmark = pytest.mark.usefixtures("quiet_single_threaded")


def initial_arrays() -> ArrayRecord:
    data = load_dataset("digits", "")
    model = build_model("lenet", data.in_channels, data.image_size, data.num_classes)
    return ArrayRecord(model.state_dict())


def grid_for(devices: Sequence[str]):  # type: ignore[no-untyped-def]
    grid = engine.build_fleet_grid(RUN_CONFIG, list(devices))
    grid.pushed = []
    push = grid.push_messages

    def recording_push(messages):  # type: ignore[no-untyped-def]
        batch = list(messages)
        grid.pushed.extend((grid.clock.now(), m) for m in batch)
        return push(batch)

    grid.push_messages = recording_push
    return grid


@dataclass(frozen=True)
class Device:
    duration: float  # push to reply, for STEPS steps
    comm: float
    step: float


def probe(device: str) -> Device:
    """What the engine reports for one STEPS-step task on ``device``."""
    grid = engine.build_fleet_grid(RUN_CONFIG, [device])
    (node,) = grid.get_node_ids()
    config = ConfigRecord({keys.LOCAL_STEPS: STEPS, keys.SERVER_ROUND: 1})
    message = Message(
        RecordDict({keys.ARRAYS: initial_arrays(), keys.CONFIG: config}),
        node,
        "train",
        ttl=1e6,
    )
    ids = list(grid.push_messages([message]))
    grid.clock.wait(1e6)
    (reply,) = grid.pull_messages(ids)
    metrics = reply.content[keys.METRICS]
    return Device(
        duration=grid.clock.now(),
        comm=float(metrics[keys.COMM_TIME_S]),
        step=float(metrics[keys.TRAIN_TIME_S]) / int(metrics[keys.NUM_STEPS]),
    )


@pytest.fixture(scope="module")
def fast() -> Device:
    return probe("pixel-7")


@pytest.fixture(scope="module")
def slow() -> Device:
    return probe("low-end-phone")


def test_the_fleet_holds_a_ten_times_slower_node(fast: Device, slow: Device) -> None:
    assert slow.step / fast.step == pytest.approx(10, rel=0.3)
    assert slow.duration > fast.duration


def test_fixed_deadline_keeps_rounds_to_the_deadline(
    fast: Device, slow: Device
) -> None:
    deadline = (fast.duration + slow.duration) / 2
    grid = grid_for(FLEET)
    result = DeadlineFedAvg(
        deadline_s=deadline, late_updates=False, fraction_evaluate=0.0
    ).start(grid, initial_arrays(), num_rounds=2)
    first, second = result.train_metrics_clientapp[1], result.train_metrics_clientapp[2]
    assert (first[ROUND_PARTICIPANTS], first[ROUND_STRAGGLERS]) == (2, 2)
    assert first[ROUND_CLOCK_S] == pytest.approx(deadline)
    # Without late updates the stragglers' work is abandoned: round 2 samples all
    # four again and also ends at its deadline.
    assert (second[ROUND_PARTICIPANTS], second[ROUND_STRAGGLERS]) == (2, 2)
    assert second[ROUND_CLOCK_S] == pytest.approx(2 * deadline)


def test_late_update_of_the_slow_node_lands_in_a_later_round(
    fast: Device, slow: Device
) -> None:
    deadline = (fast.duration + slow.duration) / 2
    result = DeadlineFedAvg(
        deadline_s=deadline, max_staleness=2, fraction_evaluate=0.0
    ).start(grid_for(FLEET), initial_arrays(), num_rounds=3)
    late = [m[ROUND_LATE_UPDATES] for m in result.train_metrics_clientapp.values()]
    assert late[0] == 0
    assert sum(late) >= 1


def test_over_selection_keeps_the_first_k(fast: Device) -> None:
    # K = int(5 * 0.6) = 3 of ceil(3 * 1.5) = 5 sampled: the three Pixels finish
    # first, so the round ends at their duration.
    grid = grid_for(["pixel-7", "pixel-7", "pixel-7", "low-end-phone", "offline"])
    result = DeadlineFedAvg(
        fraction_train=0.6, over_selection=1.5, fraction_evaluate=0.0
    ).start(grid, initial_arrays(), num_rounds=1)
    metrics = result.train_metrics_clientapp[1]
    assert len(grid.pushed) == 5
    assert metrics[ROUND_PARTICIPANTS] == 3
    assert metrics[ROUND_CLOCK_S] == pytest.approx(fast.duration)


@pytest.mark.parametrize(("partial", "participants"), [(False, 2), (True, 3)])
def test_partial_work_lets_the_slow_node_contribute_in_time(
    slow: Device, partial: bool, participants: int
) -> None:
    # The deadline leaves the slow phone room for its transfers and 1.5 steps of
    # its 4: with partial work (whole deadline as budget) it reports 1 step in
    # time; without, it misses the round.
    deadline = slow.comm + 1.5 * slow.step
    assert deadline < slow.duration
    result = DeadlineFedAvg(
        deadline_s=deadline,
        partial_work=partial,
        work_fraction=1.0,
        weighting="fednova",
        late_updates=False,
        fraction_evaluate=0.0,
    ).start(grid_for(FLEET), initial_arrays(), num_rounds=1)
    metrics = result.train_metrics_clientapp[1]
    assert metrics[ROUND_PARTICIPANTS] == participants
    assert metrics[ROUND_CLOCK_S] == pytest.approx(deadline)


def test_adaptive_deadline_follows_the_percentile_of_durations(
    fast: Device, slow: Device
) -> None:
    # Round 1: no history, closes at floor(80% of 4) = 3 replies (the slow phone).
    # Its durations: fast, fast, slow, and the offline node unfinished after
    # `slow`. P80 (nearest rank ceil(0.8 * 4) = 4) falls on the unfinished node,
    # so round 2's deadline grows: 1.5 * slow. With p75 (rank 3) it is `slow`.
    for percentile, expected in ((80.0, 1.5 * slow.duration), (75.0, slow.duration)):
        result = DeadlineFedAvg(
            adaptive_deadline=True,
            deadline_percentile=percentile,
            fraction_evaluate=0.0,
        ).start(grid_for(FLEET), initial_arrays(), num_rounds=2)
        first = result.train_metrics_clientapp[1]
        second = result.train_metrics_clientapp[2]
        assert first[ROUND_CLOCK_S] == pytest.approx(slow.duration)
        assert second[ROUND_DEADLINE_S] == pytest.approx(expected)


def test_fedbuff_keeps_versions_coming_past_slow_and_dead_nodes(
    fast: Device, slow: Device
) -> None:
    result = FedBuff(
        buffer_size=2, message_ttl_s=10 * slow.duration, fraction_evaluate=0.0
    ).start(grid_for(FLEET), initial_arrays(), num_rounds=4)
    train = result.train_metrics_clientapp
    assert sorted(train) == [1, 2, 3, 4]
    # The Pixels make versions every fast.duration; the slow phone's update arrives
    # stale, and nobody waits for the offline node.
    assert train[1][ROUND_CLOCK_S] == pytest.approx(fast.duration)
    assert any(m[ROUND_STALENESS] > 0 for m in train.values())
    assert train[4][ROUND_CLOCK_S] < 10 * slow.duration


def test_work_balancing_assigns_steps_by_measured_speed(
    fast: Device, slow: Device
) -> None:
    grid = grid_for(["pixel-7", "low-end-phone"])
    strategy = RuntimeWeightedFedAvg(
        balance_work=True, local_steps=STEPS, fraction_evaluate=0.0
    )
    strategy.start(grid, initial_arrays(), num_rounds=2)
    speeds = {1000: 1 / fast.step, 1001: 1 / slow.step}
    assert strategy.speeds == pytest.approx(speeds)
    mean = sum(speeds.values()) / 2
    expected = {n: max(1, round(STEPS * s / mean)) for n, s in speeds.items()}
    second_round = {
        m.metadata.dst_node_id: m.content[keys.CONFIG][keys.LOCAL_STEPS]
        for _, m in grid.pushed[2:]
    }
    assert second_round == expected


@pytest.mark.parametrize(
    "strategy",
    [
        lambda: RuntimeWeightedFedAvg(fraction_evaluate=0.0, min_train_nodes=1),
        lambda: DeadlineFedAvg(adaptive_deadline=True, fraction_evaluate=0.0),
        lambda: FedBuff(buffer_size=2, message_ttl_s=5.0, fraction_evaluate=0.0),
    ],
    ids=["runtime-weighted", "deadline", "fedbuff"],
)
def test_whole_scenario_learns(strategy) -> None:  # type: ignore[no-untyped-def]
    config = {**RUN_CONFIG, "num-rounds": 6, "local-steps": 10, "round-timeout-s": 5.0}
    outcome = engine.run_scenario(
        config, strategy=strategy(), devices=FLEET, write=False
    )
    accuracies = [r.accuracy for r in outcome.records]
    assert np.isfinite(accuracies).all()
    assert accuracies[-1] > accuracies[0] + 0.2
