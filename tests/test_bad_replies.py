"""Bad replies are rejected with the node id and reason; the run goes on.

Node 1 and 2 answer well (x+1 and x+3, 10 examples each); node 3 sends one kind of
bad reply. Every strategy must end round 1 with x = (1 + 3) / 2 = 2.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import pytest
from flowerbed import keys
from flowerbed.strategies import DeadlineFedAvg, FedBuff, RuntimeWeightedFedAvg
from flowerbed.strategies.accumulation import to_arrayrecord
from flwr.app import Error, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy import Strategy
from test_strategies_fakes import FakeGrid, node, received, reply, weights


def shifted(message: Message) -> dict[str, np.ndarray]:
    return {k: v + 5 for k, v in received(message).items()}


def answer(
    build: Callable[[Message], Message],
) -> Callable[[Message], tuple[Message, float]]:
    return lambda message: (build(message), 1.5)


BAD_REPLIES: dict[str, tuple[Callable[[Message], Message], str]] = {
    "nan": (
        lambda m: reply(m, {"w": np.array([np.nan], np.float32)}, num_examples=10),
        "NaN or Inf",
    ),
    "inf": (
        lambda m: reply(m, {"w": np.array([np.inf], np.float32)}, num_examples=10),
        "NaN or Inf",
    ),
    "missing array": (
        lambda m: reply(m, {"v": np.array([1.0], np.float32)}, num_examples=10),
        "missing arrays ['w']",
    ),
    "extra array": (
        lambda m: reply(m, {**shifted(m), "b": np.zeros(2)}, num_examples=10),
        "unexpected arrays ['b']",
    ),
    "wrong shape": (
        lambda m: reply(m, {"w": np.zeros((2, 2), np.float32)}, num_examples=10),
        "shape (2, 2), expected (1,)",
    ),
    "lossy dtype": (
        lambda m: reply(m, {"w": np.array([1 + 2j], np.complex64)}, num_examples=10),
        "dtype complex64, which cannot become the model's float32",
    ),
    "overflowing cast": (
        lambda m: reply(m, {"w": np.array([1e300], np.float64)}, num_examples=10),
        "outside float32's range",
    ),
    "negative weight": (
        lambda m: reply(m, shifted(m), num_examples=-10),
        "'num-examples' is negative",
    ),
    "missing weight": (
        lambda m: reply(m, shifted(m), train_time_s=1.0),
        "'num-examples' is missing",
    ),
    "nan weight": (
        lambda m: reply(m, shifted(m), num_examples=float("nan")),
        "'num-examples' is not finite",
    ),
    "nan metric": (
        lambda m: reply(m, shifted(m), num_examples=10, loss=float("inf")),
        "'loss' is not finite",
    ),
    "negative runtime": (
        lambda m: reply(m, shifted(m), num_examples=10, train_time_s=-1.0),
        "'train-time-s' is negative",
    ),
    "error content": (
        lambda m: Message(Error(code=0, reason="out of memory"), reply_to=m),
        "out of memory",
    ),
    "two array records": (
        lambda m: Message(
            RecordDict(
                {
                    "a": to_arrayrecord(shifted(m)),
                    "b": to_arrayrecord(shifted(m)),
                    keys.METRICS: MetricRecord({keys.NUM_EXAMPLES: 10}),
                }
            ),
            reply_to=m,
        ),
        "exactly one ArrayRecord, got 2",
    ),
    "no metric record": (
        lambda m: Message(
            RecordDict({keys.ARRAYS: to_arrayrecord(shifted(m))}), reply_to=m
        ),
        "exactly one MetricRecord, got 0",
    ),
}


def fleet(bad: Callable[[Message], Message]) -> FakeGrid:
    return FakeGrid(
        {
            1: node(1.0, seconds=1.0),
            2: node(3.0, seconds=2.0),
            3: answer(bad),
        }
    )


def assert_only_node_3_rejected(
    strategy: Strategy,
    grid: FakeGrid,
    caplog: pytest.LogCaptureFixture,
    reason: str,
    marks: tuple[str, ...],
) -> None:
    """One round of ``strategy`` on ``grid`` averages nodes 1 and 2 (w = 1 and 3, so
    2.0) and logs one rejection, a line holding one of ``marks``: of node 3, for
    ``reason``."""
    result = strategy.start(grid, weights(), num_rounds=1)
    assert float(result.arrays["w"].numpy()[0]) == pytest.approx(2.0)
    rejections = [
        r.getMessage()
        for r in caplog.records
        if any(mark in r.getMessage() for mark in marks)
    ]
    assert len(rejections) == 1
    assert "node 3" in rejections[0]
    assert reason in rejections[0]


def round_loops(weighting: str) -> dict[str, Callable[[], Strategy]]:
    """A strategy of each round loop, none evaluating: runtime-weighted FedAvg and
    DeadlineFedAvg (5 s) weighting replies by ``weighting``, FedBuff with K = 2."""
    return {
        "runtime-weighted": lambda: RuntimeWeightedFedAvg(
            weighting=weighting, fraction_evaluate=0.0
        ),
        "deadline": lambda: DeadlineFedAvg(
            weighting=weighting, fraction_evaluate=0.0, deadline_s=5.0
        ),
        "fedbuff": lambda: FedBuff(fraction_evaluate=0.0, buffer_size=2),
    }


STRATEGIES = round_loops("examples")


@pytest.mark.parametrize("kind", sorted(BAD_REPLIES))
@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_bad_reply_is_rejected_and_logged_and_the_round_goes_on(
    kind: str, name: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="flwr")
    build, reason = BAD_REPLIES[kind]
    # FedBuff's K=2 buffer fills with node 1 (t=1) and node 2 (t=2), around node 3's
    # bad reply at t=1.5, so all three strategies land on (1 + 3) / 2. An error reply
    # gets Flower's own line, any other bad reply ours.
    assert_only_node_3_rejected(
        STRATEGIES[name](),
        fleet(build),
        caplog,
        reason,
        marks=("rejected reply", "Received error in reply"),
    )


def test_a_node_that_keeps_failing_is_quarantined_then_readmitted() -> None:
    grid = fleet(BAD_REPLIES["nan"][0])
    strategy = RuntimeWeightedFedAvg(
        weighting="examples",
        fraction_evaluate=0.0,
        quarantine_after=2,
        quarantine_rounds=3,
    )
    strategy.start(grid, weights(), num_rounds=7)
    rounds_sent = [int(m.metadata.group_id) for m in grid.pushed_to(3)]
    # Rejected in rounds 1 and 2 -> out for rounds 3, 4, 5 -> back in round 6.
    assert rounds_sent == [1, 2, 6, 7]
    assert all(len(grid.pushed_to(n)) == 7 for n in (1, 2))


def test_a_round_with_only_bad_replies_keeps_the_model() -> None:
    bad = answer(BAD_REPLIES["nan"][0])
    grid = FakeGrid({1: bad, 2: bad})
    result = RuntimeWeightedFedAvg(fraction_evaluate=0.0).start(
        grid, weights(4.0), num_rounds=2
    )
    assert float(result.arrays["w"].numpy()[0]) == 4.0


def test_bad_evaluate_replies_are_left_out_of_the_metrics() -> None:
    def bad_eval(message: Message) -> tuple[Message, float]:
        if message.metadata.message_type == "evaluate":
            metrics = MetricRecord({keys.NUM_EXAMPLES: 10, keys.EVAL_ACC: float("nan")})
            return Message(RecordDict({keys.METRICS: metrics}), reply_to=message), 0.0
        return node(1.0, seconds=1.0)(message)

    grid = FakeGrid({1: node(1.0, seconds=1.0, evaluate_acc=0.25), 2: bad_eval})
    result = RuntimeWeightedFedAvg().start(grid, weights(), num_rounds=1)
    assert result.evaluate_metrics_clientapp[1][keys.EVAL_ACC] == pytest.approx(0.25)


def cast_fleet(dtype: type) -> FakeGrid:
    """Nodes 1 and 2 answer x+1 and x+3 (10 examples each) with arrays of ``dtype``."""

    def answering(shift: float, seconds: float):  # type: ignore[no-untyped-def]
        def run(message: Message) -> tuple[Message, float]:
            x: dict[str, np.ndarray] = {
                k: (v + shift).astype(dtype) for k, v in received(message).items()
            }
            return reply(message, x, num_examples=10, train_time_s=seconds), seconds

        return run

    return FakeGrid({1: answering(1.0, 1.0), 2: answering(3.0, 2.0)})


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_float64_replies_to_a_float32_model_are_averaged_every_round(name: str) -> None:
    # Issue 16: such replies were all rejected ("dtype float64, expected float32"),
    # every node quarantined after 3 rounds, the run ended with the initial model.
    strategy = STRATEGIES[name]()
    result = strategy.start(cast_fleet(np.float64), weights(), num_rounds=4)
    same = STRATEGIES[name]().start(cast_fleet(np.float32), weights(), num_rounds=4)
    got = result.arrays["w"].numpy()
    assert got.dtype == np.float32
    assert got == pytest.approx(same.arrays["w"].numpy(), rel=1e-6)
    assert sorted(result.train_metrics_clientapp) == [1, 2, 3, 4]
    assert strategy.quarantine.until == {}
    if name != "fedbuff":  # synchronous: x += (1 + 3) / 2 each round
        assert float(got[0]) == pytest.approx(8.0)
