"""The lane-parallel reduction unit: two beat streams in, their element-wise reduction
out, one beat per cycle, fixed latency."""

from __future__ import annotations

from amaranth.hdl import Cat, EnableInserter, Module, Signal, Value
from amaranth.lib import wiring
from amaranth.lib.wiring import In, Out

from fpgaccl.hw.stream.beat import beat_stream
from fpgaccl.proto.reduce import DTYPE_BITS, OP_BITS, DType, ReduceOp

from .common import FloatFormat
from .float_add import FloatAdd
from .float_minmax import FloatMinMax
from .float_mul import FloatMul
from .int_lane import IntLane

INT_WIDTHS = (8, 16, 32, 64)
FLOAT_TYPES = (DType.FLOAT16, DType.BFLOAT16, DType.FLOAT32, DType.FLOAT64)
# Every lane result is padded to the slowest lane, then one register selects the result.
LANE_LATENCY = max(IntLane.latency, FloatAdd.latency, FloatMul.latency, FloatMinMax.latency)
LATENCY = LANE_LATENCY + 1


def _delay(m: Module, v: Value, cycles: int, name: str) -> Value:
    for i in range(cycles):
        r = Signal(len(v), name=f"{name}_d{i}")
        m.d.sync += r.eq(v)
        v = r
    return v


class ReduceDatapath(wiring.Component):
    """The lanes and the result select, as a plain pipeline with no flow control: every
    register advances every cycle. :class:`ReduceUnit` stalls it with an enable."""

    def __init__(self, width: int) -> None:
        self.width = width
        super().__init__({
            "a": In(width),
            "b": In(width),
            "dtype": In(DTYPE_BITS),
            "op": In(OP_BITS),
            "o": Out(width),
        })

    def elaborate(self, platform) -> Module:
        m = Module()
        width = self.width
        results: dict[tuple[str, object], Value] = {}

        def lanes(key, elem_w, make, latency, **ctl):
            """``width // elem_w`` copies of a lane, their outputs concatenated."""
            out = Signal(width, name=f"{key[0]}_{key[1]}")
            for i in range(width // elem_w):
                lane = make()
                m.submodules[f"{key[0]}_{key[1]}_{i}"] = lane
                sl = slice(i * elem_w, (i + 1) * elem_w)
                m.d.comb += [lane.a.eq(self.a[sl]), lane.b.eq(self.b[sl]), out[sl].eq(lane.o)]
                for k, v in ctl.items():
                    m.d.comb += getattr(lane, k).eq(v)
            results[key] = _delay(m, out, LANE_LATENCY - latency, f"{key[0]}_{key[1]}")

        is_signed = Signal()
        with m.Switch(self.dtype):
            for d in DType:
                with m.Case(d):
                    m.d.comb += is_signed.eq(d.is_signed)
        for w in INT_WIDTHS:
            lanes(("int", w), w, lambda w=w: IntLane(w), IntLane.latency,
                  op=self.op, is_signed=is_signed)
        for d in FLOAT_TYPES:
            fmt = FloatFormat(d.info.exp_bits, d.info.frac_bits)
            name = d.name.lower()
            lanes(("add", name), d.bits, lambda fmt=fmt: FloatAdd(fmt), FloatAdd.latency)
            lanes(("mul", name), d.bits, lambda fmt=fmt: FloatMul(fmt), FloatMul.latency)
            lanes(("minmax", name), d.bits, lambda fmt=fmt: FloatMinMax(fmt),
                  FloatMinMax.latency, is_max=self.op == ReduceOp.MAX)

        bitwise = Signal(width)
        with m.Switch(self.op):
            with m.Case(ReduceOp.BAND):
                m.d.comb += bitwise.eq(self.a & self.b)
            with m.Case(ReduceOp.BOR):
                m.d.comb += bitwise.eq(self.a | self.b)
            with m.Default():
                m.d.comb += bitwise.eq(self.a ^ self.b)
        bitwise_d = _delay(m, bitwise, LANE_LATENCY, "bitwise")
        dtype_d = _delay(m, self.dtype, LANE_LATENCY, "dtype")
        op_d = _delay(m, self.op, LANE_LATENCY, "op")

        # Bitwise ops on a float type are not a supported pair (proto.is_supported);
        # they give the raw bitwise result rather than garbage.
        with m.Switch(dtype_d):
            for d in DType:
                with m.Case(d), m.Switch(op_d):
                    with m.Case(ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR):
                        m.d.sync += self.o.eq(bitwise_d)
                    if d.is_float:
                        name = d.name.lower()
                        with m.Case(ReduceOp.SUM):
                            m.d.sync += self.o.eq(results["add", name])
                        with m.Case(ReduceOp.PROD):
                            m.d.sync += self.o.eq(results["mul", name])
                        with m.Default():
                            m.d.sync += self.o.eq(results["minmax", name])
                    else:
                        with m.Default():
                            m.d.sync += self.o.eq(results["int", d.bits])
        return m


class ReduceUnit(wiring.Component):
    """``o = a op b`` element-wise, beat by beat, :data:`LATENCY` cycles after both
    operand beats are taken; sustains one beat per cycle.

    ``dtype``/``op`` (codes of :class:`~fpgaccl.proto.reduce.DType` /
    :class:`~fpgaccl.proto.reduce.ReduceOp`) are sampled with each beat and travel down
    the pipeline with it, so they may change between beats without draining. Lanes are
    ``width // dtype.bits`` elements, element ``i`` in bits ``[i*bits, (i+1)*bits)``
    (little-endian bytes, as on the wire). ``keep``/``first``/``last`` of the result are
    those of ``a``: the operand streams are expected to be aligned beat for beat.

    Flow control stalls the whole pipeline while the output holds a beat nobody takes;
    bubbles still drain, and the output is a register.
    """

    latency = LATENCY

    def __init__(self, width: int) -> None:
        if width < 64 or width % 64:
            raise ValueError(f"reduction width must be a multiple of 64, not {width}")
        self.width = width
        super().__init__({
            "a": In(beat_stream(width)),
            "b": In(beat_stream(width)),
            "o": Out(beat_stream(width)),
            "dtype": In(DTYPE_BITS),
            "op": In(OP_BITS),
        })

    def elaborate(self, platform) -> Module:
        m = Module()
        advance = Signal()
        m.d.comb += advance.eq(~self.o.valid | self.o.ready)
        path = ReduceDatapath(self.width)
        m.submodules.path = EnableInserter(advance)(path)

        both = self.a.valid & self.b.valid
        take = Signal()
        m.d.comb += [
            take.eq(both & advance),
            self.a.ready.eq(take),
            self.b.ready.eq(take),
            path.a.eq(self.a.payload.data),
            path.b.eq(self.b.payload.data),
            path.dtype.eq(self.dtype),
            path.op.eq(self.op),
            self.o.payload.data.eq(path.o),
        ]

        # Valid and framing ride alongside the data, stalled by the same enable.
        prev = Cat(both, self.a.payload.keep, self.a.payload.first, self.a.payload.last)
        for i in range(LATENCY):
            r = Signal(len(prev), name=f"side_{i}")
            with m.If(advance):
                m.d.sync += r.eq(prev)
            prev = r
        kw = len(self.a.payload.keep)
        m.d.comb += [
            self.o.valid.eq(prev[0]),
            self.o.payload.keep.eq(prev[1:1 + kw]),
            self.o.payload.first.eq(prev[1 + kw]),
            self.o.payload.last.eq(prev[2 + kw]),
        ]
        return m
