"""Strategies fold replies a group at a time, with the decisions of one at a time.

``aggregate_train`` folds :data:`FOLD_GROUP` replies per pass
(``BoundedSum.add_many``); the weight cap, the clipping and the NaN/Inf rejection
must come out as if the replies had been folded one by one in order
(``BoundedSum.add``, and a subclass overriding ``fold_train_reply``, which gets
the one-at-a-time path).
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
from flowerbed.replies import ReplyRejected
from flowerbed.strategies import (
    DeadlineFedAvg,
    FedBuff,
    RuntimeWeightedFedAvg,
    fold_kernel,
)
from flowerbed.strategies.accumulation import Update, UpdateAccumulator
from flowerbed.strategies.robust import BoundedSum, Reference
from flowerbed.strategies.runtime_weighted import FOLD_GROUP
from flwr.app import Message
from test_strategies_fakes import FakeGrid, node, received, reply, weights

SHAPES = {"a": (7, 5), "b": (33,), "count": (1,)}


def model(rng: np.random.Generator, scale: float = 1.0) -> dict[str, np.ndarray]:
    out = {
        name: (scale * rng.standard_normal(shape)).astype(np.float32)
        for name, shape in SHAPES.items()
        if name != "count"
    }
    out["count"] = np.array([int(rng.integers(0, 100))], np.int64)
    return out


def updates(seed: int, count: int) -> tuple[dict[str, np.ndarray], list[Update]]:
    """A base and ``count`` updates of it: typical ones, a long one with a huge
    weight (capped and clipped), a NaN one and a slightly long one."""
    rng = np.random.default_rng(seed)
    base = model(rng)
    out = []
    for i in range(count):
        size, weight = 1e-2, float(rng.uniform(5, 15))
        if i % 7 == 3:
            size, weight = 1e3, 1e6  # an outlier: capped and clipped
        if i % 7 == 5:
            size = 4e-2  # a little longer than typical: clipped at 3 x?
        step = model(rng, size)
        arrays = {k: base[k] + step[k] for k in base}
        if i % 9 == 6:
            arrays["b"] = arrays["b"].copy()
            arrays["b"][11] = np.nan
        out.append(Update(arrays, base, weight, float(rng.uniform(0.5, 2)), 10.0))
    return base, out


def fold(
    total: BoundedSum, items: list[Update], group: int
) -> list[float | ReplyRejected]:
    outcomes: list[float | ReplyRejected] = []
    for first in range(0, len(items), group):
        outcomes += total.add_many(items[first : first + group])
    return outcomes


@pytest.mark.parametrize("history", [[], [10.0, 10.0, 10.0]])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_group_pass_makes_the_decisions_of_one_update_at_a_time(
    seed: int, history: list[float]
) -> None:
    base, items = updates(seed, 23)

    def bounded() -> BoundedSum:
        norms = [0.02] * len(history)
        return BoundedSum(2.0, 3.0, Reference(history), Reference(norms))

    alone, grouped = bounded(), bounded()
    one = fold(alone, items, 1)
    four = fold(grouped, items, FOLD_GROUP)
    assert [isinstance(o, ReplyRejected) for o in four] == [
        isinstance(o, ReplyRejected) for o in one
    ]
    assert any(isinstance(o, ReplyRejected) for o in one)
    assert [o for o in four if not isinstance(o, ReplyRejected)] == pytest.approx(
        [o for o in one if not isinstance(o, ReplyRejected)], rel=1e-6
    )
    assert (grouped.capped, grouped.clipped) == (alone.capped, alone.clipped)
    assert alone.capped >= 2 and alone.clipped >= 2
    assert list(grouped.weights.values) == list(alone.weights.values)
    assert list(grouped.norms.values) == pytest.approx(list(alone.norms.values))
    assert grouped.sum.total_weight == pytest.approx(alone.sum.total_weight)
    assert grouped.sum.count == alone.sum.count
    new_alone, new_grouped = alone.result(base), grouped.result(base)
    for name in SHAPES:
        # one float32 rounding of the sum's size, divided by the total weight
        np.testing.assert_allclose(
            new_grouped[name], new_alone[name], rtol=1e-6, atol=1e-6
        )


def test_an_outlier_in_a_group_never_enters_the_sum() -> None:
    # Folding +1e6 with a weight of 1e9 and taking it back would leave nothing
    # of the other updates' +1 in float32; the group is folded again instead.
    base = {"w": np.zeros(1, np.float32)}
    total = BoundedSum(2.0, 3.0, Reference([10.0] * 3), Reference([1.0] * 3))
    group = [Update({"w": np.array([1.0], np.float32)}, base, 10.0) for _ in range(3)]
    group.insert(1, Update({"w": np.array([1e6], np.float32)}, base, 1e9))
    total.add_many(group)
    # the outlier counts 20 (2 x median 10), clipped to 3: (3 x 10 + 20 x 3) / 50
    assert total.result(base)["w"][0] == pytest.approx(90 / 50, rel=1e-6)
    assert (total.capped, total.clipped) == (1, 1)


def test_a_group_pass_writes_beside_the_sum_and_the_memory_is_reused() -> None:
    _, items = updates(0, 16)
    items = [u for u in items if np.isfinite(u.arrays["b"]).all() and u.weight < 100]
    total = BoundedSum(None, 1e9, Reference([1.0] * 3), Reference([1.0] * 3))
    total.add_many(items[:4])
    first = {k: v.ctypes.data for k, v in total.sum._sum.items()}
    total.add_many(items[4:8])  # written beside the first sum, which is freed
    second = {k: v.ctypes.data for k, v in total.sum._sum.items()}
    assert set(first) == {"a", "b", "count"}
    assert all(first[k] != second[k] for k in first)
    total.add_many(items[8:12])  # written in the first sum's memory
    assert {k: v.ctypes.data for k, v in total.sum._sum.items()} == first
    assert {k: v.ctypes.data for k, v in total.sum.leftover().items()} == second


def test_a_pass_not_kept_leaves_the_sum_exactly_as_it_was() -> None:
    _, items = updates(3, 9)
    items = [u for u in items if np.isfinite(u.arrays["b"]).all()]
    total = UpdateAccumulator()
    total.add_many(items[:3])
    before = {k: v.copy() for k, v in total._sum.items()}
    seen: list[list[float | ReplyRejected]] = []

    def refuse(outcomes: list[float | ReplyRejected]) -> bool:
        seen.append(outcomes)
        return False

    outcomes = total.add_many(items[3:7], keep=refuse)
    assert seen == [outcomes]
    assert all(isinstance(o, float) and o > 0 for o in outcomes)
    assert total.count == 3
    for name, value in before.items():
        np.testing.assert_array_equal(total._sum[name], value)
    # kept: the same sum as folded in place
    whole = UpdateAccumulator()
    whole.add_many(items[:3])
    whole.add_many(items[3:7])
    total.add_many(items[3:7], keep=lambda outcomes: True)
    assert total.count == whole.count == 7
    for name in before:
        np.testing.assert_array_equal(total._sum[name], whole._sum[name])


class OneAtATime(RuntimeWeightedFedAvg):
    """A user's subclass overriding fold_train_reply: called for every reply."""

    calls = 0

    def fold_train_reply(self, reply, server_round, fold):  # type: ignore[no-untyped-def]
        OneAtATime.calls += 1
        return super().fold_train_reply(reply, server_round, fold)


def fleet() -> FakeGrid:
    """Ten nodes: typical moves, a boosted one, one sending NaN now and then."""

    def nan_sometimes(message: Message) -> tuple[Message | None, float]:
        x = received(message)
        if int(message.metadata.group_id) % 2:
            x = {"w": np.array([np.nan], np.float32)}
        else:
            x = {"w": x["w"] + 2.0}
        return reply(message, x, num_examples=10, train_time_s=1.0), 1.5

    nodes = {n: node(0.1 * n, seconds=1.0 + 0.1 * n) for n in range(1, 9)}
    nodes[9] = node(500.0, seconds=1.2, examples=10_000)
    nodes[10] = nan_sometimes
    return FakeGrid(nodes)


def test_strategies_fold_in_groups_with_the_results_of_one_at_a_time(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    sizes: list[int] = []
    add_many = UpdateAccumulator.add_many

    def spy(self: UpdateAccumulator, items: list[Update], **kwargs: object) -> list:  # type: ignore[type-arg]
        sizes.append(len(items))
        return add_many(self, items, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(UpdateAccumulator, "add_many", spy)
    caplog.set_level(logging.WARNING, logger="flwr")
    grouped = RuntimeWeightedFedAvg(weighting="examples", fraction_evaluate=0.0)
    result = grouped.start(fleet(), weights(), num_rounds=4)
    assert max(sizes) == FOLD_GROUP
    grouped_log = [r.getMessage() for r in caplog.records]
    sizes.clear()
    caplog.clear()
    alone = OneAtATime(weighting="examples", fraction_evaluate=0.0)
    expected = alone.start(fleet(), weights(), num_rounds=4)
    assert set(sizes) == {1}
    assert OneAtATime.calls == 40
    assert [r.getMessage() for r in caplog.records] == grouped_log
    assert any("NaN" in line for line in grouped_log)
    assert float(result.arrays["w"].numpy()[0]) == pytest.approx(
        float(expected.arrays["w"].numpy()[0]), rel=1e-6
    )
    assert result.train_metrics_clientapp == expected.train_metrics_clientapp
    assert grouped.recent_norms.values == pytest.approx(alone.recent_norms.values)
    assert grouped.quarantine.state() == alone.quarantine.state()


@pytest.mark.parametrize("cls", [DeadlineFedAvg, FedBuff])
def test_streaming_loops_learn_a_grouped_reply_is_unusable_when_it_matters(
    cls: type,
) -> None:
    # Node 3's NaN reply arrives second; the loop must not count it as usable
    # while it waits for its group's pass: FedBuff's buffer of 2 fills with
    # nodes 1 and 2, DeadlineFedAvg (wanting 2 of 3, over-selection) waits for
    # node 2 as well.
    def nan(message: Message) -> tuple[Message | None, float]:
        x = {"w": np.array([np.nan], np.float32)}
        return reply(message, x, num_examples=10, train_time_s=1.5), 1.5

    grid = FakeGrid({1: node(1.0, seconds=1.0), 2: node(3.0, seconds=2.0), 3: nan})
    extra = {"buffer_size": 2} if cls is FedBuff else {"deadline_s": 5.0}
    strategy = cls(weighting="examples", fraction_evaluate=0.0, **extra)
    result = strategy.start(grid, weights(), num_rounds=1)
    assert float(result.arrays["w"].numpy()[0]) == pytest.approx(2.0)


@pytest.mark.parametrize("compiled", [True, False])
def test_a_kept_pass_is_the_in_place_fold_bit_for_bit(
    compiled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Written beside the sum (the kernel reading the sum from one array and
    # writing another; NumPy copying it first), a kept pass must be the same
    # sum as folding in place: groups of 4, 3 and 6 over several of the
    # kernel's blocks, one update with NaN in its second block (taken back
    # there and folded no further), dirty memory to write into.
    if not compiled:
        monkeypatch.setattr(fold_kernel, "_built", [None])
    elif fold_kernel.kernel() is None:
        pytest.skip("numba is not installed (or FLOWERBED_NUMBA=0)")
    size = 3 * fold_kernel.BLOCK + 5
    rng = np.random.default_rng(5)
    base = {"w": rng.standard_normal(size).astype(np.float32)}
    items = [
        Update(
            {"w": base["w"] + (1e-2 * rng.standard_normal(size)).astype(np.float32)},
            base,
            float(rng.uniform(1, 3)),
        )
        for _ in range(13)
    ]
    items[5].arrays["w"][fold_kernel.BLOCK + 3] = np.nan
    in_place = UpdateAccumulator()
    beside = UpdateAccumulator(
        {"w": np.full(size, 7.0, np.float32)}, {"w": np.full(size, -3.0, np.float32)}
    )
    for first, stop in ((0, 4), (4, 7), (7, 13)):
        expected = in_place.add_many(items[first:stop])
        got = beside.add_many(items[first:stop], keep=lambda outcomes: True)
        assert [isinstance(o, ReplyRejected) for o in got] == [
            isinstance(o, ReplyRejected) for o in expected
        ]
        assert np.array_equal(beside._sum["w"], in_place._sum["w"])
    assert beside.count == in_place.count == 12
