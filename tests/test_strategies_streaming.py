"""Streaming aggregation: replies are folded in one at a time, never held together."""

from __future__ import annotations

import tracemalloc
from collections.abc import Iterator

import numpy as np
import pytest
from flowerbed.arrays import array_view
from flowerbed.replies import ReplyRejected
from flowerbed.strategies import RuntimeWeightedFedAvg, fold_kernel
from flowerbed.strategies.accumulation import (
    FOLD_CHUNK,
    Update,
    UpdateAccumulator,
    to_arrayrecord,
)
from flowerbed.strategies.robust import MIN_REFERENCE
from flwr.app import Array, Message
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


def test_float32_sum_matches_a_float64_reference_to_float32_rounding() -> None:
    # 138 updates of 1e-3 of the weights, over more than one fold chunk, with
    # uneven weights: the float32 running sum of *updates* must agree with a
    # float64 computation to within float32's own resolution.
    rng = np.random.default_rng(1)
    size = 2 * FOLD_CHUNK + 7
    base = {"w": rng.standard_normal(size).astype(np.float32)}
    acc = UpdateAccumulator()
    reference = np.zeros(size, np.float64)
    weights = rng.uniform(1, 100, 138)
    for weight in weights:
        delta = (1e-3 * rng.standard_normal(size)).astype(np.float32)
        x = base["w"] + delta
        acc.add({"w": x}, base, float(weight))
        reference += weight * (x.astype(np.float64) - base["w"])
    expected = base["w"] + reference / weights.sum()
    got = acc.result(base)["w"]
    assert got.dtype == np.float32
    # One rounding of the float32 result, plus (for weights near 0, whose ulp is
    # finer than an update's) one float32 rounding of an update's size.
    tolerance = np.spacing(np.abs(expected).astype(np.float32)) + np.spacing(
        np.float32(1e-3)
    )
    assert np.all(np.abs(got - expected) <= tolerance)


def test_add_returns_the_update_norm_and_max_norm_clips_it() -> None:
    base = {"w": np.zeros(2, np.float32), "n": np.array([10], np.int64)}
    acc = UpdateAccumulator()
    # ||(3, 4)|| = 5; the integer counter is not part of the norm
    assert (
        acc.add({"w": np.array([3, 4], np.float32), "n": np.array([11])}, base, 1.0)
        == 5.0
    )
    clipped = UpdateAccumulator()
    norm = clipped.add(
        {"w": np.array([3, 4], np.float32), "n": np.array([11])},
        base,
        2.0,
        max_norm=1.0,
    )
    assert norm == 5.0
    # scaled by 1/5 to norm 1: (0.6, 0.8); the counter is not clipped
    out = clipped.result(base)
    assert np.allclose(out["w"], [0.6, 0.8]) and out["n"].tolist() == [11]
    # an update within the bound is untouched
    within = UpdateAccumulator()
    within.add(
        {"w": np.array([0.3, 0.4], np.float32)}, {"w": base["w"]}, 1.0, max_norm=1
    )
    assert np.allclose(within.result({"w": base["w"]})["w"], [0.3, 0.4])


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_non_finite_update_is_rejected_and_leaves_the_sum_unchanged(
    bad: float,
) -> None:
    size = 3 * FOLD_CHUNK
    base = {"a": np.zeros(10, np.float32), "b": np.zeros(size, np.float32)}
    acc = UpdateAccumulator()
    acc.add({"a": np.ones(10, np.float32), "b": np.ones(size, np.float32)}, base, 1.0)
    poisoned = np.full(size, 5.0, np.float32)
    poisoned[2 * FOLD_CHUNK + 1] = bad  # in the last chunk: two chunks already folded
    with pytest.raises(ReplyRejected, match="array 'b' contains NaN or Inf"):
        acc.add({"a": np.full(10, 7.0, np.float32), "b": poisoned}, base, 3.0)
    assert acc.count == 1 and acc.total_weight == 1.0
    out = acc.result(base)
    assert np.array_equal(out["a"], np.ones(10)) and np.array_equal(
        out["b"], np.ones(size)
    )


def _replies(size: int, count: int, seed: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [
        {
            "w": rng.standard_normal(size).astype(np.float32),
            "n": np.array([10 + i], np.int64),
        }
        for i in range(count)
    ]


@pytest.mark.parametrize("count", [5, 6, 7])
def test_add_many_is_the_same_sum_bit_for_bit_as_adding_one_by_one(
    count: int,
) -> None:
    # 4 + 1, 4 + 2 and 4 + 3: a group of two or three after the first is folded
    # padded to four with the base at factor 0 (exactly nothing added)
    size = 2 * FOLD_CHUNK + 3  # the last chunk is short
    rng = np.random.default_rng(7)
    base = {"w": rng.standard_normal(size).astype(np.float32), "n": np.array([10])}
    replies = _replies(size, count, seed=8)
    weights = [3.0, 0.5, 7.25, 1.0, 2.0, 0.75, 4.5][:count]
    one_by_one = UpdateAccumulator()
    norms = [
        one_by_one.add(r, base, w, scale=0.5, steps=i + 1)
        for i, (r, w) in enumerate(zip(replies, weights, strict=True))
    ]
    together = UpdateAccumulator()
    got = together.add_many(
        [
            Update(r, base, w, scale=0.5, steps=i + 1)
            for i, (r, w) in enumerate(zip(replies, weights, strict=True))
        ]
    )
    # each update's own norm, in order (to float32 summation order: the
    # kernel sums four values' squares together in other vector lanes)
    assert got == pytest.approx(norms, rel=1e-6)
    assert (together.count, together.total_weight, together.weighted_steps) == (
        count,
        sum(weights),
        sum(w * (i + 1) for i, w in enumerate(weights)),
    )
    a, b = one_by_one.result(base), together.result(base)
    assert np.array_equal(a["w"], b["w"]) and np.array_equal(a["n"], b["n"])


def test_add_many_rejects_the_poisoned_reply_alone() -> None:
    size = 3 * FOLD_CHUNK
    base = {"a": np.zeros(10, np.float32), "b": np.zeros(size, np.float32)}
    good = {"a": np.ones(10, np.float32), "b": np.ones(size, np.float32)}
    poisoned = {"a": np.full(10, 7.0, np.float32), "b": np.full(size, 5.0, np.float32)}
    poisoned["b"][2 * FOLD_CHUNK + 1] = np.nan  # two chunks folded before it shows
    other = {"a": np.full(10, 3.0, np.float32), "b": np.full(size, 3.0, np.float32)}
    acc = UpdateAccumulator()
    outcomes = acc.add_many(
        [Update(good, base, 1.0), Update(poisoned, base, 3.0), Update(other, base, 1.0)]
    )
    assert isinstance(outcomes[1], ReplyRejected)
    assert "array 'b' contains NaN or Inf" in outcomes[1].reason
    assert outcomes[0] == pytest.approx(np.sqrt(10 + size))
    assert outcomes[2] == pytest.approx(3 * np.sqrt(10 + size))
    assert (acc.count, acc.total_weight) == (2, 2.0)
    out = acc.result(base)  # (1 + 3) / 2: the poisoned reply left no trace
    assert np.array_equal(out["a"], np.full(10, 2.0)) and np.array_equal(
        out["b"], np.full(size, 2.0)
    )


def test_add_many_clips_and_folds_replies_of_different_bases() -> None:
    base1 = {"w": np.zeros(2, np.float32)}
    base2 = {"w": np.ones(2, np.float32)}
    acc = UpdateAccumulator()
    norms = acc.add_many(
        [
            Update({"w": np.array([3, 4], np.float32)}, base1, 1.0, max_norm=1.0),
            Update({"w": np.array([1.3, 1.4], np.float32)}, base2, 1.0),
        ]
    )
    assert norms == [5.0, pytest.approx(0.5)]
    # (0.6, 0.8) clipped from (3, 4), plus (0.3, 0.4) from base2; averaged
    out = acc.result(base1)["w"]
    assert np.allclose(out, [0.45, 0.6])
    with pytest.raises(ValueError, match="weight must be finite"):
        acc.add_many([Update({"w": np.ones(2, np.float32)}, base1, float("nan"))])
    assert acc.count == 2


def test_an_update_too_large_to_sum_is_rejected() -> None:
    base = {"w": np.zeros(2, np.float32)}
    acc = UpdateAccumulator()
    with pytest.raises(ReplyRejected, match="more than float32 can sum"):
        acc.add({"w": np.array([3e38, 1], np.float32)}, base, 1.0)
    assert acc.count == 0


def test_float64_replies_fold_into_a_float32_model() -> None:
    base = {"w": np.array([1.0, 2.0], np.float32)}
    acc = UpdateAccumulator()
    acc.add({"w": np.array([2.0, 4.0], np.float64)}, base, 1.0)
    acc.add({"w": np.array([1.0, 2.0], np.float64)}, base, 1.0)
    out = acc.result(base)["w"]
    assert out.dtype == np.float32 and out.tolist() == [1.5, 3.0]


def test_array_view_reads_the_bytes_in_place() -> None:
    matrix = np.arange(12, dtype=np.float32).reshape(3, 4)
    array = Array(matrix)
    view = array_view(array)
    assert np.array_equal(view, matrix) and view.dtype == np.float32
    assert not view.flags.writeable and not view.flags.owndata  # no copy
    fortran = array_view(Array(np.asfortranarray(matrix)))
    assert np.array_equal(fortran, matrix)
    big_endian = array_view(Array(matrix.astype(">f8")))
    assert np.array_equal(big_endian, matrix)


def test_array_view_refuses_bytes_shorter_than_their_header_says() -> None:
    array = Array(np.zeros(100, np.float32))
    array.data = array.data[:-4]
    with pytest.raises(ValueError):
        array_view(array)


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

    # The fold kernel's one-off compilation (or load from numba's disk cache)
    # allocates Python memory: do it before counting, as for a running server.
    small = np.ones(8, np.float32)
    UpdateAccumulator().add({"w": array_view(Array(small))}, {"w": small * 0}, 1.0)
    model_bytes = MODEL_FLOATS * 4
    tracemalloc.start()
    try:
        arrays, _ = strategy.aggregate_train(1, replies())
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert arrays is not None
    assert float(arrays["w"].numpy()[0]) == pytest.approx((REPLIES - 1) / 2)
    # Holding every reply would need REPLIES models; streaming needs a handful:
    # the running sum, the reply being built (its array and serialised bytes,
    # read in place, not decoded), the result and its encoding; and, once per
    # run, the first MIN_REFERENCE replies, held until the influence bound has
    # its reference (flowerbed.strategies.robust).
    assert peak < (6 + MIN_REFERENCE) * model_bytes < REPLIES * model_bytes


def _config():  # type: ignore[no-untyped-def]
    from flwr.app import ConfigRecord

    return ConfigRecord()


@pytest.fixture
def numpy_fold(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fold with the NumPy fallback, as where numba is not installed."""
    monkeypatch.setattr(fold_kernel, "_built", [None])


def _fold_all(
    replies: list[dict[str, np.ndarray]], base: dict[str, np.ndarray]
) -> tuple[UpdateAccumulator, list[float | ReplyRejected]]:
    acc = UpdateAccumulator()
    outcomes: list[float | ReplyRejected] = []
    for i, r in enumerate(replies):
        try:
            outcomes.append(acc.add(r, base, 1.0 + 0.37 * i, scale=0.9))
        except ReplyRejected as err:
            outcomes.append(err)
    outcomes += acc.add_many([Update(r, base, 2.5) for r in replies])
    return acc, outcomes


def test_compiled_fold_equals_the_numpy_fold_bit_for_bit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if fold_kernel.kernel() is None:
        pytest.skip("numba is not installed (or FLOWERBED_NUMBA=0)")
    size = 2 * FOLD_CHUNK + 5
    rng = np.random.default_rng(3)
    base = {"w": rng.standard_normal(size).astype(np.float32), "n": np.array([4])}
    replies = _replies(size, 4, seed=4)
    replies[2]["w"][FOLD_CHUNK + 9] = np.inf  # rejected after one chunk is folded
    compiled, compiled_out = _fold_all(replies, base)
    monkeypatch.setattr(fold_kernel, "_built", [None])
    fallback, fallback_out = _fold_all(replies, base)
    # the same rejections; norms equal to float32 summation order (the kernel
    # sums a block's squares in vector lanes, NumPy's dot in its own order)
    for got, expected in zip(compiled_out, fallback_out, strict=True):
        if isinstance(expected, ReplyRejected):
            assert isinstance(got, ReplyRejected) and got.reason == expected.reason
        else:
            assert got == pytest.approx(expected, rel=1e-5)
    assert [isinstance(o, ReplyRejected) for o in compiled_out] == [
        False, False, True, False
    ] * 2  # fmt: skip
    # the sums: the same operations per element (x - b, times f, plus s), so
    # equal bit for bit where nothing was taken back (the first chunk; the
    # rejected reply's own, which the kernel had partly added in its block,
    # can differ by one rounding of the sum)
    a, b = compiled._sum["w"], fallback._sum["w"]
    assert np.array_equal(a[:FOLD_CHUNK], b[:FOLD_CHUNK])
    assert np.array_equal(compiled._sum["n"], fallback._sum["n"])
    # one rounding per take-back (2) of the running sum at its largest (a
    # bound on it: the sum of the updates' sizes times their factors, < 4.5)
    largest = sum(
        4.5 * np.abs(np.nan_to_num(r["w"], posinf=0) - base["w"]) for r in replies
    )
    assert np.all(np.abs(a - b) <= 2 * np.spacing(largest))
    without = [r for i, r in enumerate(replies) if i != 2]
    exact, _ = _fold_all(without, base)
    monkeypatch.setattr(fold_kernel, "_built", [])
    again, _ = _fold_all(without, base)
    assert np.array_equal(exact._sum["w"], again._sum["w"])
    assert compiled.count == fallback.count == 6


@pytest.mark.usefixtures("numpy_fold")
def test_numpy_fallback_rejects_non_finite_and_keeps_the_sum() -> None:
    size = 3 * FOLD_CHUNK
    base = {"b": np.zeros(size, np.float32)}
    acc = UpdateAccumulator()
    acc.add({"b": np.ones(size, np.float32)}, base, 1.0)
    poisoned = np.full(size, 5.0, np.float32)
    poisoned[2 * FOLD_CHUNK + 1] = np.nan
    with pytest.raises(ReplyRejected, match="array 'b' contains NaN or Inf"):
        acc.add({"b": poisoned}, base, 3.0)
    with pytest.raises(ReplyRejected, match="more than float32 can sum"):
        acc.add({"b": np.full(size, 3e38, np.float32)}, base, 1.0)
    assert acc.count == 1
    assert np.array_equal(acc.result(base)["b"], np.ones(size))


def test_compiled_fold_takes_back_a_partly_folded_block() -> None:
    # A NaN inside the kernel's block: the finite elements of that block were
    # added before the block's sum of squares showed the NaN; they are taken
    # back exactly here (integers), before anything else is folded.
    size = fold_kernel.BLOCK + 10
    base = {"w": np.zeros(size, np.float32)}
    acc = UpdateAccumulator()
    acc.add({"w": np.full(size, 2.0, np.float32)}, base, 1.0)
    poisoned = np.full(size, 4.0, np.float32)
    poisoned[fold_kernel.BLOCK - 1] = np.nan  # the first block's last element
    with pytest.raises(ReplyRejected, match="NaN or Inf"):
        acc.add({"w": poisoned}, base, 1.0)
    assert np.array_equal(acc.result(base)["w"], np.full(size, 2.0))


def test_array_view_reuses_a_parsed_header_but_reads_each_payload() -> None:
    first = Array(np.arange(6, dtype=np.float32).reshape(2, 3))
    second = Array(np.full((2, 3), 7.0, np.float32))  # the same header bytes
    assert array_view(first).tolist() == [[0, 1, 2], [3, 4, 5]]
    view = array_view(second)
    assert view.shape == (2, 3) and view.tolist() == [[7.0] * 3] * 2
    assert not view.flags.writeable and not view.flags.owndata
    fortran = np.asfortranarray(np.arange(6, dtype=np.float64).reshape(2, 3))
    assert array_view(Array(fortran)).tolist() == fortran.tolist()


def test_a_rejected_first_update_leaves_no_trace_in_a_sum_never_zeroed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The compiled fold writes a new sum with its first update instead of
    # zeroing it first: when that update (or one in a group) is rejected, the
    # blocks it had not written must still read zero. New memory is made dirty
    # here, as reused memory can be.
    empty = np.empty

    def dirty(*args: object, **kwargs: object) -> np.ndarray:
        out = empty(*args, **kwargs)  # type: ignore[call-overload]
        out.fill(7)
        return out  # type: ignore[no-any-return]

    monkeypatch.setattr(np, "empty", dirty)
    size = 3 * fold_kernel.BLOCK + 5
    base = {"w": np.zeros(size, np.float32)}
    poisoned = np.full(size, 5.0, np.float32)
    poisoned[fold_kernel.BLOCK + 1] = np.nan  # one block written before it
    acc = UpdateAccumulator()
    with pytest.raises(ReplyRejected, match="NaN or Inf"):
        acc.add({"w": poisoned}, base, 1.0)
    acc.add({"w": np.full(size, 2.0, np.float32)}, base, 1.0)
    assert np.array_equal(acc.result(base)["w"], np.full(size, 2.0))
    group = UpdateAccumulator()
    outcomes = group.add_many(
        [
            Update({"w": poisoned}, base, 1.0),
            Update({"w": np.ones(size, np.float32)}, base, 1.0),
        ]
    )
    assert isinstance(outcomes[0], ReplyRejected)
    assert np.array_equal(group.result(base)["w"], np.ones(size))
    four = UpdateAccumulator()  # folded together, element by element
    outcomes = four.add_many(
        [Update({"w": poisoned}, base, 1.0)]
        + [Update({"w": np.full(size, v, np.float32)}, base, 1.0) for v in (1, 2, 3)]
    )
    assert [isinstance(o, ReplyRejected) for o in outcomes] == [True] + [False] * 3
    assert np.array_equal(four.result(base)["w"], np.full(size, 2.0))
    for rejected in (
        [Update({"w": poisoned}, base, 1.0)],
        [Update({"w": poisoned}, base, 1.0)] * 4,
    ):
        nothing = UpdateAccumulator()
        nothing.add_many(rejected)
        assert nothing.count == 0 and np.array_equal(nothing._sum["w"], np.zeros(size))


def test_result_is_made_in_the_sums_memory_and_spends_the_accumulator() -> None:
    base = {"w": np.zeros(4, np.float32)}
    acc = UpdateAccumulator()
    acc.add({"w": np.full(4, 2.0, np.float32)}, base, 1.0)
    sum_memory = acc._sum["w"]
    out = acc.result(base)
    assert np.shares_memory(out["w"], sum_memory) and out["w"].tolist() == [2.0] * 4
    with pytest.raises(RuntimeError, match="new accumulator"):
        acc.add({"w": np.ones(4, np.float32)}, base, 1.0)
    with pytest.raises(RuntimeError, match="new accumulator"):
        acc.result(base)


def test_compiled_result_equals_the_numpy_result_bit_for_bit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if fold_kernel.finisher() is None:
        pytest.skip("numba is not installed (or FLOWERBED_NUMBA=0)")
    rng = np.random.default_rng(5)
    size = FOLD_CHUNK + 11
    base = {"w": rng.standard_normal(size).astype(np.float32)}
    replies = _replies(size, 3, seed=6)

    def result() -> np.ndarray:
        acc = UpdateAccumulator()
        for i, r in enumerate(replies):
            acc.add({"w": r["w"]}, base, 1.0 + i / 3)
        return acc.result(base, step_size=0.7)["w"]

    compiled = result()
    monkeypatch.setattr(fold_kernel, "_built", [None])
    assert np.array_equal(compiled, result())


def test_the_strategy_makes_each_rounds_sums_in_the_last_results_memory() -> None:
    model = to_arrayrecord({"w": np.zeros(8, np.float32)})
    grid = FakeGrid({1: node(1.0, seconds=1.0)})
    strategy = RuntimeWeightedFedAvg(weighting="examples", min_train_nodes=1)
    (template,) = strategy.configure_train(1, model, _config(), grid)
    first, _ = strategy.aggregate_train(
        1, [reply(template, {"w": np.full(8, 2.0, np.float32)}, num_examples=1)]
    )
    memory = strategy.influence_bound.memory.result["w"]
    second, _ = strategy.aggregate_train(
        1, [reply(template, {"w": np.full(8, 4.0, np.float32)}, num_examples=1)]
    )
    assert first is not None and second is not None
    assert np.shares_memory(
        strategy.influence_bound.memory.result["w"], memory
    )  # made there again
    # each round's record is a copy, untouched by the next round's sums
    assert first["w"].numpy().tolist() == [2.0] * 8
    assert second["w"].numpy().tolist() == [4.0] * 8
    given = {"w": np.full(8, 9.0, np.float32)}  # dirty memory: written, not added to
    acc = UpdateAccumulator(given)
    acc.add({"w": np.ones(8, np.float32)}, {"w": np.zeros(8, np.float32)}, 1.0)
    assert np.shares_memory(acc._sum["w"], given["w"])
    assert acc.result({"w": np.zeros(8, np.float32)})["w"].tolist() == [1.0] * 8
