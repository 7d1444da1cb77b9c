"""Flower ``Array`` encoding without ``np.save``'s per-call work.

Simulated nodes answer every train task with their weights, and strategies
encode every new global model: both make many small ``Array`` objects of the
same few shapes, where ``np.save``'s header formatting costs more than copying
the elements (measured: 29 us against 10 us for a LeNet convolution's weights).
"""

from __future__ import annotations

import functools

import numpy as np
from flwr.app import Array
from flwr.common.constant import SType


def encode_array(value: np.ndarray) -> Array:
    """``Array(value)``, the same bytes, made faster.

    Flower encodes an ``Array`` as ``np.save`` does (an ``.npy`` header, then
    the elements in C order); the header depends only on the dtype and shape,
    so it is made once per (dtype, shape) and the elements are appended. Only
    C-contiguous arrays take this path; others go through ``Array(value)``.
    """
    value = np.asarray(value)
    if not value.flags.c_contiguous or value.dtype.hasobject:
        return Array(value)
    dtype, header = _npy_header(value.dtype, value.shape)
    return Array(
        dtype=dtype, shape=value.shape, stype=SType.NUMPY, data=header + value.tobytes()
    )


@functools.lru_cache(maxsize=1024)
def _npy_header(dtype: np.dtype, shape: tuple[int, ...]) -> tuple[str, bytes]:
    """(Flower's dtype name, the ``.npy`` header ``np.save`` writes) for arrays
    of this dtype and shape."""
    sample = np.zeros(shape, dtype)
    data = Array(sample).data
    return str(dtype), data[: len(data) - sample.nbytes]
