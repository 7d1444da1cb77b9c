"""The phone tensor encoding, FBT1 (``application/x-flowerbed-tensors``).

Layout, little-endian throughout (android_client/PROTOCOL.md, "Tensor encoding")::

    magic "FBT1" | count uint32 | count x (name_len uint16 | name UTF-8 |
    dtype uint8 (0 = float32) | ndim uint8 | dims ndim x uint32 |
    data prod(dims) x float32)

Decoding is strict: a bad magic, an unknown dtype, a truncated blob or trailing bytes
raise :class:`TensorCodecError` naming the tensor and byte offset at fault. Its cost
is proportional to the blob's bytes: every length is checked against the bytes left
before anything is allocated, the tensor count is capped (``max_tensors``) and, when
the expected layout is given, checked before the first tensor is read, so a blob of
millions of empty tensors is refused at its header.
"""

from __future__ import annotations

import math
import struct
from collections import OrderedDict

import numpy as np
from flwr.app import Array, ArrayRecord

MAGIC = b"FBT1"
CONTENT_TYPE = "application/x-flowerbed-tensors"
DTYPE_FLOAT32 = 0
"""The only dtype code of protocol version 1."""
DTYPE_NAMES = {DTYPE_FLOAT32: "float32"}
MAX_NDIM = 32
"""Most dimensions a tensor may have (numpy's own limit is 64; models use <= 5)."""
MAX_DIM = 2**32 - 1
MAX_NAME_BYTES = 2**16 - 1
MAX_TENSORS = 100_000
"""Default cap on the tensors of one blob (large language models have ~1,000)."""
MAX_ELEMENTS = 2**31 - 1
"""Most elements one tensor may hold, counting a zero dimension as one: a shape such
as ``[0, 2**32-1, 2**32-1]`` holds no data but cannot be allocated by numpy."""

Layout = list[tuple[str, tuple[int, ...]]]
"""Names and shapes of a blob's tensors, in order (all float32 in version 1)."""


class TensorCodecError(ValueError):
    """A tensor blob that cannot be encoded or decoded; the message says why."""


def encode_tensors(tensors: list[tuple[str, np.ndarray]]) -> bytes:
    """Encode named float32 arrays as one FBT1 blob, in the given order.

    Raises
    ------
    TensorCodecError
        If an array is not float32, a name is empty, repeated or too long, or a
        shape does not fit the format.
    """
    parts = [MAGIC, struct.pack("<I", len(tensors))]
    seen: set[str] = set()
    for name, array in tensors:
        if array.dtype != np.float32:
            raise TensorCodecError(
                f"array {name!r} has dtype {array.dtype}; protocol version 1 carries "
                "float32 only"
            )
        raw_name = name.encode("utf-8")
        if not raw_name or len(raw_name) > MAX_NAME_BYTES:
            raise TensorCodecError(
                f"array name {name!r} must be 1..{MAX_NAME_BYTES} UTF-8 bytes"
            )
        if name in seen:
            raise TensorCodecError(f"array name {name!r} appears twice")
        seen.add(name)
        if (
            array.ndim > MAX_NDIM
            or any(d > MAX_DIM for d in array.shape)
            or math.prod(max(d, 1) for d in array.shape) > MAX_ELEMENTS
        ):
            raise TensorCodecError(
                f"array {name!r} has shape {array.shape}: at most {MAX_NDIM} "
                f"dimensions and {MAX_ELEMENTS} elements"
            )
        parts.append(struct.pack("<H", len(raw_name)))
        parts.append(raw_name)
        parts.append(struct.pack("<BB", DTYPE_FLOAT32, array.ndim))
        parts.append(struct.pack(f"<{array.ndim}I", *array.shape))
        parts.append(np.ascontiguousarray(array, dtype="<f4").tobytes())
    return b"".join(parts)


def decode_tensors(
    blob: bytes, expected: Layout | None = None, max_tensors: int = MAX_TENSORS
) -> list[tuple[str, np.ndarray]]:
    """Decode an FBT1 blob into named float32 arrays, in blob order.

    Parameters
    ----------
    blob : bytes
        The FBT1 blob.
    expected : Layout | None
        Names and shapes the blob must hold, in order (the arrays a phone was sent).
        Checked tensor by tensor as the blob is read, so a wrong blob is refused at
        its first difference, before the rest is decoded.
    max_tensors : int, default MAX_TENSORS
        Most tensors a blob may declare.

    Raises
    ------
    TensorCodecError
        If the blob is malformed (bad magic, truncated, unknown dtype, a repeated or
        non-UTF-8 name, too many dimensions or tensors, trailing bytes) or differs
        from ``expected``. No other exception escapes, whatever the bytes.
    """
    view = memoryview(blob)
    pos = 0

    def take(n: int, what: str) -> memoryview:
        nonlocal pos
        if pos + n > len(view):
            raise TensorCodecError(
                f"blob truncated at byte {pos}: {what} needs {n} bytes, "
                f"{len(view) - pos} left"
            )
        chunk = view[pos : pos + n]
        pos += n
        return chunk

    if bytes(take(4, "magic")) != MAGIC:
        raise TensorCodecError(f"bad magic {bytes(view[:4])!r}; expected {MAGIC!r}")
    (count,) = struct.unpack("<I", take(4, "tensor count"))
    if count > max_tensors:
        raise TensorCodecError(f"blob declares {count} tensors; at most {max_tensors}")
    if expected is not None and count != len(expected):
        raise TensorCodecError(
            f"blob holds {count} tensors; the arrays sent were {len(expected)}"
        )
    tensors: list[tuple[str, np.ndarray]] = []
    seen: set[str] = set()
    for index in range(count):
        (name_len,) = struct.unpack("<H", take(2, f"tensor {index} name length"))
        try:
            name = bytes(take(name_len, f"tensor {index} name")).decode("utf-8")
        except UnicodeDecodeError as err:
            raise TensorCodecError(f"tensor {index} name is not UTF-8") from err
        if not name or name in seen:
            raise TensorCodecError(f"tensor {index} name {name!r} is empty or repeated")
        seen.add(name)
        dtype, ndim = struct.unpack("<BB", take(2, f"tensor {name!r} dtype/ndim"))
        if dtype not in DTYPE_NAMES:
            raise TensorCodecError(
                f"tensor {name!r} has unknown dtype code {dtype}; valid: "
                + ", ".join(f"{c} = {n}" for c, n in DTYPE_NAMES.items())
            )
        if ndim > MAX_NDIM:
            raise TensorCodecError(
                f"tensor {name!r} has {ndim} dimensions; at most {MAX_NDIM}"
            )
        dims = struct.unpack(f"<{ndim}I", take(4 * ndim, f"tensor {name!r} dims"))
        if math.prod(max(d, 1) for d in dims) > MAX_ELEMENTS:
            raise TensorCodecError(
                f"tensor {name!r} has shape {list(dims)}: more than {MAX_ELEMENTS} "
                "elements"
            )
        if expected is not None:
            want_name, want_shape = expected[index]
            if name != want_name:
                raise TensorCodecError(
                    f"tensor {index} is named {name!r}; the array sent there was "
                    f"{want_name!r}"
                )
            if tuple(dims) != tuple(want_shape):
                raise TensorCodecError(
                    f"tensor {name!r} has shape {list(dims)}; the array sent had "
                    f"{list(want_shape)}"
                )
        data = take(4 * math.prod(dims), f"tensor {name!r} data")
        array = np.frombuffer(data, dtype="<f4").astype(np.float32).reshape(dims)
        tensors.append((name, array))
    if pos != len(view):
        raise TensorCodecError(
            f"{len(view) - pos} trailing bytes after the last of {count} tensors"
        )
    return tensors


def layout_of(tensors: list[tuple[str, np.ndarray]]) -> Layout:
    """Names and shapes of decoded (or to-be-encoded) tensors, in order."""
    return [(name, tuple(int(d) for d in array.shape)) for name, array in tensors]


def arrayrecord_to_tensors(record: ArrayRecord) -> list[tuple[str, np.ndarray]]:
    """Named numpy arrays of a Flower ArrayRecord, in the record's order."""
    return [(name, array.numpy()) for name, array in record.items()]


def tensors_to_arrayrecord(tensors: list[tuple[str, np.ndarray]]) -> ArrayRecord:
    """A Flower ArrayRecord holding the named arrays, in order."""
    return ArrayRecord(OrderedDict((name, Array(a)) for name, a in tensors))
