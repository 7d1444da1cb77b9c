"""flowerbed.arrays.encode_array makes the bytes Flower's own Array(ndarray) makes."""

from __future__ import annotations

import numpy as np
import pytest
from flowerbed.arrays import encode_array
from flwr.app import Array


@pytest.mark.parametrize(
    "value",
    [
        np.zeros((), np.float32),
        np.arange(6, dtype=np.int64).reshape(2, 3),
        np.ones((0, 4), np.float16),
        np.array([True, False]),
        np.linspace(0, 1, 2400, dtype=np.float32).reshape(16, 6, 5, 5),
        np.arange(12, dtype=np.float64).reshape(3, 4).T,  # Fortran order
        np.arange(20, dtype=np.float32)[::2],  # not contiguous
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
