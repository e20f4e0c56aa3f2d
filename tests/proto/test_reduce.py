"""proto.reduce: codes, supported pairs and the reference semantics the HDL is held to."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from fpgaccl.proto.reduce import (
    SUPPORTED,
    DType,
    ReduceOp,
    is_supported,
    reduce_bytes,
    reduce_reference,
)
from fpgaccl.sim.tb.reduce_vectors import operands

FLOATS = [d for d in DType if d.is_float]


def test_codes_fit_register_fields_and_widths():
    assert max(DType) < 16 and max(ReduceOp) < 8
    assert [d.bits for d in DType] == [8, 16, 32, 64] * 2 + [16, 16, 32, 64]
    for d in DType:
        assert d.numpy_dtype().itemsize * 8 == d.bits
        assert DType.from_numpy(d.numpy_dtype()) is d
    assert DType.BFLOAT16.numpy_dtype() == np.dtype(ml_dtypes.bfloat16)


def test_supported_pairs():
    assert not is_supported(DType.FLOAT32, ReduceOp.BXOR)
    assert is_supported(DType.FLOAT16, ReduceOp.PROD) and is_supported(DType.INT8, ReduceOp.BAND)
    assert len(SUPPORTED) == 12 * 7 - 4 * 3
    with pytest.raises(ValueError):
        reduce_reference(DType.FLOAT32, ReduceOp.BAND, [1.0], [2.0])
    assert ReduceOp.from_name("max") is ReduceOp.MAX


def test_integers_wrap():
    assert reduce_reference(DType.INT8, ReduceOp.SUM, [127], [1])[0] == -128
    assert reduce_reference(DType.UINT16, ReduceOp.PROD, [300], [300])[0] == 90000 % 65536
    assert reduce_reference(DType.INT32, ReduceOp.MIN, [-1], [1])[0] == -1
    assert reduce_reference(DType.UINT32, ReduceOp.MIN, [2**32 - 1], [1])[0] == 1


@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name.lower())
def test_float_sum_and_prod_are_correctly_rounded(dtype):
    """Equal (as values, NaN as NaN) to the exact result rounded once. float64 holds the
    product of two narrower floats exactly, and a sum closely enough (53 >= 2p + 2) that
    rounding it again to the narrow type is still correct rounding."""
    if dtype is DType.FLOAT64:
        pytest.skip("no wider type to compute the exact result in")
    a, b = operands(dtype, 20000, np.random.default_rng(0))
    nt = dtype.numpy_dtype()
    a, b = a.view(nt), b.view(nt)
    with np.errstate(all="ignore"):
        wa, wb = a.astype(np.float64), b.astype(np.float64)
        for op, exact in ((ReduceOp.SUM, wa + wb), (ReduceOp.PROD, wa * wb)):
            got = reduce_reference(dtype, op, a, b).astype(np.float64)
            want = exact.astype(nt).astype(np.float64)
            same = (got == want) | (np.isnan(got) & np.isnan(want))
            assert same.all()
            zero = want == 0
            assert (np.signbit(got[zero]) == np.signbit(want[zero])).all()


@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name.lower())
def test_float_minmax_commutative_nan_propagating(dtype):
    nt = dtype.numpy_dtype()
    z = np.array([0.0, -0.0, 0.0, np.nan, 1.0], dtype=nt)
    w = np.array([-0.0, 0.0, 0.0, 1.0, np.nan], dtype=nt)
    lo = reduce_reference(dtype, ReduceOp.MIN, z, w)
    hi = reduce_reference(dtype, ReduceOp.MAX, z, w)
    assert list(np.signbit(lo[:3])) == [True, True, False]
    assert list(np.signbit(hi[:3])) == [False, False, False]
    assert np.isnan(lo[3:].astype(np.float64)).all() and np.isnan(hi[3:].astype(np.float64)).all()


def test_nan_rule():
    u = np.uint32
    snan_a, qnan_b = u(0x7F800001), u(0xFFC00002)
    one = np.array([1.0], np.float32).view(u)[0]
    f = lambda x: np.array([x], u).view(np.float32)  # noqa: E731
    r = lambda op, x, y: int(reduce_reference(DType.FLOAT32, op, f(x), f(y)).view(u)[0])  # noqa: E731
    assert r(ReduceOp.SUM, snan_a, qnan_b) == 0x7FC00001       # a's payload, quieted
    assert r(ReduceOp.MIN, one, snan_a) == 0x7FC00001          # b's, when a is a number
    assert r(ReduceOp.SUM, u(0x7F800000), u(0xFF800000)) == 0xFFC00000   # inf - inf
    assert r(ReduceOp.PROD, u(0), u(0x7F800000)) == 0xFFC00000           # 0 * inf


def test_reduce_bytes_little_endian():
    a = np.array([1, 2, 3], "<i2").tobytes()
    b = np.array([10, -2, 7], "<i2").tobytes()
    assert np.frombuffer(reduce_bytes(DType.INT16, ReduceOp.SUM, a, b), "<i2").tolist() \
        == [11, 0, 10]


@pytest.mark.parametrize("dtype", [d for d in DType if not d.is_float])
@pytest.mark.parametrize("n", [1, 3, 7, 200])
def test_integer_average_divides_the_wrapped_sum_toward_zero(dtype, n):
    from fpgaccl.proto.reduce import average_reference
    nt = dtype.numpy_dtype()
    info = np.iinfo(nt)
    rng = np.random.default_rng(int(dtype) * 1000 + n)
    x = rng.integers(info.min, info.max, 500, dtype=nt, endpoint=True)
    x[:4] = [info.min, info.max, 0, info.min + 1 if dtype.is_signed else 1]
    got = average_reference(dtype, x, n)
    want = [v // n if v >= 0 else -(-v // n) for v in x.tolist()]   # Python ints: exact
    assert got.dtype == nt and got.tolist() == want
    # The sum wraps first: n copies of the maximum average to what their wrapped sum gives.
    summed = reduce_reference(dtype, ReduceOp.SUM, x, x)
    assert average_reference(dtype, summed, 2).tolist() == [
        (v // 2 if v >= 0 else -(-v // 2)) for v in summed.tolist()]


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("n", [1, 3, 5, 8])
def test_float_average_is_a_product_by_the_rounded_reciprocal(dtype, n):
    from fpgaccl.proto.reduce import average_reference, average_scale
    nt = dtype.numpy_dtype()
    bits = np.dtype(f"uint{dtype.bits}")
    rng = np.random.default_rng(int(dtype) * 10 + n)
    # Random bit patterns: NaN payloads, infinities, subnormals, signed zeros.
    x = rng.integers(0, 1 << dtype.bits, 2000, dtype=np.uint64).astype(bits).view(nt)
    r = average_scale(dtype, n)
    assert r.dtype == nt and float(r) == float(np.asarray(1 / n).astype(nt))
    got = average_reference(dtype, x, n)
    want = reduce_reference(dtype, ReduceOp.PROD, x, np.full(x.shape, r, nt))
    assert got.view(bits).tobytes() == want.view(bits).tobytes()
    info = dtype.info
    eps = 2.0 ** -info.frac_bits
    tiny = 2.0 ** (2 - (1 << (info.exp_bits - 1)) - info.frac_bits)  # smallest subnormal
    with np.errstate(invalid="ignore"):
        wide, got64 = x.astype(np.float64), got.astype(np.float64)
    finite = np.isfinite(wide)
    # Within two roundings of the true quotient (1/n was rounded first).
    exact = wide[finite] / n
    assert np.all(np.abs(got64[finite] - exact) <= 2 * eps * np.abs(exact) + tiny)
    with pytest.raises(ValueError):
        average_reference(dtype, x, 0)
