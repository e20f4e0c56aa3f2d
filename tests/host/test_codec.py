"""host/codec.c: byte for byte proto.codec's encoder and decoder, on both of its paths."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fpgaccl.errors import InvalidArgumentError, MalformedHeaderError
from fpgaccl.host import codec as native
from fpgaccl.proto import codec as ref

DTYPES = ["bfloat16", "float16", "float32"]
REAL = Path(__file__).resolve().parent.parent / "data" / "codec_real.npz"


@pytest.fixture(scope="module", autouse=True)
def lib():
    if native.load() is None:
        pytest.skip(f"C codec unavailable: {native.reason}")


@pytest.fixture(params=["vector", "generic"])
def path(request):
    was = native.set_vector(request.param == "vector")
    yield request.param
    native.set_vector(was)


def cases(dtype: str) -> list[np.ndarray]:
    """Random bits, real weights and gradients, blocks built to hit every (k, z), edge
    values, and lengths around the block size."""
    f = ref.format_of(dtype)
    rng = np.random.default_rng(7)
    E, M = f.exp_bits, f.man_bits
    out = [rng.integers(0, 1 << f.bits, n, dtype=np.uint64).astype(f.uint)
           for n in (0, 1, 63, 64, 65, 64 * 40 + 9)]
    real = np.load(REAL)
    out += [real[k].astype(f.dtype.numpy_dtype()).view(f.uint) for k in ("weights", "gradients")]
    for spread in range(E + 1):
        for zeros in (0.0, 0.2, 0.98):
            n = 64 * 16
            centre = rng.integers(0, 1 << E, n // 64).repeat(64)
            e = np.clip(centre + rng.integers(0, (1 << spread), n) - (1 << spread) // 2,
                        0, (1 << E) - 1)
            e = np.where(rng.random(n) < zeros, 0, e).astype(np.uint64)
            x = (rng.integers(0, 2, n, dtype=np.uint64) << (E + M)) | (e << M) | \
                rng.integers(0, 1 << M, n, dtype=np.uint64)
            out.append(x.astype(f.uint))
    emax = (1 << E) - 1
    edges = [s | e << M | m for s in (0, 1 << (E + M)) for e in (0, 1, emax - 1, emax)
             for m in (0, 1, (1 << M) - 1, 1 << (M - 1))]
    out.append(rng.choice(np.array(edges, np.uint64), 64 * 8 + 3).astype(f.uint))
    return out


@pytest.mark.parametrize("dtype", DTYPES)
def test_same_bytes_as_the_reference(dtype, path):
    f = ref.format_of(dtype)
    for x in cases(dtype):
        a = x.view(f.dtype.numpy_dtype())
        want = ref.encode(a, dtype)
        got = bytes(native.encode(a, dtype))
        assert got == want, (dtype, path, x.size)
        back = native.decode(got, dtype, x.size)
        assert back.view(f.uint).tobytes() == x.tobytes()


@pytest.mark.parametrize("dtype", DTYPES)
def test_corrupted_input_same_verdict_as_the_reference(dtype, path):
    f = ref.format_of(dtype)
    rng = np.random.default_rng(8)
    x = cases(dtype)[7]  # real gradients
    data = ref.encode(x.view(f.dtype.numpy_dtype()), dtype)
    offsets = ref.block_offsets(data, f, x.size // ref.BLOCK)
    seen = set()
    for trial in range(300):
        bad = bytearray(data)
        at = int(rng.choice(offsets[:-1])) + int(rng.integers(0, 2)) if trial % 2 else \
            int(rng.integers(0, len(bad)))
        bad[at] = int(rng.integers(0, 256))
        if trial % 50 == 0:
            bad = bad[:int(rng.integers(0, len(bad)))]
        try:
            want = ref.decode(bytes(bad), dtype, x.size)
        except MalformedHeaderError as e:
            with pytest.raises(MalformedHeaderError) as got:
                native.decode(bytes(bad), dtype, x.size)
            assert got.value.field == e.field, (trial, e)
            seen.add(e.field)
            continue
        assert native.decode(bytes(bad), dtype, x.size).tobytes() == want.tobytes()
    assert {"length", "k"} <= seen


def test_decode_rejects_overflowing_codes_on_both_paths(path):
    x = np.full(64, 0x3F80, np.uint16)
    x[0] = 0x4000  # e=128 -> k=1, base=127
    data = bytearray(ref.encode(x.view(ref.format_of("bf16").dtype.numpy_dtype()), "bf16"))
    data[1] = 255
    with pytest.raises(MalformedHeaderError) as e:
        native.decode(bytes(data), "bf16", 64)
    assert e.value.field == "code"
    data[1] = 254  # 254 + 1 = 255: still an exponent
    assert native.decode(bytes(data), "bf16", 64).view(np.uint16)[0] == 0x7F80


def test_buffers_and_bad_arguments():
    a = np.arange(200, dtype=np.float32)
    out = np.zeros(ref.encoded_size_bound(a.size, "fp32") + 5, np.uint8)
    coded = native.encode(a, "fp32", out)
    assert bytes(coded) == ref.encode(a, "fp32")
    into = np.empty(200, np.float32)
    assert native.decode(coded, "fp32", 200, into) is into and (into == a).all()
    with pytest.raises(InvalidArgumentError) as e:
        native.encode(a, "fp32", np.zeros(10, np.uint8))
    assert e.value.argument == "out"
    with pytest.raises(InvalidArgumentError) as e:
        native.decode(coded, "fp32", 200, np.empty(199, np.float32))
    assert e.value.argument == "out"
    with pytest.raises(InvalidArgumentError) as e:
        native.encode(a, "bf16")
    assert e.value.argument == "array"


def test_the_c_source_is_shipped():
    import tomllib
    cfg = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    assert native.SOURCE.name in cfg["tool"]["setuptools"]["package-data"]["fpgaccl.host"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_code_error_yields_to_later_header_and_length_errors(dtype, path):
    """proto checks every header and the length before any code; the one-pass C
    decoder must give the same verdict when a bad code comes first."""
    f = ref.format_of(dtype)
    E, M = f.exp_bits, f.man_bits
    x = np.full(64 * 3, 3 << M, f.uint)  # e = 3 everywhere
    x[0] = 4 << M  # block 0: k=1, base=3
    data = bytearray(ref.encode(x.view(f.dtype.numpy_dtype()), dtype))
    data[1] = (1 << E) - 1  # block 0: base + code 1 overflows
    blocks = ref.block_offsets(bytes(data), f, 3)
    verdicts = {}
    for name, bad in (("code", bytes(data)),
                      ("k", bytes(data[:blocks[2]]) + bytes([E + 1]) + bytes(data[blocks[2] + 1:])),
                      ("length", bytes(data[:-1]))):
        with pytest.raises(MalformedHeaderError) as want:
            ref.decode(bad, dtype, x.size)
        with pytest.raises(MalformedHeaderError) as got:
            native.decode(bad, dtype, x.size)
        verdicts[name] = (want.value.field, got.value.field)
    assert verdicts == {"code": ("code", "code"), "k": ("k", "k"), "length": ("length", "length")}
