"""Numbers that pass the range checks must still not move the model.

Models are one or two floats, the global model 0; an honest node moves it by
+0.03. Expectations are worked out by hand from FedNova's average
(``x + tau_eff * sum_i w_i d_i / tau_i / sum_i w_i``, ``tau_eff = sum_i w_i tau_i /
sum_i w_i``, Wang et al., NeurIPS 2020, Eq. 6).
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
from flowerbed.strategies import DeadlineFedAvg, RuntimeWeightedFedAvg
from flowerbed.strategies.accumulation import to_arrayrecord
from flwr.app import Message
from test_strategies_fakes import FakeGrid, node, received, reply, weights


def honest_nine_and(attacker: object) -> dict[int, object]:
    nodes: dict[int, object] = {
        n: node(0.03, seconds=1.0, steps=10) for n in range(1, 10)
    }
    nodes[10] = attacker
    return nodes


@pytest.mark.parametrize("cls", [RuntimeWeightedFedAvg, DeadlineFedAvg])
def test_a_claim_of_1e9_steps_counts_as_the_steps_assigned(
    cls: type, caplog: pytest.LogCaptureFixture
) -> None:
    # Node 10 returns the model unchanged and claims 1e9 steps. Held to its
    # assigned 10: tau_eff = 10, every d_i / tau_i = 0.003 for nine nodes and 0
    # for node 10: 10 x 9 x 0.003 / 10 = 0.027 (unbounded: ~2.7e6).
    attacker = node(0.0, seconds=2.0, steps=10**9)
    strategy = cls(local_steps=10, fraction_evaluate=0.0)
    with caplog.at_level(logging.WARNING, logger="flwr"):
        result = strategy.start(FakeGrid(honest_nine_and(attacker)), weights(), 2)
    assert float(result.arrays["w"].numpy()[0]) == pytest.approx(0.054, rel=1e-5)
    capped = [r for r in caplog.records if "num-steps=1e+09" in r.getMessage()]
    assert len(capped) == 1  # once per node, not once per reply
    assert "more than 10 (the local-steps it was assigned)" in capped[0].getMessage()


def test_without_assigned_work_a_claim_is_held_to_the_cap_times_the_median() -> None:
    # Nothing assigned: the nine honest replies (10 steps, arriving first) set
    # the median; node 10's 1e9 counts as weight_cap x 10 = 20: tau_eff =
    # (9 x 10 + 20) / 10 = 11, so 11 x 9 x 0.003 / 10 = 0.0297.
    attacker = node(0.0, seconds=2.0, steps=10**9)
    strategy = RuntimeWeightedFedAvg(fraction_evaluate=0.0)
    result = strategy.start(FakeGrid(honest_nine_and(attacker)), weights(), 1)
    assert float(result.arrays["w"].numpy()[0]) == pytest.approx(0.0297, rel=1e-5)


def two_arrays() -> object:
    return to_arrayrecord({"w": np.zeros(1, np.float32), "b": np.zeros(1, np.float32)})


def sends(make: object, seconds: float = 1.0) -> object:
    def run(message: Message) -> tuple[Message, float]:
        arrays = make(received(message))  # type: ignore[operator]
        return reply(message, arrays, num_examples=10, train_time_s=seconds), seconds

    return run


def plus(value: float) -> object:
    return sends(lambda x: {k: v + np.float32(value) for k, v in x.items()})


@pytest.mark.parametrize("first", [1, 2, 4])
def test_a_huge_finite_update_is_clipped_without_taking_the_others_digits(
    first: int,
) -> None:
    # 2^63 as uint64 in every array: finite, cast to float32, and clipped to 3x
    # the median update norm (0.03 sqrt 2) of the first three replies: it counts
    # as +0.09 in each array, so both move (9 x 0.03 + 0.09) / 10 = 0.036.
    # Adding it and taking the excess back out would cancel the float32 sum.
    huge = sends(
        lambda x: {k: np.full(v.shape, 2**63, np.uint64) for k, v in x.items()}
    )
    nodes = {n: plus(0.03) for n in range(1, 11)}
    nodes[first] = huge
    strategy = RuntimeWeightedFedAvg(fraction_evaluate=0.0)
    result = strategy.start(FakeGrid(nodes), two_arrays(), 1)
    w, b = (float(result.arrays[k].numpy()[0]) for k in ("w", "b"))
    assert w == pytest.approx(0.036, rel=1e-5) and b == pytest.approx(0.036, rel=1e-5)
    assert strategy.quarantine.failures == {}


@pytest.mark.parametrize("value", [1e30, 3e38])
def test_an_unsummable_reply_is_rejected_alone(value: float) -> None:
    # Rejected as too large to sum in float32; the nine others of its fold
    # group all count: both arrays move 0.03, only node 2 is charged.
    nodes = {n: plus(0.03) for n in range(1, 11)}
    nodes[2] = plus(value)
    strategy = RuntimeWeightedFedAvg(fraction_evaluate=0.0)
    result = strategy.start(FakeGrid(nodes), two_arrays(), 1)
    w, b = (float(result.arrays[k].numpy()[0]) for k in ("w", "b"))
    assert w == pytest.approx(0.03, rel=1e-5) and b == pytest.approx(0.03, rel=1e-5)
    assert strategy.quarantine.failures == {2: 1}


@pytest.mark.parametrize("bad", [1e15, -0.5, 1.5])
def test_an_evaluation_accuracy_outside_0_1_is_rejected_with_its_range(
    bad: float, caplog: pytest.LogCaptureFixture
) -> None:
    # Three honest nodes evaluate at 0.5; node 4's reply is refused, so the
    # aggregate is theirs: 0.5 (accepted, 1e15 would have made it ~2.5e14).
    nodes = {n: node(0.03, seconds=1.0, evaluate_acc=0.5) for n in range(1, 4)}
    nodes[4] = node(0.03, seconds=1.0, evaluate_acc=bad)
    strategy = RuntimeWeightedFedAvg(min_evaluate_nodes=1, min_available_nodes=1)
    with caplog.at_level(logging.WARNING, logger="flwr"):
        result = strategy.start(FakeGrid(nodes), weights(), 1)
    assert result.evaluate_metrics_clientapp[1]["eval-acc"] == pytest.approx(0.5)
    assert any(
        "rejected evaluate reply from node 4: metric 'eval-acc'" in r.getMessage()
        and "valid: [0, 1] (a fraction)" in r.getMessage()
        for r in caplog.records
    )


def test_fedbuff_says_no_progress_and_stops_spinning_when_no_reply_has_examples(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Every reply says num-examples 0: no version can update the model. Each
    # version closes after buffer_size refused replies (the model unchanged);
    # NO PROGRESS every 3 such versions; one warning per node, not per reply.
    from flowerbed.strategies import FedBuff

    nodes = {n: node(0.03, seconds=1.0, examples=0) for n in range(1, 5)}
    strategy = FedBuff(buffer_size=2, fraction_evaluate=0.0)
    grid = FakeGrid(nodes)
    with caplog.at_level(logging.WARNING, logger="flwr"):
        result = strategy.start(grid, weights(), num_rounds=6)
    assert float(result.arrays["w"].numpy()[0]) == 0.0
    assert grid.clock.now() < 60.0  # not the 3600 s start() timeout
    lines = [r.getMessage() for r in caplog.records]
    stalls = [m for m in lines if m.startswith("NO PROGRESS")]
    assert len(stalls) == 2
    assert "is 0: no work" in stalls[0]
    refused = [m for m in lines if "rejected reply from node" in m]
    assert len(refused) == len(nodes)


def test_a_partition_id_is_not_averaged_into_the_rounds_metrics() -> None:
    from flowerbed.strategies.accumulation import MetricsAccumulator
    from flwr.app import MetricRecord
    from flwr.serverapp.strategy.strategy_utils import aggregate_metricrecords

    metrics = MetricsAccumulator("num-examples")
    for pid in range(10):
        metrics.add(MetricRecord({"partition-id": pid, "train-loss": 1.0}), 10.0)
    result = metrics.result(aggregate_metricrecords)
    assert result is not None
    assert "partition-id" not in result
    assert result["train-loss"] == pytest.approx(1.0)


def test_a_capped_weight_is_logged_once_per_node_with_the_value_and_the_bound(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Nine nodes of 10 examples; node 10 claims 1e6 in each of two rounds.
    nodes = {n: node(0.03, seconds=1.0) for n in range(1, 10)}
    nodes[10] = node(0.03, seconds=2.0, examples=10**6)
    strategy = RuntimeWeightedFedAvg(fraction_evaluate=0.0)
    with caplog.at_level(logging.WARNING, logger="flwr"):
        strategy.start(FakeGrid(nodes), weights(), 2)
    lines = [r.getMessage() for r in caplog.records if "weight_cap=2" in r.getMessage()]
    assert len(lines) == 1
    assert lines[0].startswith("node 10: its weight 1e+06")
    assert "more than 20 (weight_cap=2 x the median" in lines[0]
