"""FBT1 tensor encoding (android_client/PROTOCOL.md, "Tensor encoding")."""

from __future__ import annotations

import random
import struct

import numpy as np
import pytest
from flowerbed.clients.bridge.codec import (
    MAX_NDIM,
    TensorCodecError,
    arrayrecord_to_tensors,
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


def test_decoding_against_the_arrays_sent_refuses_other_layouts():
    sent = [("fc.weight", (2, 3)), ("fc.bias", (2,))]
    w, b = np.zeros((2, 3), np.float32), np.zeros(2, np.float32)
    assert (
        len(decode_tensors(encode_tensors([("fc.weight", w), ("fc.bias", b)]), sent))
        == 2
    )
    with pytest.raises(
        TensorCodecError, match=r"shape \[3, 2\]; the array sent had \[2, 3\]"
    ):
        decode_tensors(
            encode_tensors([("fc.weight", w.T.copy()), ("fc.bias", b)]), sent
        )
    with pytest.raises(TensorCodecError, match=r"named 'fc\.bias'"):
        decode_tensors(encode_tensors([("fc.bias", b), ("fc.weight", w)]), sent)
    with pytest.raises(
        TensorCodecError, match="holds 1 tensors; the arrays sent were 2"
    ):
        decode_tensors(encode_tensors([("fc.weight", w)]), sent)


def _header(count: int) -> bytes:
    return b"FBT1" + struct.pack("<I", count)


# One empty tensor (dtype 0, ndim 1, dims [0]) named "t<i>": 2 + len(name) + 2 + 4.
def _empty(i: int) -> bytes:
    name = f"t{i}".encode()
    return struct.pack("<H", len(name)) + name + b"\x00\x01" + struct.pack("<I", 0)


@pytest.mark.parametrize(
    ("blob", "expected", "message"),
    [
        # Millions of tiny tensors are refused at the count, before any is read.
        (_header(7_000_000) + _empty(0), None, "7000000 tensors; at most 100000"),
        (
            _header(3) + _empty(0),
            [("w", (2,))],
            "holds 3 tensors; the arrays sent were 1",
        ),
        # ndim 255 (numpy allows 64): refused by the codec, not by numpy.
        (
            _header(1) + b"\x01\x00a\x00\xff" + b"\x00" * 1020,
            None,
            "255 dimensions; at most 32",
        ),
        # Zero elements but a shape numpy cannot allocate.
        (
            _header(1)
            + b"\x01\x00a\x00\x03"
            + struct.pack("<3I", 0, 2**32 - 1, 2**32 - 1),
            None,
            "more than 2147483647 elements",
        ),
    ],
)
def test_hostile_headers_are_refused_before_decoding(blob, expected, message):
    with pytest.raises(TensorCodecError, match=message):
        decode_tensors(blob, expected)


def test_encoding_refuses_shapes_the_decoder_would_refuse():
    with pytest.raises(TensorCodecError, match=f"at most {MAX_NDIM} dimensions"):
        encode_tensors([("x", np.zeros((1,) * (MAX_NDIM + 1), np.float32))])


# Many small tensors, mostly zeros (like fresh biases or a sparse update): headers
# are a tenth of the bytes, and a flipped ndim byte then reads 68 or 132 dimensions
# of 0 from the data that follows, which numpy itself refuses.
FUZZ_TENSORS = [
    (f"layer{i}.weight", np.eye(8, dtype=np.float32)[:, ::-1] * (i % 3 == 0))
    for i in range(30)
]


def _decodes_or_codec_error(blob: bytes, expected=None) -> None:
    try:
        decoded = decode_tensors(blob, expected)
    except TensorCodecError:
        return
    for _, array in decoded:
        assert array.dtype == np.float32


def test_fuzz_random_blobs_truncations_and_bit_flips_raise_only_the_codec_error():
    """Random bytes, every truncation, 8,000 bit flips and 2,000 byte rewrites of
    a valid blob: each decodes or raises TensorCodecError, nothing else."""
    rng = random.Random(17)
    valid = encode_tensors(FUZZ_TENSORS)
    layout = [(n, a.shape) for n, a in FUZZ_TENSORS]
    for _ in range(300):
        _decodes_or_codec_error(rng.randbytes(rng.randrange(0, 200)))
        _decodes_or_codec_error(b"FBT1" + rng.randbytes(rng.randrange(0, 200)))
    for cut in range(len(valid)):
        with pytest.raises(TensorCodecError):
            decode_tensors(valid[:cut])
    for i in range(8000):
        blob = bytearray(valid)
        for _ in range(1 + i % 4):
            bit = rng.randrange(len(blob) * 8)
            blob[bit // 8] ^= 1 << (bit % 8)
        _decodes_or_codec_error(bytes(blob), layout if i % 2 else None)
    for _ in range(2000):
        blob = bytearray(valid)
        blob[rng.randrange(len(blob))] = rng.choice([0, 0xFF, 0x7F, 0x80])
        _decodes_or_codec_error(bytes(blob))


def test_arrayrecord_round_trip_keeps_order_and_values():
    tensors = [
        ("a", np.ones((2, 2), np.float32)),
        ("b", np.arange(3, dtype=np.float32)),
    ]
    back = arrayrecord_to_tensors(tensors_to_arrayrecord(tensors))
    assert [n for n, _ in back] == ["a", "b"]
    np.testing.assert_array_equal(back[1][1], [0.0, 1.0, 2.0])
