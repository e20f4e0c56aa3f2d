"""ReduceUnit built for a dtype/op subset (the board configurations), on Amaranth's
simulator: the built pairs match proto's reference bit for bit, the left-out ones give
zeros."""

from __future__ import annotations

import numpy as np
import pytest
from amaranth.sim import Simulator

from fpgaccl.hw.reduce.unit import LATENCY, ReduceUnit
from fpgaccl.proto.reduce import DType, ReduceOp, reduce_reference
from fpgaccl.sim.tb.reduce_vectors import operands


def _run(unit, cases):
    """``cases``: (dtype, op, a_words, b_words); returns the output words per case."""
    out = []

    async def tb(ctx):
        ctx.set(unit.o.ready, 1)
        for dtype, op, a, b in cases:
            ctx.set(unit.dtype, dtype)
            ctx.set(unit.op, op)
            got = []
            for i in range(len(a) + LATENCY + 1):
                feed = i < len(a)
                for port, words in ((unit.a, a), (unit.b, b)):
                    ctx.set(port.valid, feed)
                    if feed:
                        ctx.set(port.payload.data, int(words[i]))
                        ctx.set(port.payload.keep, (1 << (unit.width // 8)) - 1)
                await ctx.tick()
                if ctx.get(unit.o.valid):
                    got.append(ctx.get(unit.o.payload.data))
            out.append(got[:len(a)])

    sim = Simulator(unit)
    sim.add_clock(1e-8)
    sim.add_testbench(tb)
    sim.run()
    return out


def _pack(elems: np.ndarray, width: int) -> list[int]:
    raw = elems.tobytes()
    nb = width // 8
    return [int.from_bytes(raw[i:i + nb], "little") for i in range(0, len(raw), nb)]


def _case(dtype, op, width, rng, beats=6):
    n = beats * width // dtype.bits
    a, b = operands(dtype, n, rng)
    nt = dtype.numpy_dtype()
    u = np.dtype(f"uint{dtype.bits}")
    want = reduce_reference(dtype, op, a.astype(u).view(nt), b.astype(u).view(nt))
    return (dtype, op, _pack(a.astype(u), width), _pack(b.astype(u), width),
            _pack(np.asarray(want).view(u), width))


@pytest.mark.parametrize(("width", "dtypes", "ops"), [
    (32, (DType.INT32,), (ReduceOp.SUM,)),                      # iCE40 SMALL
    (64, (DType.INT32, DType.FLOAT32),
     (ReduceOp.SUM, ReduceOp.PROD, ReduceOp.MIN, ReduceOp.MAX)),  # ECP5 FULL
])
def test_subset_matches_reference_and_zeroes_the_rest(width, dtypes, ops):
    rng = np.random.default_rng(9)
    unit = ReduceUnit(width, dtypes=dtypes, ops=ops)
    built = [_case(d, o, width, rng) for d in dtypes for o in ops]
    # Left out: another dtype, and (for the single-op build) another op.
    outside = [(DType.INT16, ops[0]), (dtypes[0], ReduceOp.BXOR)]
    if len(ops) == 1:
        outside.append((dtypes[0], ReduceOp.MAX))
    words = [rng.integers(0, 1 << 62, 4).tolist() for _ in outside]
    got = _run(unit, [(d, o, a, b) for d, o, a, b, _ in built]
               + [(d, o, w, w[::-1]) for (d, o), w in zip(outside, words, strict=True)])
    for (d, o, _, _, want), g in zip(built, got, strict=False):
        assert g == want, f"{d.name} {o.name}"
    for (d, o), g in zip(outside, got[len(built):], strict=True):
        assert g == [0] * 4, f"{d.name} {o.name} is not built and must give zeros"


def test_subset_arguments_are_checked():
    with pytest.raises(ValueError, match="width"):
        ReduceUnit(32, dtypes=(DType.INT64,))
    with pytest.raises(ValueError, match="ops"):
        ReduceUnit(64, ops=())
