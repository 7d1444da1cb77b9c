"""FBT1 tensor encoding (android_client/PROTOCOL.md, "Tensor encoding")."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from flowerbed.clients.bridge.codec import (
    TensorCodecError,
    arrayrecord_to_tensors,
    check_layout,
    decode_tensors,
    encode_tensors,
    tensors_to_arrayrecord,
)

# One tensor "b" of shape [2] holding [1.0, -2.0], written out byte by byte.
ONE_TENSOR = (
    b"FBT1"
    + b"\x01\x00\x00\x00"  # count = 1
    + b"\x01\x00"  # name_len = 1
    + b"b"
    + b"\x00"  # dtype float32
    + b"\x01"  # ndim = 1
    + b"\x02\x00\x00\x00"  # dims = [2]
    + b"\x00\x00\x80\x3f"  # 1.0f little-endian
    + b"\x00\x00\x00\xc0"  # -2.0f
)


def test_encoding_is_the_documented_byte_layout():
    blob = encode_tensors([("b", np.array([1.0, -2.0], dtype=np.float32))])
    assert blob == ONE_TENSOR


def test_decoding_reads_names_shapes_and_values_in_order():
    w = np.arange(6, dtype=np.float32).reshape(2, 3)
    s = np.array(3.5, dtype=np.float32)  # ndim 0: one value, no dims
    tensors = decode_tensors(encode_tensors([("fc.weight", w), ("scale", s)]))
    assert [n for n, _ in tensors] == ["fc.weight", "scale"]
    np.testing.assert_array_equal(tensors[0][1], w)
    assert tensors[1][1].shape == () and float(tensors[1][1]) == 3.5
    # 8 header + (2+9+1+1+8 + 24) + (2+5+1+1+0 + 4)
    assert len(encode_tensors([("fc.weight", w), ("scale", s)])) == 8 + 45 + 13


@pytest.mark.parametrize(
    ("blob", "message"),
    [
        (b"FBT2" + ONE_TENSOR[4:], "bad magic"),
        (ONE_TENSOR[:-1], "truncated"),
        (ONE_TENSOR + b"\x00", "1 trailing bytes"),
        (ONE_TENSOR[:11] + b"\x01" + ONE_TENSOR[12:], "unknown dtype code 1"),
        (ONE_TENSOR[:4] + b"\x02" + ONE_TENSOR[5:], "truncated"),  # count 2, 1 given
        (b"FB", "truncated"),
    ],
)
def test_malformed_blobs_are_refused_with_the_reason(blob, message):
    with pytest.raises(TensorCodecError, match=message):
        decode_tensors(blob)


def test_a_repeated_name_is_malformed():
    body = ONE_TENSOR[8:]
    with pytest.raises(TensorCodecError, match="repeated"):
        decode_tensors(b"FBT1" + struct.pack("<I", 2) + body + body)


def test_only_float32_is_encoded():
    with pytest.raises(TensorCodecError, match="float32 only"):
        encode_tensors([("x", np.zeros(2, dtype=np.float64))])


def test_layout_must_match_the_arrays_sent():
    sent = [("fc.weight", (2, 3)), ("fc.bias", (2,))]
    good = [
        ("fc.weight", np.zeros((2, 3), np.float32)),
        ("fc.bias", np.zeros(2, np.float32)),
    ]
    check_layout(good, sent)
    with pytest.raises(TensorCodecError, match=r"shape \[3, 2\]"):
        check_layout([("fc.weight", np.zeros((3, 2), np.float32)), good[1]], sent)
    with pytest.raises(TensorCodecError, match="names"):
        check_layout(list(reversed(good)), sent)


def test_arrayrecord_round_trip_keeps_order_and_values():
    tensors = [
        ("a", np.ones((2, 2), np.float32)),
        ("b", np.arange(3, dtype=np.float32)),
    ]
    back = arrayrecord_to_tensors(tensors_to_arrayrecord(tensors))
    assert [n for n, _ in back] == ["a", "b"]
    np.testing.assert_array_equal(back[1][1], [0.0, 1.0, 2.0])
