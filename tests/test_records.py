"""Records filled at once equal Flower's records built item by item."""

from __future__ import annotations

import numpy as np
import pytest
from flowerbed.records import filled
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict


def test_filled_records_equal_the_ones_flower_builds() -> None:
    metrics = {"num-examples": 160, "train-loss": 0.25, "partition-id": 3}
    arrays = {"w": Array(np.ones((2, 3), np.float32)), "b": Array(np.zeros(3))}
    assert filled(MetricRecord(), metrics) == MetricRecord(metrics)
    assert list(filled(MetricRecord(), metrics)) == list(metrics)  # in order
    assert filled(ArrayRecord(), arrays) == ArrayRecord(arrays)
    content = {"arrays": ArrayRecord(arrays), "metrics": MetricRecord(metrics)}
    content["config"] = ConfigRecord({"lr": 0.1})
    assert filled(RecordDict(), content) == RecordDict(content)


@pytest.mark.parametrize(
    ("record", "items"),
    [
        (MetricRecord(), {"loss": "low"}),  # a metric is a number
        (ArrayRecord(), {"w": np.ones(3)}),  # not encoded as an Array
        (RecordDict(), {"metrics": {"loss": 0.5}}),  # not a record
        (MetricRecord(), {3: 0.5}),  # keys are strings
        (MetricRecord({"loss": 0.5}), {"acc": 0.9}),  # not a new record
    ],
)
def test_filled_refuses_what_flower_would_refuse(record: object, items: dict) -> None:
    with pytest.raises(TypeError):
        filled(record, items)  # type: ignore[type-var]
