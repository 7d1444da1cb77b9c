"""Streaming aggregation: replies are folded in one at a time, never held together."""

from __future__ import annotations

import tracemalloc
from collections.abc import Iterator

import numpy as np
import pytest
from flowerbed.strategies import RuntimeWeightedFedAvg
from flowerbed.strategies.utils import UpdateAccumulator, to_arrayrecord
from flwr.app import Message
from test_strategies_fakes import FakeGrid, node, reply

MODEL_FLOATS = 250_000  # 1 MB of float32
REPLIES = 40


def test_accumulator_equals_the_weighted_average() -> None:
    base = {"w": np.zeros(3, np.float32), "n": np.array([10], np.int64)}
    acc = UpdateAccumulator()
    acc.add({"w": np.array([1, 2, 3], np.float32), "n": np.array([12])}, base, 1.0)
    acc.add({"w": np.array([4, 5, 6], np.float32), "n": np.array([15])}, base, 3.0)
    out = acc.result(base)
    # (1*[1,2,3] + 3*[4,5,6]) / 4; integer arrays are rounded: (12 + 45) / 4 = 14.25
    assert np.allclose(out["w"], [3.25, 4.25, 5.25])
    assert out["w"].dtype == np.float32
    assert out["n"].tolist() == [14] and out["n"].dtype == np.int64


def test_peak_memory_stays_at_a_few_models_whatever_the_number_of_replies() -> None:
    model = to_arrayrecord({"w": np.zeros(MODEL_FLOATS, np.float32)})
    grid = FakeGrid({1: node(1.0, seconds=1.0)})
    strategy = RuntimeWeightedFedAvg(weighting="examples", min_train_nodes=1)
    (template,) = strategy.configure_train(1, model, _config(), grid)
    grid.push_messages([template])

    def replies() -> Iterator[Message]:
        for i in range(REPLIES):
            arrays = {"w": np.full(MODEL_FLOATS, float(i), np.float32)}
            yield reply(template, arrays, num_examples=1)

    model_bytes = MODEL_FLOATS * 4
    tracemalloc.start()
    try:
        arrays, _ = strategy.aggregate_train(1, replies())
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert arrays is not None
    assert float(arrays["w"].numpy()[0]) == pytest.approx((REPLIES - 1) / 2)
    # Holding every reply would need REPLIES models; streaming needs a handful
    # (running float64 sum, one decoded reply, its serialised bytes, the result).
    assert peak < 10 * model_bytes < REPLIES * model_bytes


def _config():  # type: ignore[no-untyped-def]
    from flwr.app import ConfigRecord

    return ConfigRecord()
