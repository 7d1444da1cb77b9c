"""flowerbed.arrays.encode_array makes the bytes Flower's own Array(ndarray) makes,
and its arrays read back without np.load, yet behave as Flower's."""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np
import pytest
from flowerbed.arrays import (
    EncodedArray,
    decode_array,
    encode_array,
    encode_record,
    encode_records,
    torch_state_dict,
)
from flwr.app import Array, ArrayRecord
from flwr.supercore.inflatable.inflatable_object import (
    get_object_type_from_object_content,
)

KINDS = [
    np.zeros((), np.float32),
    np.arange(6, dtype=np.int64).reshape(2, 3),
    np.ones((0, 4), np.float16),
    np.array([True, False]),
    np.arange(12, dtype=np.float64).reshape(3, 4).T,  # Fortran order
]
"""Arrays of several dtypes and shapes (a scalar, an empty one, a transposed one)."""


@pytest.mark.parametrize(
    "value",
    [
        *KINDS,
        np.linspace(0, 1, 2400, dtype=np.float32).reshape(16, 6, 5, 5),
        np.arange(20, dtype=np.float32)[::2],  # not contiguous
        np.arange(4, dtype=">f4"),  # big-endian: its bytes as they are
    ],
)
def test_encode_array_makes_the_same_array_as_flower(value: np.ndarray) -> None:
    expected = Array(value)
    for _ in range(2):  # the second time from the cached header
        got = encode_array(value)
        assert (got.dtype, got.shape, got.stype, got.data) == (
            expected.dtype,
            expected.shape,
            expected.stype,
            expected.data,
        )
    assert np.array_equal(encode_array(value).numpy(), value)


def test_numpy_reads_the_elements_without_np_load_and_returns_a_fresh_copy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    value = np.arange(6, dtype=np.float32).reshape(2, 3)
    array = encode_array(value)
    assert isinstance(array, EncodedArray)
    monkeypatch.setattr(np, "load", lambda *a, **k: pytest.fail("np.load called"))
    first, second = array.numpy(), array.numpy()
    assert first.dtype == np.float32 and first.shape == (2, 3)
    assert np.array_equal(first, value)
    first[0, 0] = 99.0  # writable, and its own: as np.load's result
    assert second[0, 0] == 0.0 and array.numpy()[0, 0] == 0.0


def test_setting_a_field_drops_the_shortcut() -> None:
    array = encode_array(np.zeros(3, np.float32))
    array.data = Array(np.array([[1, 2], [3, 4]], np.int64)).data
    array.dtype, array.shape = "int64", (2, 2)
    assert np.array_equal(array.numpy(), [[1, 2], [3, 4]])


def test_it_serialises_and_pickles_as_flowers_array() -> None:
    value = np.linspace(0, 1, 12, dtype=np.float32).reshape(3, 4)
    ours, flowers = encode_array(value), Array(value)
    assert ours == flowers and flowers == ours and ours != Array(value + 1)
    assert ArrayRecord({"a": flowers}) == encode_record({"a": value})
    assert ours.deflate() == flowers.deflate()
    assert ours.object_id == flowers.object_id
    assert get_object_type_from_object_content(ours.deflate()) == "Array"
    back = pickle.loads(pickle.dumps(ours))
    assert isinstance(back, EncodedArray)
    assert back.data == flowers.data and np.array_equal(back.numpy(), value)


def test_encode_record_keeps_the_arrays_and_their_order() -> None:
    arrays = {"w": np.ones((2, 2), np.float32), "b": np.zeros(2, np.float64)}
    record = encode_record(arrays)
    assert isinstance(record, ArrayRecord) and list(record) == ["w", "b"]
    assert all(isinstance(a, EncodedArray) for a in record.values())
    assert [a.data for a in record.values()] == [Array(v).data for v in arrays.values()]
    # ArrayRecord(dict) would have rebuilt them as plain Arrays
    assert type(ArrayRecord(dict(record))["w"]) is Array


def test_encode_records_makes_each_rows_record_as_encode_record() -> None:
    stacked = np.arange(3 * 2 * 4, dtype=np.float32).reshape(3, 2, 4)
    rows: list[dict[str, Any]] = [
        {"w": stacked[i], "b": np.full(2, i, np.float64)} for i in range(3)
    ]
    # rows that differ from the first: another shape, dtype, order, a list
    rows.append({"w": stacked[0, :, :3], "b": np.arange(2, dtype=np.int32)})
    rows.append({"w": stacked[1].T, "b": [1.0, 2.0]})
    records = encode_records(rows)
    assert len(records) == len(rows)
    for row, record in zip(rows, records, strict=True):
        expected = encode_record(row)
        assert list(record) == ["w", "b"] and record == expected
        for name, value in row.items():
            assert record[name].data == Array(np.asarray(value)).data
            assert np.array_equal(record[name].numpy(), value)


@pytest.mark.parametrize("value", [*KINDS, np.arange(5, dtype=">i4")])  # big-endian
def test_decode_array_reads_flowers_arrays_as_numpy_does(
    value: np.ndarray, monkeypatch: pytest.MonkeyPatch
) -> None:
    array = Array(value)
    expected = array.numpy()
    monkeypatch.setattr(np, "load", _no_np_load)
    got = decode_array(array)
    assert got.dtype == expected.dtype and got.shape == expected.shape
    assert np.array_equal(got, expected)
    assert got.flags.c_contiguous == expected.flags.c_contiguous
    got[...] = 1  # a fresh, writable copy: the message keeps its bytes
    assert np.array_equal(decode_array(array), expected)


def test_decode_array_leaves_other_forms_to_flower() -> None:
    odd = Array(dtype="float32", shape=(2,), stype="other", data=b"12345678")
    with pytest.raises(TypeError, match="Unsupported serialization type"):
        decode_array(odd)


def test_torch_state_dict_is_flowers_in_order() -> None:
    record = ArrayRecord()
    record["b"] = Array(np.arange(3, dtype=np.float32))
    record["a"] = encode_array(np.ones((2, 2), np.float32))
    expected = record.to_torch_state_dict()
    got = torch_state_dict(record)
    assert list(got) == ["b", "a"]
    for name in expected:
        assert got[name].dtype == expected[name].dtype
        assert got[name].tolist() == expected[name].tolist()


def _no_np_load(*args: object, **kwargs: object) -> None:
    raise AssertionError("np.load called")
