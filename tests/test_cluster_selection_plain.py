"""ClusterSelection with plain Flower clients: fallbacks that are logged, no crash.

A plain Flower ClientApp reports only ``num-examples``, decides its own work (it
ignores ``local-steps``), and the ServerApp sets no ``local-steps``. Here node 3
becomes three times slower from round 3 on, so the measured round drifts from the
estimate and ClusterSelection must refit its model without ``train-time-s``.
"""

from __future__ import annotations

import logging
import math

import pytest
from flowerbed import keys
from flowerbed.strategies import ClusterSelection, RuntimeWeightedFedAvg
from flowerbed.strategies.cluster_selection import (
    Observation,
    SelectionGoal,
    observation_of,
)
from flwr.app import Message, MetricRecord, RecordDict
from test_strategies_fakes import FakeGrid, config_of, node, weights


def plain(seconds: float, slower_from: int | None = None):  # type: ignore[no-untyped-def]
    """A client doing fixed work; 3x slower from round ``slower_from`` on."""

    def run(message: Message) -> tuple[Message | None, float]:
        server_round = int(config_of(message).get(keys.SERVER_ROUND, 0))
        slow = slower_from is not None and server_round >= slower_from
        return node(1.0, seconds=seconds * (3 if slow else 1), report_time=False)(
            message
        )

    return run


def test_plain_clients_under_drift_train_every_round_with_logged_fallbacks(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="flwr")
    grid = FakeGrid({1: plain(1.0), 2: plain(1.2), 3: plain(1.1, slower_from=3)})
    strategy = ClusterSelection(
        strategy=RuntimeWeightedFedAvg(fraction_evaluate=0.0),
        goal=SelectionGoal(min_nodes=2),
    )
    result = strategy.start(grid, weights(), num_rounds=5)

    assert sorted(result.train_metrics_clientapp) == [1, 2, 3, 4, 5]
    lines = [r.getMessage() for r in caplog.records]
    assert sum("no 'local-steps' in train_config" in m for m in lines) == 1
    assert any("off the estimate" in (r.event or "") for r in strategy.selection_log)
    assert sum("refitting a drifted node scales" in m for m in lines) == 1
    # No local-steps was set, so rounds send none (profiling tasks, server-round
    # 0, do): each client does its own work.
    trained = [m for _, m in grid.pushed if m.metadata.message_type == "train"]
    rounds = [m for m in trained if config_of(m).get(keys.SERVER_ROUND, 0) >= 1]
    assert rounds and all(keys.LOCAL_STEPS not in config_of(m) for m in rounds)


def test_a_client_that_ignores_local_steps_is_all_overhead() -> None:
    # Profiling tasks of 1 and 3 steps took 1.2 and 1.1 s: the slope is noise.
    from flowerbed.strategies.cluster_selection import fit_node

    model = fit_node(
        1,
        [
            Observation(steps=1, round_trip_s=1.2),
            Observation(steps=3, round_trip_s=1.1),
        ],
    )
    assert model.step_s == pytest.approx(0.0, abs=1e-9)
    assert model.overhead_s == pytest.approx(1.15)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -1.0, 1e300])
def test_unusable_timings_count_as_unknown(bad: float) -> None:
    metrics = MetricRecord(
        {keys.NUM_EXAMPLES: 10, keys.TRAIN_TIME_S: bad, keys.NUM_STEPS: bad}
    )
    reply = Message(RecordDict({keys.METRICS: metrics}), reply_to=_sent())
    obs = observation_of(reply, round_trip_s=2.0, steps=3, transfers=2)
    assert obs is not None
    assert obs.train_time_s is None and obs.steps == 3 and obs.round_trip_s == 2.0


def _sent() -> Message:
    message = Message(RecordDict({keys.ARRAYS: weights()}), 1, "train", ttl=10.0)
    message.metadata.__dict__["_message_id"] = "m1"
    return message


def test_a_node_reporting_nan_times_is_left_out_not_a_crash(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Node 3 reports train-time-s NaN and one step for every task: its timings
    # are unknown (no train time, one task length), so it is left out, logged;
    # with min_nodes=3 only two usable nodes remain and the run trains on them.
    caplog.set_level(logging.WARNING, logger="flwr")

    def nan_time(message: Message) -> tuple[Message | None, float]:
        answer, delay = node(1.0, seconds=1.0, steps=1)(message)
        assert answer is not None
        metrics = answer.content[keys.METRICS]
        assert isinstance(metrics, MetricRecord)
        metrics[keys.TRAIN_TIME_S] = math.nan
        return answer, delay

    grid = FakeGrid(
        {1: node(1.0, seconds=1.0, steps=1), 2: node(1.0, seconds=1.2, steps=1)}
        | {3: nan_time}
    )
    strategy = ClusterSelection(
        strategy=RuntimeWeightedFedAvg(fraction_evaluate=0.0),
        goal=SelectionGoal(min_nodes=3),
    )
    result = strategy.start(grid, weights(), num_rounds=2, train_config=_steps())
    assert sorted(strategy.node_models) == [1, 2]
    lines = [r.getMessage() for r in caplog.records]
    assert any("node 3" in m and "left out" in m for m in lines)
    assert any("fewer than the 3 the wrapped strategy wants" in m for m in lines)
    assert sorted(result.train_metrics_clientapp) == [1, 2]


def _steps():  # type: ignore[no-untyped-def]
    from flwr.app import ConfigRecord

    return ConfigRecord({keys.LOCAL_STEPS: 1})
