"""No number in a reply can end a run, make a weight non-finite or silence others.

Issue 17's cases, each a row: node 3 answers with one hostile number; nodes 1 and
2 answer well (x+1 and x+3, 10 examples, 4 steps). Under every weighting and
strategy the round must end at (1 + 3) / 2 = 2 with the rejection logged, naming
the metric, its range and what was wrong.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import pytest
from flowerbed import keys
from flowerbed.sims.config import Scenario
from flowerbed.sims.scenario import build_fleet_grid, run_server
from flowerbed.strategies import DeadlineFedAvg, RuntimeWeightedFedAvg
from flowerbed.strategies.round_metrics import ROUND_PARTICIPANTS
from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy import Strategy
from test_bad_replies import assert_only_node_3_rejected, round_loops
from test_strategies_fakes import FakeGrid, node, received, reply, weights

GOOD = {"num_examples": 10, "num_steps": 4, "train_time_s": 1.0}

HOSTILE: dict[str, tuple[dict[str, float], str]] = {
    "num-examples 1e308": (
        {"num_examples": 1e308},
        "'num-examples' is above its ceiling (1e+308); valid: [0, 1e+09]",
    ),
    "num-examples 1e15": (
        {"num_examples": 1e15},
        "'num-examples' is above its ceiling",
    ),
    "train-time-s 1e-320": (
        {"train_time_s": 1e-320},
        "'train-time-s' is below its floor (9.99989e-321); valid: 0, or [1e-06",
    ),
    "train-time-s nan": ({"train_time_s": math.nan}, "'train-time-s' is not finite"),
    "num-steps 1e-300": (
        {"num_steps": 1e-300},
        "'num-steps' is not a whole number (1e-300)",
    ),
    "num-steps 1e300": ({"num_steps": 1e300}, "'num-steps' is above its ceiling"),
    "num-steps nan": ({"num_steps": math.nan}, "'num-steps' is not finite"),
    "samples-per-s 1e300": (
        {"samples_per_s": 1e300},
        "'samples-per-s' is above its ceiling",
    ),
    "loss 1e300": (
        {"train_loss": 1e300},
        "'train-loss' is above its ceiling (1e+300); valid: [0, 1e+15]",
    ),
    "battery 150%": ({"battery_pct": 150.0}, "'battery-pct' is above its ceiling"),
    "comm-time-s -1": ({"comm_time_s": -1.0}, "'comm-time-s' is negative (-1)"),
}


def hostile(numbers: dict[str, float]) -> Callable[[Message], tuple[Message, float]]:
    def run(message: Message) -> tuple[Message, float]:
        shifted = {k: v + 5 for k, v in received(message).items()}
        return reply(message, shifted, **{**GOOD, **numbers}), 0.5

    return run


STRATEGIES: dict[str, Callable[[], Strategy]] = {
    **round_loops("runtime"),
    **{
        f"runtime-weighted {w}": round_loops(w)["runtime-weighted"]
        for w in ("examples", "fednova", "throughput")
    },
    "runtime-weighted balanced": lambda: RuntimeWeightedFedAvg(
        balance_work=True, local_steps=4, fraction_evaluate=0.0
    ),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_a_hostile_number_is_rejected_with_its_range_and_the_round_goes_on(
    name: str, case: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="flwr")
    numbers, reason = HOSTILE[case]
    grid = FakeGrid(
        {
            1: node(1.0, seconds=1.0, steps=4),
            2: node(3.0, seconds=1.0, steps=4),
            3: hostile(numbers),
        }
    )
    # Equal examples, steps and times for nodes 1 and 2: every weighting gives
    # their plain mean. Node 3 answers first (0.5 s), so FedBuff's K = 2 buffer
    # fills with nodes 1 and 2.
    assert_only_node_3_rejected(
        STRATEGIES[name](), grid, caplog, reason, marks=("rejected",)
    )


@pytest.mark.usefixtures("quiet_single_threaded")
def test_one_nodes_nan_time_leaves_the_others_training_on_the_engine() -> None:
    # In-process fleet of 6; node 1002 reports train-time-s NaN every round. The
    # adaptive deadline and the runtime weighting read that time: the others'
    # updates must still be applied every round.
    run = {"fleet": "uniform", "num-nodes": 6, "num-rounds": 3, "seed": 2, "dropout": 0}
    grid = build_fleet_grid(run, batch=False)
    inner = grid.client_app

    def nan_time(message: Message, context: Context) -> Message:
        answer = inner(message, context)
        if message.metadata.dst_node_id == 1002 and not answer.has_error():
            metrics = MetricRecord(dict(answer.content[keys.METRICS]))
            metrics[keys.TRAIN_TIME_S] = math.nan
            content = RecordDict(
                {keys.ARRAYS: answer.content[keys.ARRAYS], keys.METRICS: metrics}
            )
            return Message(content, reply_to=message)
        return answer

    grid.client_app = nan_time  # type: ignore[assignment]
    strategy = DeadlineFedAvg(
        weighting="runtime",
        adaptive_deadline=True,
        fraction_evaluate=0.0,
        min_train_nodes=1,
        min_available_nodes=1,
    )
    outcome = run_server(
        grid, Scenario.from_run_config(run), strategy=strategy, write=False
    )
    grid.close()
    assert len(outcome.records) == 3
    assert outcome.records[-1].accuracy > outcome.records[0].accuracy
    assert all(math.isfinite(r.loss) for r in outcome.records)
    # every round used the five other nodes
    assert all(len(r.participants) >= 5 for r in outcome.records)


def test_participants_count_every_good_node_when_one_sends_nan_time() -> None:
    grid = FakeGrid(
        {
            1: node(1.0, seconds=1.0, steps=4),
            2: node(3.0, seconds=1.0, steps=4),
            3: hostile({"train_time_s": math.nan}),
        }
    )
    result = DeadlineFedAvg(
        weighting="runtime", fraction_evaluate=0.0, deadline_s=5.0
    ).start(grid, weights(), num_rounds=2)
    assert [m[ROUND_PARTICIPANTS] for m in result.train_metrics_clientapp.values()] == [
        2,
        2,
    ]


def with_loss(
    shift: float, seconds: float
) -> Callable[[Message], tuple[Message, float]]:
    """An honest node (x + shift, GOOD numbers) that also reports train-loss 0.25."""

    def run(message: Message) -> tuple[Message, float]:
        if message.metadata.message_type == "evaluate":
            return node(0.0, seconds=seconds)(message)  # type: ignore[return-value]
        shifted = {k: v + shift for k, v in received(message).items()}
        return reply(message, shifted, **GOOD, train_loss=0.25), seconds

    return run


def odd_shapes(message: Message) -> tuple[Message, float]:
    """Answers first with metrics of another shape: lists where others send numbers."""
    if message.metadata.message_type == "evaluate":
        metrics = MetricRecord({keys.NUM_EXAMPLES: 10, keys.EVAL_ACC: [0.9, 0.9]})
        return Message(RecordDict({keys.METRICS: metrics}), reply_to=message), 0.0
    shifted = {k: v + 5 for k, v in received(message).items()}
    return reply(message, shifted, **GOOD, train_loss=[1.0, 2.0]), 0.5


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_a_metric_of_another_shape_is_left_out_and_every_update_counts(
    name: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Flower's average of MetricRecords raised on a list where the others have a
    # number ('float' object is not iterable), ending the run. Node 3 answers
    # first; its update counts (equal weights: (1 + 3 + 5) / 3 = 3; FedBuff's
    # K = 2 takes nodes 3 and 1: (5 + 1) / 2 = 3), its odd metrics do not: they
    # count as not reported, and Flower averages a metric over every reply's
    # weight, so train-loss is 0.25 x 2/3 (FedBuff: 0.25 x 1/2).
    caplog.set_level(logging.WARNING, logger="flwr")
    grid = FakeGrid({1: with_loss(1.0, 1.0), 2: with_loss(3.0, 1.0), 3: odd_shapes})
    strategy = STRATEGIES[name]()
    strategy.fraction_evaluate = 1.0
    result = strategy.start(grid, weights(), num_rounds=1)
    assert float(result.arrays["w"].numpy()[0]) == pytest.approx(3.0)
    share = 1 / 2 if name == "fedbuff" else 2 / 3
    loss = result.train_metrics_clientapp[1]["train-loss"]
    assert loss == pytest.approx(0.25 * share)
    # evaluation: two honest replies (0.5) of three
    acc = result.evaluate_metrics_clientapp[1][keys.EVAL_ACC]
    assert acc == pytest.approx(0.5 * 2 / 3)
    lines = [r.getMessage() for r in caplog.records]
    left_out = "metric 'eval-acc' left out of 1 replies: not a number as in the other 2"
    assert left_out in lines
    assert any(m.startswith("metric 'train-loss' left out of 1 replies") for m in lines)
