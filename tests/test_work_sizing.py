"""Work sized to the deadline per device (``min-batch-size``).

A node that cannot finish one step of its batch inside ``deadline-s`` used to
answer zero steps; with ``min-batch-size`` m it trains one step on the largest
batch b' = floor((D - transfers) / seconds-per-sample) that fits, when b' >= m.
DeadlineFedAvg sends m (``min_batch_size``) with partial work, and counts such a
step as the share b' / batch of a step when it estimates full-work durations.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pytest
from flowerbed import keys
from flowerbed.models import build_model, cost_factor, model_num_bytes
from flowerbed.sims import vclock
from flowerbed.sims.devices import DEVICES
from flowerbed.sims.scenario import build_fleet_grid
from flowerbed.strategies import DeadlineFedAvg
from flowerbed.strategies.round_metrics import ROUND_DEADLINE_S
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
from test_strategies_fakes import FakeGrid, config_of, node, weights

RUN = {"dropout": 0.0, "local-steps": 3, "batch-size": 8, "seed": 4, "num-nodes": 1}


def low_end_costs() -> tuple[float, float]:
    """(seconds per sample, transfer seconds both ways) of LeNet on digits on a
    low-end phone, from the device's catalogue figures."""
    dev = DEVICES["low-end-phone"]
    model = build_model("lenet", 1, 8, 10)
    sample_s = dev.seconds_per_sample * cost_factor("lenet", 1, 8, 10)
    nbytes = model_num_bytes(model)
    comm_s = nbytes * 8 / (dev.downlink_mbps * 1e6) + nbytes * 8 / (
        dev.uplink_mbps * 1e6
    )
    return sample_s, comm_s


def train_once(**config: float) -> dict[str, float]:
    grid = build_fleet_grid(RUN, ["low-end-phone"])
    try:
        content = RecordDict(
            {
                keys.ARRAYS: ArrayRecord(build_model("lenet", 1, 8, 10).state_dict()),
                keys.CONFIG: ConfigRecord({keys.SERVER_ROUND: 1, **config}),
            }
        )
        [reply] = grid.send_and_receive(
            [Message(content, 1000, "train", ttl=1e6, group_id="1")]
        )
    finally:
        grid.close()
    assert not reply.has_error()
    return dict(reply.content.metric_records[keys.METRICS])


def test_max_batch_within_is_the_samples_that_fit_after_the_transfers() -> None:
    # 10 s deadline, 4 s of transfers, 0.5 s per sample: 12 samples
    assert vclock.max_batch_within(10.0, 4.0, 0.5) == 12
    assert vclock.max_batch_within(4.2, 4.0, 0.5) == 0
    assert vclock.max_batch_within(3.0, 4.0, 0.5) == 0


def test_a_slow_node_trains_one_smaller_step_instead_of_none() -> None:
    sample_s, comm_s = low_end_costs()
    # Room for 5.5 samples: not one step of 8, one step of 5.
    deadline = comm_s + 5.5 * sample_s
    without = train_once(**{keys.DEADLINE_S: deadline})
    assert without[keys.NUM_STEPS] == 0 and without[keys.NUM_EXAMPLES] == 0
    got = train_once(**{keys.DEADLINE_S: deadline, keys.MIN_BATCH_SIZE: 4})
    assert got[keys.NUM_STEPS] == 1
    assert got[keys.NUM_EXAMPLES] == 5
    assert got[keys.TRAIN_TIME_S] == pytest.approx(5 * sample_s)
    # A batch below the minimum is not worth a step: zero steps, as before.
    small = train_once(**{keys.DEADLINE_S: deadline, keys.MIN_BATCH_SIZE: 6})
    assert small[keys.NUM_STEPS] == 0


def test_a_node_that_fits_whole_steps_keeps_its_batch() -> None:
    sample_s, comm_s = low_end_costs()
    # Room for 2.5 steps of 8: 2 steps of 8, min-batch-size changes nothing.
    deadline = comm_s + 2.5 * 8 * sample_s
    got = train_once(**{keys.DEADLINE_S: deadline, keys.MIN_BATCH_SIZE: 4})
    assert got[keys.NUM_STEPS] == 2 and got[keys.NUM_EXAMPLES] == 16


def test_deadline_fedavg_sends_min_batch_size_with_partial_work_only() -> None:
    grid = FakeGrid({1: node(1.0, seconds=1.0), 2: node(2.0, seconds=1.0)})
    DeadlineFedAvg(
        deadline_s=10.0, partial_work=True, min_batch_size=4, fraction_evaluate=0.0
    ).start(grid, weights(), num_rounds=1)
    assert {config_of(m)[keys.MIN_BATCH_SIZE] for _, m in grid.pushed} == {4}
    grid = FakeGrid({1: node(1.0, seconds=1.0), 2: node(2.0, seconds=1.0)})
    DeadlineFedAvg(
        deadline_s=10.0, partial_work=True, min_batch_size=0, fraction_evaluate=0.0
    ).start(grid, weights(), num_rounds=1)
    assert all(keys.MIN_BATCH_SIZE not in config_of(m) for _, m in grid.pushed)


def test_work_sizing_is_on_by_default_and_a_set_percentile_is_kept() -> None:
    # The default percentile (two speeds) is specified in test_deadline_two_speed.
    assert DeadlineFedAvg(partial_work=True).min_batch_size == 4
    assert DeadlineFedAvg(deadline_percentile=55.0).deadline_percentile == 55.0


def test_min_batch_size_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match="min_batch_size"):
        DeadlineFedAvg(min_batch_size=-1)


@pytest.mark.parametrize(("min_batch", "expected"), [(4, 120.0), (0, 30.0)])
def test_a_smaller_step_counts_as_its_share_of_a_step_in_the_deadline(
    min_batch: int, expected: float
) -> None:
    # Node 2 is assigned 10 steps of 16 and does 1 step of 4 samples in 3 s of
    # compute (no transfer time): a quarter of a step, so its full work is
    # 3 x 10 / 0.25 = 120 s. Without min_batch_size the reply is taken as one
    # whole step: 3 x 10 / 1 = 30 s. At p100 the next deadline is that time.
    grid = FakeGrid(
        {
            1: node(1.0, seconds=1.0, steps=10, examples=160),
            2: node(1.0, seconds=3.0, steps=1, examples=4),
        }
    )
    result = DeadlineFedAvg(
        adaptive_deadline=True,
        deadline_s=5.0,
        deadline_percentile=100.0,
        partial_work=True,
        min_batch_size=min_batch,
        local_steps=10,
        pacer_step=0.0,
        fraction_evaluate=0.0,
        weighting="examples",
        learn_margin=False,  # the full-work time itself, no margin on top
    ).start(
        grid,
        weights(),
        num_rounds=2,
        train_config=ConfigRecord({keys.BATCH_SIZE: 16}),
    )
    assert result.train_metrics_clientapp[2][ROUND_DEADLINE_S] == pytest.approx(
        expected
    )


class _Updates(DeadlineFedAvg):
    """DeadlineFedAvg that notes the rounds whose aggregation gave a model."""

    updated: list[int]

    def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> Any:
        out = super().aggregate_train(server_round, replies)
        if out[0] is not None:
            self.updated = [*getattr(self, "updated", []), server_round]
        return out


@pytest.mark.usefixtures("quiet_single_threaded")
def test_a_fast_percentile_never_leaves_a_round_without_an_update() -> None:
    """p30 on phones-10x digits: a fast phone's task is ~85% transfer, so the
    30th percentile of full-work durations left no node time for one step
    (rounds 4 and 5 of 10 nodes had no update) until the floor of transfers plus
    one smallest step (DeadlineFedAvg._least_seconds) held the deadline up."""
    from flowerbed.sims.scenario import run_scenario

    strategy = _Updates(
        fraction_evaluate=0.0,
        min_train_nodes=1,
        min_available_nodes=1,
        adaptive_deadline=True,
        over_selection=1.3,
        partial_work=True,
        balance_work=True,
        deadline_percentile=30.0,
        seed=1,
    )
    config = {"fleet": "phones-10x", "num-nodes": 10, "num-rounds": 8, "seed": 1}
    run_scenario(config, strategy=strategy, write=False)
    assert strategy.updated == list(range(1, 9))
    least = [s for _, s in strategy.least]
    assert least and all(s > 0 for s in least)
    assert strategy.current_deadline(9) * 0.8 >= min(least)
