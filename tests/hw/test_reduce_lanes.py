"""Amaranth-simulator tests of the reduction unit's lanes, against proto's reference."""

from __future__ import annotations

import numpy as np
import pytest
from amaranth.sim import Simulator

from fpgaccl.hw.reduce.common import FloatFormat
from fpgaccl.hw.reduce.float_add import FloatAdd
from fpgaccl.hw.reduce.float_minmax import FloatMinMax
from fpgaccl.hw.reduce.float_mul import FloatMul
from fpgaccl.hw.reduce.int_lane import IntLane
from fpgaccl.proto.reduce import DType, ReduceOp, reduce_reference
from fpgaccl.sim.tb.reduce_vectors import operands, special_bits

FLOATS = [DType.FLOAT16, DType.BFLOAT16, DType.FLOAT32, DType.FLOAT64]
INTS = [d for d in DType if not d.is_float]


def run_lane(dut, a, b, **static):
    """Feed one operand pair per cycle and collect the results, latency-aligned."""
    got = []
    n = len(a)

    async def tb(ctx):
        for k, v in static.items():
            ctx.set(getattr(dut, k), int(v))
        for i in range(n + dut.latency):
            if i < n:
                ctx.set(dut.a, int(a[i]))
                ctx.set(dut.b, int(b[i]))
            await ctx.tick()
            if i >= dut.latency - 1 and len(got) < n:
                got.append(ctx.get(dut.o))

    sim = Simulator(dut)
    sim.add_clock(1e-8)
    sim.add_testbench(tb)
    sim.run()
    return np.array(got, dtype=np.uint64)


def check(dtype, op, a, b, got):
    u = np.dtype(f"uint{dtype.bits}")
    nt = dtype.numpy_dtype()
    want = reduce_reference(dtype, op, a.astype(u).view(nt), b.astype(u).view(nt)).view(u)
    bad = np.nonzero(got.astype(u) != want)[0]
    assert not len(bad), "\n".join(
        f"{dtype.name} {op.name}: {int(a[i]):#x} , {int(b[i]):#x} -> {int(got[i]):#x}, "
        f"want {int(want[i]):#x}" for i in bad[:10])


def all_special_pairs(dtype):
    s = special_bits(dtype)
    a = np.array([x for x in s for _ in s], dtype=np.uint64)
    b = np.array([y for _ in s for y in s], dtype=np.uint64)
    return a, b


def vectors(dtype, n, seed):
    a0, b0 = all_special_pairs(dtype)
    a1, b1 = operands(dtype, n, np.random.default_rng(seed))
    return np.concatenate([a0, a1.astype(np.uint64)]), np.concatenate([b0, b1.astype(np.uint64)])


def fmt_of(dtype):
    return FloatFormat(dtype.info.exp_bits, dtype.info.frac_bits)


@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name.lower())
def test_float_add(dtype):
    a, b = vectors(dtype, 3000, 1)
    check(dtype, ReduceOp.SUM, a, b, run_lane(FloatAdd(fmt_of(dtype)), a, b))


@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name.lower())
def test_float_mul(dtype):
    a, b = vectors(dtype, 3000, 2)
    check(dtype, ReduceOp.PROD, a, b, run_lane(FloatMul(fmt_of(dtype)), a, b))


@pytest.mark.parametrize("op", [ReduceOp.MIN, ReduceOp.MAX], ids=lambda o: o.name.lower())
@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name.lower())
def test_float_minmax(dtype, op):
    a, b = vectors(dtype, 500, 3)
    got = run_lane(FloatMinMax(fmt_of(dtype)), a, b, is_max=op is ReduceOp.MAX)
    check(dtype, op, a, b, got)


def test_float16_exhaustive_rounding_ties():
    """Every float16 significand against 1.0 at shifts that put the dropped bits exactly
    at the halfway point: the round-to-even cases an adder most often gets wrong."""
    dtype = DType.FLOAT16
    frac = np.arange(1 << 10, dtype=np.uint64)
    a = (np.uint64(15 << 10) | frac)                       # [1, 2)
    b = np.full_like(a, (15 - 11) << 10)                   # 2**-11: half an ulp of 1.0
    a = np.concatenate([a, a, a | np.uint64(0x8000)])
    b = np.concatenate([b, b + np.uint64(1 << 10), b])
    check(dtype, ReduceOp.SUM, a, b, run_lane(FloatAdd(fmt_of(dtype)), a, b))


@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.PROD, ReduceOp.MIN, ReduceOp.MAX],
                         ids=lambda o: o.name.lower())
@pytest.mark.parametrize("dtype", INTS, ids=lambda d: d.name.lower())
def test_int_lane(dtype, op):
    a, b = vectors(dtype, 300, 4)
    got = run_lane(IntLane(dtype.bits), a, b, op=op, is_signed=dtype.is_signed)
    check(dtype, op, a, b, got)


def test_stallable_lane_holds_while_disabled():
    """The exported form of a lane freezes its whole pipeline while ``en`` is low."""
    from fpgaccl.hw.reduce.unit import StallableLane
    dut = StallableLane(FloatAdd(fmt_of(DType.FLOAT32)))
    one, two = 0x3F800000, 0x40000000
    seen = []

    async def tb(ctx):
        ctx.set(dut.en, 1)
        ctx.set(dut.a, one)
        ctx.set(dut.b, one)
        await ctx.tick()
        ctx.set(dut.en, 0)
        ctx.set(dut.a, 0)
        ctx.set(dut.b, 0)
        for _ in range(10):
            await ctx.tick()
            seen.append(ctx.get(dut.o))
        ctx.set(dut.en, 1)
        for _ in range(FloatAdd.latency - 1):     # one stage was already taken
            await ctx.tick()
        seen.append(ctx.get(dut.o))

    sim = Simulator(dut)
    sim.add_clock(1e-8)
    sim.add_testbench(tb)
    sim.run()
    # Frozen at whatever the idle pipeline showed, then the pending 1 + 1 completes.
    assert seen[:10] == [seen[0]] * 10 and seen[10] == two


@pytest.mark.parametrize("dtype", [DType.FLOAT16, DType.BFLOAT16, DType.FLOAT32],
                         ids=lambda d: d.name.lower())
def test_float_mul_subnormal_operands(dtype):
    """Subnormal x normal and subnormal x subnormal: the multiplier normalises each
    operand before the product, so every leading-zero count of a subnormal significand
    and every result class (normal, subnormal, rounds up to normal, flushes to zero)
    must come out as the reference says."""
    e, m = dtype.info.exp_bits, dtype.info.frac_bits
    rng = np.random.default_rng(7)
    n = 3000
    # Every leading-zero count: one set bit at each fraction position, then random fill.
    one = np.uint64(1) << rng.integers(0, m, n).astype(np.uint64)
    frac = one | (rng.integers(0, 1 << m, n, dtype=np.uint64) & (one - np.uint64(1)))
    sign = rng.integers(0, 2, n, dtype=np.uint64) << np.uint64(e + m)
    a = sign | frac
    # b: normals whose exponent brings the product anywhere from overflow to underflow,
    # and one in eight a subnormal too.
    bias = (1 << (e - 1)) - 1
    exp_b = rng.integers(1, (1 << e) - 1, n, dtype=np.uint64)
    exp_b = np.where(rng.integers(0, 2, n) == 1,
                     rng.integers(bias, min((1 << e) - 1, bias + m + 3), n, dtype=np.uint64), exp_b)
    b = (rng.integers(0, 2, n, dtype=np.uint64) << np.uint64(e + m)) | (exp_b << np.uint64(m)) | \
        rng.integers(0, 1 << m, n, dtype=np.uint64)
    b = np.where(rng.integers(0, 8, n) == 0, rng.integers(1, 1 << m, n, dtype=np.uint64), b)
    check(dtype, ReduceOp.PROD, a, b, run_lane(FloatMul(fmt_of(dtype)), a, b))


@pytest.mark.parametrize("dtype", [DType.FLOAT32, DType.FLOAT64], ids=lambda d: d.name.lower())
def test_float_mul_subnormal_rounding_hangs_on_a_bit_the_byte_shift_drops(dtype):
    """Subnormal products that are exactly halfway between two results but for set bits
    below ``amt & ~7`` of the 2p-bit product register (amt: the subnormal right shift):
    the whole-byte shift stage drops those bits, so only its sticky bit makes
    round-to-nearest-even go up. Built by solving sa * sb = guard bit + L modulo
    2**(p + 1 + amt) for sb, with L odd and below the byte boundary."""
    e, m = dtype.info.exp_bits, dtype.info.frac_bits
    p, bias = m + 1, (1 << (e - 1)) - 1
    rng = np.random.default_rng(11)
    a, b = [], []
    for amt in range(8, 17):
        mod = 1 << (p + 1 + amt)
        for _ in range(1 << 20):
            sa = int(rng.integers(1 << (p - 1), 1 << p)) | 1
            low = int(rng.integers(1, 1 << (amt & ~7))) | 1
            sb = ((low + (1 << (p - 1 + amt))) * pow(sa, -1, mod)) % mod
            if (1 << (p - 1)) <= sb < (1 << p) and sa * sb >= 1 << (2 * p - 1):
                break
        else:
            raise AssertionError(f"no operands for a {amt}-bit shift")
        for sign in (0, 1):  # exponents: the product's biased exponent is 1 - amt
            a.append((sign << (e + m)) | (1 << m) | (sa - (1 << m)))
            b.append(((bias - 1 - amt) << m) | (sb - (1 << m)))
    a = np.array(a, dtype=np.uint64)
    b = np.array(b, dtype=np.uint64)
    nt, u = dtype.numpy_dtype(), np.dtype(f"uint{dtype.bits}")
    want = reduce_reference(dtype, ReduceOp.PROD, a.astype(u).view(nt), b.astype(u).view(nt))
    assert np.all(want.view(u) & 1 == 1)  # rounded up from an even significand
    check(dtype, ReduceOp.PROD, a, b, run_lane(FloatMul(fmt_of(dtype)), a, b))
