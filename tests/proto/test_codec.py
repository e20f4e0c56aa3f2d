"""proto.codec: the block format bit by bit, bit-exact round trips, and bad input refused."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fpgaccl.errors import InvalidArgumentError, MalformedHeaderError, UnsupportedError
from fpgaccl.proto import codec
from fpgaccl.proto.reduce import DType

DTYPES = ["bfloat16", "float16", "float32"]


def bits_of(dtype: str, values: np.ndarray) -> np.ndarray:
    f = codec.format_of(dtype)
    return np.asarray(values, dtype=f.uint)


def as_float(dtype: str, x: np.ndarray) -> np.ndarray:
    return x.view(codec.format_of(dtype).dtype.numpy_dtype())


def roundtrip(dtype: str, x: np.ndarray) -> bytes:
    data = codec.encode(as_float(dtype, x), dtype)
    back = codec.decode(data, dtype, x.size)
    assert back.dtype == codec.format_of(dtype).dtype.numpy_dtype()
    assert back.view(x.dtype).tobytes() == x.tobytes()
    assert len(data) <= codec.encoded_size_bound(x.size, dtype)
    return data


def edge_values(dtype: str) -> np.ndarray:
    """Every class of value: zeros of both signs, subnormals, normals, infinities and
    NaNs with many payloads (quiet and signalling, both signs)."""
    f = codec.format_of(dtype)
    E, M = f.exp_bits, f.man_bits
    emax = (1 << E) - 1
    sign = 1 << (E + M)
    mans = [0, 1, 2, (1 << M) - 1, 1 << (M - 1), (1 << (M - 1)) + 1, 0x55 & ((1 << M) - 1)]
    out = []
    for s in (0, sign):
        for e in (0, 1, 2, emax // 2, emax - 1, emax):
            out += [s | e << M | m for m in mans]
    return bits_of(dtype, out)


def test_documented_example_blocks():
    one, two = 0x3F80, 0x4000  # bf16 1.0 (e=127), 2.0 (e=128)
    x = np.full(64, one, np.uint16)
    assert codec.encode(as_float("bf16", x), "bf16") == bytes([0x00, 0x7F]) + bytes(64)
    x[0] = two
    assert codec.encode(as_float("bf16", x), "bf16") == \
        bytes([0x01, 0x7F]) + bytes(64) + bytes([0x01]) + bytes(7)
    x[1] = 0x8000  # -0.0: e=0 would widen the range to 8 bits without z
    assert codec.encode(as_float("bf16", x), "bf16") == (
        bytes([0x02 | 0x10, 0x7F]) + bytes([0, 0x80]) + bytes(62)  # sm: -0.0 sign
        + bytes([0xFC]) + bytes([0xFF] * 7) + bytes([0x01]) + bytes(7))


def test_fp16_sign_and_high_mantissa_bits_are_bit_planes():
    x = np.zeros(64, np.uint16)
    x[3] = 0x8000 | 0x0300 | 0x00AB  # sign, mantissa bits 9..8 and 7..0, exponent 0
    data = codec.encode(as_float("fp16", x), "fp16")
    assert data[:2] == bytes([0, 0])
    assert data[2 + 3] == 0xAB and sum(data[2:66]) == 0xAB
    planes = data[66:90]
    assert planes == bytes([0x08]) + bytes(7) + bytes([0x08]) + bytes(7) + bytes([0x08]) + bytes(7)
    assert len(data) == codec.format_of("fp16").block_bytes(0) == 90


@pytest.mark.parametrize("dtype", DTYPES)
def test_block_sizes(dtype):
    f = codec.format_of(dtype)
    assert f.raw_block_bytes == 64 * f.bits // 8
    assert f.max_block_bytes == f.raw_block_bytes + codec.HEADER_BYTES


@pytest.mark.parametrize("dtype", DTYPES)
def test_edge_values_roundtrip_everywhere_in_a_block(dtype):
    edges = edge_values(dtype)
    rng = np.random.default_rng(1)
    for n in (edges.size, 64, 65, 127, 128, 640 + 17):
        x = rng.choice(edges, n)
        roundtrip(dtype, x)
    # every edge value alone in an otherwise ordinary block
    base = as_float(dtype, bits_of(dtype, np.zeros(64))).copy()
    base[:] = 0.75
    for v in edges:
        x = base.view(codec.format_of(dtype).uint).copy()
        x[17] = v
        roundtrip(dtype, x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_all_nan_payloads(dtype):
    f = codec.format_of(dtype)
    E, M = f.exp_bits, f.man_bits
    step = 1 if M <= 10 else 4099  # all 2**M payloads for the 16-bit types
    mans = np.arange(1, 1 << M, step, dtype=np.uint64)
    nans = ((((1 << E) - 1) << M) | mans).astype(f.uint)
    roundtrip(dtype, np.concatenate([nans, nans | f.uint(1 << (E + M))]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_random_bits_cost_at_most_2_percent(dtype):
    f = codec.format_of(dtype)
    rng = np.random.default_rng(2)
    x = rng.integers(0, 1 << f.bits, 64 * 500, dtype=np.uint64).astype(f.uint)
    data = roundtrip(dtype, x)
    assert len(data) <= x.nbytes * 1.02


@pytest.mark.parametrize("dtype", DTYPES)
def test_gaussian_values_compress(dtype):
    rng = np.random.default_rng(3)
    a = (rng.standard_normal(64 * 200) * 0.02).astype(codec.format_of(dtype).dtype.numpy_dtype())
    data = roundtrip(dtype, a.view(codec.format_of(dtype).uint))
    assert len(data) < 0.95 * a.nbytes


@settings(max_examples=200, deadline=None)
@given(dtype=st.sampled_from(DTYPES), n=st.integers(0, 300), seed=st.integers(0, 2**32 - 1),
       spread=st.integers(0, 8), zeros=st.floats(0, 1))
def test_roundtrip_hypothesis(dtype, n, seed, spread, zeros):
    f = codec.format_of(dtype)
    rng = np.random.default_rng(seed)
    E, M = f.exp_bits, f.man_bits
    centre = int(rng.integers(0, 1 << E))
    e = np.clip(centre + rng.integers(-(1 << spread) // 2, (1 << spread) // 2 + 1, n),
                0, (1 << E) - 1)
    e = np.where(rng.random(n) < zeros, 0, e).astype(np.uint64)
    x = (rng.integers(0, 2, n, dtype=np.uint64) << (E + M)) | (e << M) | \
        rng.integers(0, 1 << M, n, dtype=np.uint64)
    roundtrip(dtype, x.astype(f.uint))


@pytest.mark.parametrize("dtype", DTYPES)
def test_canonical_parameters(dtype):
    E = codec.format_of(dtype).exp_bits
    e = np.array([[5] * 64, [0] * 64, [5] * 63 + [6], [0] * 63 + [6], [0] + [5] * 63,
                  [1] * 63 + [(1 << E) - 1], [0] * 63 + [(1 << E) - 1]])
    k, z, base = codec.block_params(e, E)
    assert k.tolist() == [0, 0, 1, 1, 1, E, 1]
    assert z.tolist() == [False, False, False, True, True, False, True]
    assert base.tolist() == [5, 0, 5, 6, 5, 1, (1 << E) - 1]


def test_dtype_names_and_bad_arguments():
    assert codec.format_of(DType.BFLOAT16) is codec.format_of("bf16")
    assert codec.format_of(np.float16) is codec.format_of("float16")
    assert codec.format_of(ml_dtypes.bfloat16) is codec.format_of("bfloat16")
    with pytest.raises(InvalidArgumentError) as e:
        codec.format_of("float64")
    assert e.value.argument == "dtype"
    with pytest.raises(InvalidArgumentError) as e:
        codec.encode(np.zeros(4, np.float32), "bf16")
    assert e.value.argument == "array"
    with pytest.raises(InvalidArgumentError) as e:
        codec.decode(b"", "bf16", -1)
    assert e.value.argument == "count"


def _good(dtype: str = "bf16") -> tuple[bytearray, int]:
    rng = np.random.default_rng(4)
    a = (rng.standard_normal(64 * 3 + 5)).astype(codec.format_of(dtype).dtype.numpy_dtype())
    return bytearray(codec.encode(a, dtype)), a.size


@pytest.mark.parametrize("mutate, field", [
    (lambda d: d.__setitem__(0, d[0] | 0x20), "reserved"),
    (lambda d: d.__setitem__(0, (d[0] & 0xF0) | 9), "k"),
    (lambda d: d.__setitem__(0, 0x10), "z"),
    (lambda d: d.__delitem__(slice(-1, None)), "length"),
    (lambda d: d.extend(b"\0"), "length"),
    (lambda d: d.__delitem__(slice(100, None)), "length"),
])
def test_malformed_input_raises_naming_the_field(mutate, field):
    data, n = _good()
    mutate(data)
    with pytest.raises(MalformedHeaderError) as e:
        codec.decode(bytes(data), "bf16", n)
    assert e.value.header == "codec" and e.value.field == field


def test_base_and_code_overflow_rejected():
    x = np.full(64, 0x0400, np.uint16)  # fp16 e=1
    data = bytearray(codec.encode(as_float("fp16", x), "fp16"))
    data[1] = 32
    with pytest.raises(MalformedHeaderError) as e:
        codec.decode(bytes(data), "fp16", 64)
    assert e.value.field == "base"
    x[0] = 0x0800  # e=2: k=1, base=1
    data = bytearray(codec.encode(as_float("fp16", x), "fp16"))
    assert data[:2] == bytes([1, 1])
    data[1] = 31  # base 31 + code 1 = 32: past 5 bits
    with pytest.raises(MalformedHeaderError) as e:
        codec.decode(bytes(data), "fp16", 64)
    assert e.value.field == "code"


def test_choose_codec():
    assert codec.choose_codec("off", "bf16") is codec.Codec.NONE
    assert codec.choose_codec("on", DType.FLOAT32) is codec.Codec.EXP_BLOCK64
    assert codec.choose_codec("auto", np.float16) is codec.Codec.EXP_BLOCK64
    assert codec.choose_codec("auto", "int32") is codec.Codec.NONE
    assert max(codec.Codec).bit_length() <= codec.CODEC_BITS
    with pytest.raises(UnsupportedError) as e:
        codec.choose_codec("on", np.float64)
    assert e.value.argument == "compression"
    with pytest.raises(InvalidArgumentError) as e:
        codec.choose_codec("yes", "bf16")
    assert e.value.argument == "compression"
