"""Flower ``Array`` encoding and decoding without ``np.save``/``np.load`` per call.

Simulated nodes answer every train task with their weights, and strategies
encode every new global model: both make many small ``Array`` objects of the
same few shapes, where ``np.save``'s header formatting costs more than copying
the elements (measured: 29 us against 10 us for a LeNet convolution's weights).
Reading them back is the same story: ``Array.numpy()`` parses the ``.npy``
header with ``np.load`` (``ast.literal_eval``, ~30-50 us an array here), which
a strategy such as Flower's FedAvg pays for every array of every reply; the
arrays made here know where their elements start and skip it.
"""

from __future__ import annotations

import functools
import io
import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np
from flowerbed.records import filled
from flwr.app import Array, ArrayRecord
from flwr.common.constant import SType

if TYPE_CHECKING:
    import torch


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
    return _encoded(value, *_npy_header(value.dtype, value.shape))


def _encoded(value: np.ndarray, dtype: str, header: bytes) -> EncodedArray:
    """The :class:`EncodedArray` of a C-contiguous ``value`` whose ``.npy``
    header and Flower dtype name are given."""
    # One copy of the elements (``header + value.tobytes()`` makes two).
    data = b"".join((header, value.data))
    # What Array(dtype=, shape=, stype=, data=) sets (its four fields, through
    # __setattr__, which marks the object dirty), without its argument checks:
    # these are known right; ~4 us of a simulated reply's 10 arrays each.
    array = EncodedArray.__new__(EncodedArray)
    array.__dict__.update(
        _is_dirty=True, dtype=dtype, shape=value.shape, stype=SType.NUMPY, data=data
    )
    array.__dict__[_LAYOUT] = (data, dtype, value.shape, value.dtype, len(header))
    return array


def encode_record(arrays: Mapping[str, np.ndarray]) -> ArrayRecord:
    """``ArrayRecord`` of :func:`encode_array` of each array, in order.

    Not ``ArrayRecord(dict)``, which rebuilds every ``Array`` it is given (as a
    plain ``Array``, losing :class:`EncodedArray`'s shortcut, at the cost of a
    second construction): the arrays are put in at once
    (:func:`flowerbed.records.filled`).
    """
    return filled(
        ArrayRecord(), {name: encode_array(value) for name, value in arrays.items()}
    )


def encode_records(rows: Sequence[Mapping[str, np.ndarray]]) -> list[ArrayRecord]:
    """``[encode_record(row) for row in rows]``, the same records, made faster
    for rows that hold arrays of the same names, dtypes and shapes (a batch of
    nodes' weights): each name's header is looked up once, not once per row.

    An array that differs from the first row's of its name (shape, dtype,
    C order, or not a NumPy array) goes through :func:`encode_array`. Measured
    here for 10 LeNet nodes' weights (10 arrays each): ~210 us, against ~370 us
    for :func:`encode_record` of each node's tensors.
    """
    headers: dict[str, tuple[tuple[int, ...], np.dtype, str, bytes]] = {}
    records = []
    for row in rows:
        arrays: dict[str, Array] = {}
        for name, value in row.items():
            known = headers.get(name)
            if (
                known is not None
                and type(value) is np.ndarray
                and value.shape == known[0]
                and value.dtype is known[1]
                and value.flags.c_contiguous
            ):
                arrays[name] = _encoded(value, known[2], known[3])
                continue
            value = np.asarray(value)
            arrays[name] = encode_array(value)
            if known is None and value.flags.c_contiguous and not value.dtype.hasobject:
                header = _npy_header(value.dtype, value.shape)
                headers[name] = (value.shape, value.dtype, *header)
        records.append(filled(ArrayRecord(), arrays))
    return records


_LAYOUT = "_flowerbed_layout"
"""Where an :class:`EncodedArray` keeps the fields it was made with (data, dtype,
shape) and its NumPy dtype and header length."""


class EncodedArray(Array):
    """An ``Array`` made by :func:`encode_array`: the same fields and bytes, and
    :meth:`numpy` reads the elements straight after the header it wrote.

    ``numpy()`` returns a fresh, writable copy, as ``np.load`` does, so callers
    see no difference; once a field is set to something else it falls back to
    ``np.load``. Serialised (``deflate``, for Flower's gRPC and Ray paths) it
    is an ``Array`` like any other: the class reports Flower's qualified name.
    """

    def numpy(self) -> np.ndarray:  # type: ignore[override]
        """The array as NumPy: a copy of the elements, without ``np.load``."""
        layout = self.__dict__.get(_LAYOUT)
        if (
            layout is None
            or layout[0] is not self.data
            or (layout[1], layout[2], self.stype)
            != (self.dtype, self.shape, SType.NUMPY)
        ):
            return super().numpy()
        dtype, offset = layout[3:]
        return np.frombuffer(self.data, dtype, offset=offset).reshape(self.shape).copy()

    def __eq__(self, other: object) -> bool:
        # the dataclass __eq__ wants the same class: equal to any Array of the
        # same fields, as two Arrays are
        if not isinstance(other, Array):
            return NotImplemented
        fields = (self.dtype, self.shape, self.stype, self.data)
        return fields == (other.dtype, other.shape, other.stype, other.data)

    __hash__ = None  # type: ignore[assignment]  # as Array's: mutable, unhashable

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        # pickle finds classes by __qualname__, which names Flower's class here
        fields = (self.dtype, self.shape, self.stype, self.data)
        layout = self.__dict__.get(_LAYOUT)
        return _rebuild, (*fields, layout[3:] if layout is not None else None)


def _rebuild(
    dtype: str,
    shape: tuple[int, ...],
    stype: str,
    data: bytes,
    layout: tuple[np.dtype, int] | None,
) -> EncodedArray:
    """Unpickle an :class:`EncodedArray`."""
    array = EncodedArray(dtype=dtype, shape=shape, stype=stype, data=data)
    if layout is not None:
        array.__dict__[_LAYOUT] = (data, dtype, array.shape, *layout)
    return array


# Flower names an object's type in its serialised header by __qualname__ and
# inflates it by that name: an EncodedArray travels as, and arrives as, an Array.
EncodedArray.__qualname__ = Array.__qualname__


@functools.lru_cache(maxsize=1024)
def _npy_header(dtype: np.dtype, shape: tuple[int, ...]) -> tuple[str, bytes]:
    """(Flower's dtype name, the ``.npy`` header ``np.save`` writes) for arrays
    of this dtype and shape."""
    sample = np.zeros(shape, dtype)
    data = Array(sample).data
    return str(dtype), data[: len(data) - sample.nbytes]


def decode_array(array: Array) -> np.ndarray:
    """``array.numpy()``, the same fresh writable copy, made faster.

    ``Array.numpy()`` parses the ``.npy`` header with ``np.load`` on every call
    (~30-50 us an array here); an ``Array`` made by Flower's ``Array(ndarray)``
    (the strategies' new global models) has one of a few headers, so this copies
    the elements from :func:`array_view`, which parses each distinct header once.
    """
    if isinstance(array, EncodedArray):
        return array.numpy()
    return array_view(array).copy(order="K")


def torch_state_dict(record: ArrayRecord) -> OrderedDict[str, torch.Tensor]:
    """``record.to_torch_state_dict()``, each array decoded by :func:`decode_array`."""
    import torch

    return OrderedDict(
        (name, torch.from_numpy(decode_array(array))) for name, array in record.items()
    )


def record_views(record: ArrayRecord) -> dict[str, np.ndarray]:
    """Each of ``record``'s arrays as :func:`array_view` reads it, by name."""
    return {name: array_view(array) for name, array in record.items()}


def array_view(array: Array) -> np.ndarray:
    """A read-only NumPy view of ``array``'s bytes, without copying them.

    Flower serialises an ``Array`` built from NumPy or torch with ``np.save``
    (``stype`` ``"numpy.ndarray"``): an ``.npy`` header, then the raw elements.
    The view points into ``array.data`` past that header; ``Array.numpy()``
    instead copies the elements through ``np.load``. Other serialisations, and
    anything the header does not describe exactly, go through ``Array.numpy()``.

    Raises
    ------
    ValueError
        When the bytes are not a valid ``.npy`` payload of the declared shape.
    """
    if array.stype != SType.NUMPY:
        return array.numpy()
    data = array.data
    header = _header_bytes(data) if isinstance(data, bytes) else None
    parsed = _NPY_HEADERS.get(header) if header is not None else None
    if parsed is None:
        parsed = _parse_npy_header(data)
        if parsed is None:
            return array.numpy()
        if header is not None and len(_NPY_HEADERS) < _NPY_HEADERS_KEPT:
            _NPY_HEADERS[header] = parsed
    shape, fortran, dtype, offset = parsed
    count = math.prod(shape)
    view = np.frombuffer(data, dtype=dtype, count=count, offset=offset)
    return view.reshape(shape, order="F" if fortran else "C")


_NpyHeader = tuple[tuple[int, ...], bool, np.dtype, int]
_NPY_HEADERS: dict[bytes, _NpyHeader] = {}
"""Parsed ``.npy`` headers by their bytes: a model's arrays have the same few
headers round after round, and parsing one (``ast.literal_eval``) costs ~20 us,
as much as folding 100,000 floats; a reply of a 320-array model spent more
time there than in folding."""
_NPY_HEADERS_KEPT = 4096


def _header_bytes(data: bytes) -> bytes | None:
    """The bytes of a ``.npy`` payload's magic and header (version 1 or 2)."""
    if data[:6] != b"\x93NUMPY":
        return None
    if data[6:7] == b"\x01":
        end = 10 + int.from_bytes(data[8:10], "little")
    elif data[6:7] == b"\x02":
        end = 12 + int.from_bytes(data[8:12], "little")
    else:
        return None
    return data[:end] if end <= len(data) else None


def _parse_npy_header(data: bytes) -> _NpyHeader | None:
    """Shape, Fortran order, dtype and data offset; None for another version."""
    stream = io.BytesIO(data)
    try:
        version = np.lib.format.read_magic(stream)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(stream)
        elif version == (2, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(stream)
        else:
            return None
    except ValueError as err:
        raise ValueError(f"not a .npy payload: {err}") from err
    if dtype.hasobject:
        raise ValueError(f"object arrays are not allowed (dtype {dtype})")
    return tuple(shape), bool(fortran), dtype, stream.tell()
