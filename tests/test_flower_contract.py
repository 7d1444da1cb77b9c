"""Flower's own FedAvg tests, ported to the Message API, run against every strategy.

A permanent guard of "replace ``FedAvg(...)`` and nothing else changes". The logic
of each test is Flower's (flwr 1.41 sources, Apache-2.0):

- ``flwr/serverapp/strategy/fedavgm_test.py``: FedAvgM with momentum ~0 and
  server learning rate ~1 is FedAvg; all three tests;
- ``flwr/serverapp/strategy/strategy_utils_test.py``: weighted averaging of
  ArrayRecords (also 0-d arrays) and MetricRecords, and reply consistency;
- ``flwr/server/strategy/fedavg_test.py`` (the pre-Message-API FedAvg): how many
  nodes train and evaluate out of those connected, and that aggregation equals
  the reference FedAvg's.

Edits to Flower's tests, each kept as small as the Message API allows:

1. The strategy under test comes from ``STRATEGIES`` (each flowerbed strategy
   with FedAvg's defaults) instead of ``FedAvgM()``/``FedAvg()``; FedAvgM's
   constructor arguments become the same attribute assignments Flower's first
   two tests already make (no-ops for strategies without them, except
   ``FedBuff.server_learning_rate``, which is its eta_g).
2. ``strategy.current_arrays = ...`` (FedAvgM's server model) has no public
   counterpart: a Message-API strategy learns the global model from
   ``configure_train``. The FedAvgM tests therefore run twice: without any
   model (``aggregate_train`` called on its own, as Flower calls it) and after
   ``configure_train`` with Flower's initial arrays.
3. Utility tests that called ``aggregate_arrayrecords``/``aggregate_metricrecords``
   on RecordDicts call the strategy's ``aggregate_train`` on replies carrying
   those RecordDicts, with ``weighted_by_key="weight"``. Exact ``object_id``
   equality of averaged arrays becomes ``allclose``: a streaming sum divides
   once at the end, so the last bit may differ (metrics keep ``object_id``).
4. Consistency tests: Flower's ``validate_message_reply_consistency`` raises
   ``InconsistentMessageReplies``, which ends the ServerApp. flowerbed rejects
   an inconsistent reply on its own and keeps the rest (the documented
   difference, docs/strategies/index.md), so "raises" becomes "does not raise,
   and averages exactly the replies that are usable and agree with the first".
   A record's name (``global-model`` vs ``model``) is not part of the model.
5. The count tests call ``num_fit_clients(N)``/``num_evaluation_clients(N)``,
   which the Message API replaced by sampling inside ``configure_*``: they count
   the messages ``configure_train``/``configure_evaluate`` build on a grid of
   ``N`` connected nodes.
6. The in-place equivalence test compares against Flower's own ``FedAvg``
   instead of ``FedAvg(inplace=False)``.
"""

from __future__ import annotations

from collections.abc import Callable
from unittest.mock import Mock

import numpy as np
import pytest
from flowerbed.strategies import (
    ClusterSelection,
    DeadlineFedAvg,
    FedBuff,
    RuntimeWeightedFedAvg,
)
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Message,
    MetricRecord,
    RecordDict,
)
from flwr.serverapp.strategy import FedAvg, Strategy
from numpy.testing import assert_allclose
from test_strategies_fakes import FakeGrid, node

STRATEGIES: dict[str, Callable[..., Strategy]] = {
    "RuntimeWeightedFedAvg": RuntimeWeightedFedAvg,
    "DeadlineFedAvg": DeadlineFedAvg,
    "FedBuff": FedBuff,
    "ClusterSelection": lambda **kw: ClusterSelection(
        strategy=RuntimeWeightedFedAvg(**kw)
    ),
}
"""Each flowerbed strategy with FedAvg's defaults (and FedAvg's keyword args)."""


def create_mock_reply(arrays: ArrayRecord, num_examples: float) -> Message:
    """Flower's helper, unchanged: a Mock Message with the default record names."""
    message = Mock(spec=Message)
    message.content = RecordDict(
        {"arrays": arrays, "metrics": MetricRecord({"num-examples": num_examples})}
    )
    message.has_error.side_effect = lambda: False
    message.has_content.side_effect = lambda: True
    return message


def reply_of(record: RecordDict) -> Message:
    """A Mock reply carrying ``record`` (edit 3)."""
    message = Mock(spec=Message)
    message.content = record
    message.has_error.side_effect = lambda: False
    message.has_content.side_effect = lambda: True
    return message


def tell_model(strategy: Strategy, arrays: list[np.ndarray]) -> None:
    """Edit 2: the Message-API way a strategy learns the current global model."""
    grid = FakeGrid({1: node(0.0, seconds=1.0), 2: node(0.0, seconds=1.0)})
    list(strategy.configure_train(1, ArrayRecord(arrays), ConfigRecord(), grid))


# -- fedavgm_test.py ---------------------------------------------------------------


def _prepare_strategy(
    name: str, known_model: bool
) -> tuple[Strategy, list[Message], list[np.ndarray]]:
    weights0_0 = np.array([[1, 2, 3], [4, 5, 6]], dtype=np.float32)
    weights0_1 = np.array([7, 8, 9, 10], dtype=np.float32)
    weights1_0 = np.array([[29, 23, 19], [17, 13, 11]], dtype=np.float32)
    weights1_1 = np.array([7, 5, 3, 2], dtype=np.float32)
    replies = [
        create_mock_reply(ArrayRecord([weights0_0, weights0_1]), num_examples=1),
        create_mock_reply(ArrayRecord([weights1_0, weights1_1]), num_examples=2),
    ]
    expected = [
        (weights0_0 * 1 + weights1_0 * 2) / 3,
        (weights0_1 * 1 + weights1_1 * 2) / 3,
    ]
    initial_weights = [
        np.array([[0, 0, 0], [0, 0, 0]], dtype=np.float32),
        np.array([0, 0, 0, 0], dtype=np.float32),
    ]
    strategy = STRATEGIES[name]()
    if known_model:
        tell_model(strategy, initial_weights)
    return strategy, replies, expected


@pytest.mark.parametrize(
    ("momentum", "rounds"),
    [(None, 1), (1e-9, 2)],
    ids=[
        "using_near_one_server_lr_and_no_momentum",
        "server_learning_rate_and_momentum",
    ],
)
@pytest.mark.parametrize("known_model", [False, True])
@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_aggregate_fit(
    name: str, known_model: bool, momentum: float | None, rounds: int
) -> None:
    """Flower's first two FedAvgM tests: server learning rate ~1, without momentum
    (one round) and with momentum ~0 (two rounds), aggregate as FedAvg does."""
    strategy, replies, expected = _prepare_strategy(name, known_model)
    strategy.server_learning_rate = 1.0 + 1e-9  # type: ignore[attr-defined]
    if momentum is not None:
        strategy.server_momentum = momentum  # type: ignore[attr-defined]

    actual = None
    for server_round in range(1, rounds + 1):
        actual, _ = strategy.aggregate_train(server_round, replies)

    assert actual is not None
    for w_act, w_exp in zip(actual.to_numpy_ndarrays(), expected, strict=True):
        np.testing.assert_almost_equal(w_act, w_exp, decimal=5)


@pytest.mark.parametrize("known_model", [False, True])
@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_aggregate_fit_with_scalar_weights(name: str, known_model: bool) -> None:
    strategy = STRATEGIES[name]()
    strategy.server_learning_rate = 1.0 + 1e-9  # type: ignore[attr-defined]
    if known_model:
        tell_model(strategy, [np.array(0.0)])
    replies = [
        create_mock_reply(ArrayRecord([np.array(1.0)]), num_examples=1),
        create_mock_reply(ArrayRecord([np.array(3.0)]), num_examples=2),
    ]

    actual, _ = strategy.aggregate_train(1, replies)

    assert actual is not None
    scalar_weight = actual.to_numpy_ndarrays()[0]
    assert scalar_weight.shape == ()
    np.testing.assert_allclose(scalar_weight, np.array(7.0 / 3.0), rtol=1e-6)


# -- strategy_utils_test.py --------------------------------------------------------


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_arrayrecords_aggregation(name: str) -> None:
    num_replies = 3
    num_arrays = 4
    weights = [0.25, 0.4, 0.35]
    np_arrays = [
        [np.random.randn(7, 3) for _ in range(num_arrays)] for _ in range(num_replies)
    ]
    avg_list = [
        np.average([lst[i] for lst in np_arrays], axis=0, weights=weights)
        for i in range(num_arrays)
    ]
    records = [
        RecordDict(
            {
                "arrays": ArrayRecord(np_arrays[i]),
                "metrics": MetricRecord({"weight": weights[i]}),
            }
        )
        for i in range(num_replies)
    ]

    aggrd, _ = STRATEGIES[name](weighted_by_key="weight").aggregate_train(
        1, [reply_of(r) for r in records]
    )

    assert aggrd is not None
    assert all(
        np.allclose(a, b)
        for a, b in zip(aggrd.to_numpy_ndarrays(), avg_list, strict=True)
    )


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_arrayrecords_aggregation_with_ndim_zero(name: str) -> None:
    num_replies = 3
    weights = [0.25, 0.4, 0.35]
    np_arrays = [np.array(np.random.randn()) for _ in range(num_replies)]
    avg_list = [np.average(np_arrays, axis=0, weights=weights)]
    records = [
        RecordDict(
            {
                "arrays": ArrayRecord([np_arrays[i]]),
                "metrics": MetricRecord({"weight": weights[i]}),
            }
        )
        for i in range(num_replies)
    ]

    aggrd, _ = STRATEGIES[name](weighted_by_key="weight").aggregate_train(
        1, [reply_of(r) for r in records]
    )

    assert aggrd is not None
    assert np.isclose(aggrd.to_numpy_ndarrays()[0], avg_list[0])
    assert aggrd.to_numpy_ndarrays()[0].shape == ()


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_metricrecords_aggregation(name: str) -> None:
    num_replies = 3
    weights = [0.25, 0.4, 0.35]
    metric_records = [
        MetricRecord({"a": 1, "b": 2.0, "c": np.random.randn(3).tolist()})
        for _ in range(num_replies)
    ]
    as_np_entries = [
        {
            k: np.array(v) if isinstance(v, (int | float | list)) else v
            for k, v in record.items()
        }
        for record in metric_records
    ]
    avg_list = [
        np.average(
            [list(entries.values())[i] for entries in as_np_entries],
            axis=0,
            weights=weights,
        ).tolist()
        for i in range(len(as_np_entries[0]))
    ]
    expected_record = MetricRecord(
        dict(zip(as_np_entries[0].keys(), avg_list, strict=True))
    )
    expected_record["a"] = float(expected_record["a"])  # type: ignore[arg-type]
    expected_record["b"] = float(expected_record["b"])  # type: ignore[arg-type]
    records = [
        RecordDict(
            {
                "arrays": ArrayRecord([np.zeros(2)]),
                "metrics": MetricRecord(dict(record) | {"weight": weights[i]}),
            }
        )
        for i, record in enumerate(metric_records)
    ]

    _, aggrd = STRATEGIES[name](weighted_by_key="weight").aggregate_train(
        1, [reply_of(r) for r in records]
    )

    assert aggrd is not None
    assert expected_record.object_id == aggrd.object_id


def _reply_content(
    *,
    record: str = "global-model",
    array: str | None = None,
    metrics: str = "metrics",
    weight: str = "weight",
) -> RecordDict:
    """A reply's content: a random 7x3 model in the ArrayRecord ``record`` (its one
    array named ``array``, or unnamed) and ``weight`` = 0.123 in the MetricRecord
    ``metrics``."""
    model = np.random.randn(7, 3)
    arrays = (
        ArrayRecord([model]) if array is None else ArrayRecord({array: Array(model)})
    )
    return RecordDict({record: arrays, metrics: MetricRecord({weight: 0.123})})


BAD_RECORDS = {
    "weighting key is not a scalar": RecordDict(
        {
            "global-model": ArrayRecord([np.random.randn(7, 3)]),
            "metrics": MetricRecord({"weight": [0.123]}),
        }
    ),
    "no weighting key": RecordDict(
        {
            "global-model": ArrayRecord([np.random.randn(7, 3)]),
            "metrics": MetricRecord({"loss": 0.01}),
        }
    ),
    "no MetricRecord": RecordDict(
        {"global-model": ArrayRecord([np.random.randn(7, 3)])}
    ),
    "two ArrayRecords": RecordDict(
        {
            "global-model": ArrayRecord([np.random.randn(7, 3)]),
            "another-model": ArrayRecord([np.random.randn(7, 3)]),
        }
    ),
    "two MetricRecords": RecordDict(
        {
            "global-model": ArrayRecord([np.random.randn(7, 3)]),
            "metrics": MetricRecord({"weight": 0.123}),
            "more-metrics": MetricRecord({"loss": 0.321}),
        }
    ),
}


@pytest.mark.parametrize("case", ["compliant", *sorted(BAD_RECORDS)])
@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_consistency_of_replies_with_matching_keys(name: str, case: str) -> None:
    recorddict = BAD_RECORDS.get(case) or _reply_content()
    replies = [reply_of(recorddict) for _ in range(3)]

    arrays, _ = STRATEGIES[name](weighted_by_key="weight").aggregate_train(1, replies)

    if case in BAD_RECORDS:
        assert arrays is None  # every reply rejected, none raised (edit 4)
    else:
        assert arrays is not None
        (only,) = recorddict.array_records.values()
        assert_allclose(arrays.to_numpy_ndarrays()[0], only.to_numpy_ndarrays()[0])


DIFFERENT_KEYS: dict[str, tuple[list[RecordDict], int]] = {
    # top-level keys differ for ArrayRecords: a record's name is not the model's
    "array record names": ([_reply_content(), _reply_content(record="model")], 2),
    # the arrays inside differ: the second is not the first's model
    "array names": ([_reply_content(array="a"), _reply_content(array="b")], 1),
    # top-level keys differ for MetricRecords: names again
    "metric record names": (
        [_reply_content(), _reply_content(metrics="my-metrics")],
        2,
    ),
    # the weighting key is missing from the second
    "metric names": (
        [_reply_content(), _reply_content(metrics="my-metrics", weight="my-weights")],
        1,
    ),
}


@pytest.mark.parametrize("case", sorted(DIFFERENT_KEYS))
@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_consistency_of_replies_with_different_keys(name: str, case: str) -> None:
    list_records, usable = DIFFERENT_KEYS[case]

    arrays, _ = STRATEGIES[name](weighted_by_key="weight").aggregate_train(
        1, [reply_of(r) for r in list_records]
    )

    assert arrays is not None
    kept = [next(iter(r.array_records.values())) for r in list_records[:usable]]
    expected = np.mean([k.to_numpy_ndarrays()[0] for k in kept], axis=0)
    assert_allclose(arrays.to_numpy_ndarrays()[0], expected)


# -- server/strategy/fedavg_test.py (counts and aggregation) -----------------------


def grid_of(n: int) -> FakeGrid:
    return FakeGrid({i: node(0.0, seconds=1.0) for i in range(1, n + 1)})


@pytest.mark.parametrize(
    ("available", "expected"), [(20, 20), (19, 19), (10, 10), (9, 9)]
)
@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_fedavg_num_fit_clients(name: str, available: int, expected: int) -> None:
    strategy = STRATEGIES[name]()
    messages = strategy.configure_train(
        1, ArrayRecord([np.zeros(2)]), ConfigRecord(), grid_of(available)
    )
    assert len(list(messages)) == expected


@pytest.mark.parametrize(
    ("available", "expected"), [(40, 2), (39, 2), (20, 2), (19, 2)]
)
@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_fedavg_num_evaluation_clients(
    name: str, available: int, expected: int
) -> None:
    strategy = STRATEGIES[name](fraction_evaluate=0.05)
    messages = strategy.configure_evaluate(
        1, ArrayRecord([np.zeros(2)]), ConfigRecord(), grid_of(available)
    )
    assert len(list(messages)) == expected


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_inplace_aggregate_fit_equivalence(name: str) -> None:
    weights0_0 = np.random.randn(100, 64)
    weights0_1 = np.random.randn(314, 628, 3)
    weights1_0 = np.random.randn(100, 64)
    weights1_1 = np.random.randn(314, 628, 3)
    replies = [
        create_mock_reply(ArrayRecord([weights0_0, weights0_1]), num_examples=1),
        create_mock_reply(ArrayRecord([weights1_0, weights1_1]), num_examples=5),
    ]

    reference, _ = FedAvg().aggregate_train(1, replies)
    assert reference
    ours, _ = STRATEGIES[name]().aggregate_train(1, replies)
    assert ours

    for ref, got in zip(
        reference.to_numpy_ndarrays(), ours.to_numpy_ndarrays(), strict=True
    ):
        assert_allclose(ref, got)
