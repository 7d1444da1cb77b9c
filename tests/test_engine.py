"""The in-process fleet engine: arrival order, deadlines, dropout, repeatability."""

import math

import pytest
from flowerbed import keys
from flowerbed.models import build_model, cost_factor, model_num_bytes
from flowerbed.sims import vclock
from flowerbed.sims.devices import get_device
from flowerbed.sims.engine import FleetGrid
from flowerbed.sims.scenario import build_fleet_grid, run_scenario
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict

BASE = {"dropout": 0.0, "local-steps": 4, "batch-size": 8, "seed": 3}


def grid_of(devices: list[str], **config: object) -> FleetGrid:
    return build_fleet_grid({**BASE, **config, "num-nodes": len(devices)}, devices)


def train_message(node_id: int, ttl: float | None = None, **config: float) -> Message:
    model = build_model("lenet", 1, 8, 10)
    content = RecordDict(
        {
            keys.ARRAYS: ArrayRecord(model.state_dict()),
            keys.CONFIG: ConfigRecord({keys.SERVER_ROUND: 1, **config}),
        }
    )
    return Message(content, node_id, "train", ttl=ttl, group_id="1")


def expected_duration(device: str, steps: int, batch: int = 8) -> float:
    """Hand formula: down + steps x step + up, for LeNet on 8x8 digits."""
    dev = get_device(device)
    nbytes = model_num_bytes(build_model("lenet", 1, 8, 10))
    comm = vclock.transfer_seconds(nbytes, dev.downlink_mbps) + vclock.transfer_seconds(
        nbytes, dev.uplink_mbps
    )
    return comm + steps * batch * dev.seconds_per_sample * cost_factor(
        "lenet", 1, 8, 10
    )


def metrics(reply: Message) -> dict:
    return dict(reply.content.metric_records[keys.METRICS])


def test_replies_arrive_in_virtual_time_order_and_only_once_arrived() -> None:
    grid = grid_of(["low-end-phone", "pixel-7", "rpi4b"])
    ids = list(grid.push_messages([train_message(n) for n in grid.get_node_ids()]))
    assert list(grid.pull_messages(ids)) == []  # nothing has arrived at t = 0

    order, times = [], []
    while len(order) < 3:
        grid.clock.wait(math.inf)
        for reply in grid.pull_messages(ids):
            order.append(int(metrics(reply)[keys.PARTITION_ID]))
            times.append(grid.clock.now())
    # rpi4b first: on this tiny model its 102 Mbit/s Wi-Fi beats the Pixel's 11 Mbit/s
    # uplink; the low-end phone last
    assert order == [2, 1, 0]
    assert times == pytest.approx(
        [expected_duration(d, 4) for d in ("rpi4b", "pixel-7", "low-end-phone")]
    )
    assert list(grid.pull_messages(ids)) == []  # each reply is returned once


def test_reported_time_is_compute_plus_communication() -> None:
    grid = grid_of(["galaxy-s10"])
    [reply] = grid.send_and_receive([train_message(1000)])
    m = metrics(reply)
    assert m[keys.NUM_STEPS] == 4 and m[keys.NUM_EXAMPLES] == 32
    assert m[keys.TRAIN_TIME_S] + m[keys.COMM_TIME_S] == pytest.approx(
        expected_duration("galaxy-s10", 4)
    )
    dev = get_device("galaxy-s10")
    assert m[keys.ENERGY_J] == pytest.approx(
        dev.busy_w * m[keys.TRAIN_TIME_S] + dev.idle_w * m[keys.COMM_TIME_S]
    )


def test_deadline_stops_training_and_reports_partial_work() -> None:
    full = expected_duration("low-end-phone", 4)
    one_step = expected_duration("low-end-phone", 1) - expected_duration(
        "low-end-phone", 0
    )
    deadline = (
        expected_duration("low-end-phone", 0) + 2.5 * one_step
    )  # room for 2 steps
    assert deadline < full
    grid = grid_of(["low-end-phone"])
    [reply] = grid.send_and_receive(
        [train_message(1000, **{keys.DEADLINE_S: deadline})]
    )
    assert metrics(reply)[keys.NUM_STEPS] == 2
    assert metrics(reply)[keys.NUM_EXAMPLES] == 16
    assert grid.clock.now() <= deadline


def test_send_and_receive_timeout_is_virtual_and_leaves_the_straggler_behind() -> None:
    grid = grid_of(["pixel-7", "low-end-phone"])
    fast = expected_duration("pixel-7", 4)
    replies = list(
        grid.send_and_receive(
            [train_message(n) for n in grid.get_node_ids()], timeout=2 * fast
        )
    )
    assert [int(metrics(r)[keys.PARTITION_ID]) for r in replies] == [0]
    assert grid.clock.now() == pytest.approx(2 * fast)


def test_a_vanished_node_answers_with_an_error_when_the_ttl_expires() -> None:
    grid = grid_of(["offline", "pixel-7"])
    ids = list(
        grid.push_messages([train_message(n, ttl=50.0) for n in grid.get_node_ids()])
    )
    grid.clock.wait(math.inf)
    assert len(list(grid.pull_messages(ids))) == 1  # the pixel's reply
    grid.clock.wait(math.inf)
    [expired] = grid.pull_messages(ids)
    assert expired.has_error() and grid.clock.now() == pytest.approx(50.0)


def test_dropout_rate_one_fails_every_task_and_zero_none() -> None:
    for rate, failures in ((1.0, 6), (0.0, 0)):
        grid = grid_of(["rpi4b"] * 6, dropout=rate)
        replies = grid.send_and_receive(
            [train_message(n, ttl=100.0) for n in grid.get_node_ids()], timeout=None
        )
        assert sum(r.has_error() for r in replies) == failures


def test_dropouts_follow_the_seed() -> None:
    def failed(seed: int) -> list[int]:
        grid = grid_of(["rpi4b"] * 12, dropout=0.5, seed=seed)
        replies = grid.send_and_receive(
            [train_message(n, ttl=100.0) for n in grid.get_node_ids()], timeout=None
        )
        return sorted(r.metadata.src_node_id for r in replies if r.has_error())

    assert failed(1) == failed(1)
    assert failed(1) != failed(2)
    assert 0 < len(failed(1)) < 12


def test_runs_repeat_exactly_for_a_seed() -> None:
    config = {
        "num-nodes": 5,
        "num-rounds": 2,
        "fleet": "mixed",
        "dropout": 0.3,
        "seed": 11,
    }
    a = run_scenario(config, write=False).records
    b = run_scenario(config, write=False).records
    assert [(r.participants, r.virtual_time_s, r.accuracy) for r in a] == [
        (r.participants, r.virtual_time_s, r.accuracy) for r in b
    ]
    c = run_scenario({**config, "seed": 12}, write=False).records
    assert [r.participants for r in a] != [r.participants for r in c] or [
        r.accuracy for r in a
    ] != [r.accuracy for r in c]


def test_flower_fedavg_runs_unchanged_and_learns() -> None:
    out = run_scenario(
        {"num-nodes": 4, "num-rounds": 3, "dropout": 0.0, "fleet": "uniform"},
        write=False,
    ).records
    assert [r.round for r in out] == [1, 2, 3]
    assert all(r.participants == [0, 1, 2, 3] for r in out)
    assert out[-1].accuracy > 0.5  # chance is 0.1
    # all nodes identical: every round costs the same virtual time
    assert out[1].virtual_time_s == pytest.approx(2 * out[0].virtual_time_s)


def test_profiling_query_prices_the_steps_on_the_virtual_clock() -> None:
    grid = grid_of(["low-end-phone"])
    content = RecordDict({keys.CONFIG: ConfigRecord({keys.PROFILE_STEPS: 3})})
    [reply] = grid.send_and_receive([Message(content, 1000, "query")])
    m = metrics(reply)
    step = expected_duration("low-end-phone", 1) - expected_duration("low-end-phone", 0)
    assert m[keys.NUM_STEPS] == 3 and m[keys.TRAIN_TIME_S] == pytest.approx(3 * step)
    assert m[keys.POWER_W] == get_device("low-end-phone").busy_w
    assert m[keys.SAMPLES_PER_S] == pytest.approx(24 / (3 * step))
