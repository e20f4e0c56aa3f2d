"""The lane-parallel reduction unit: two beat streams in, their element-wise reduction
out, one beat per cycle, fixed latency."""

from __future__ import annotations

from amaranth.hdl import (
    Cat,
    ClockSignal,
    Const,
    EnableInserter,
    Instance,
    Module,
    ResetSignal,
    Signal,
    Value,
)
from amaranth.lib import wiring
from amaranth.lib.wiring import In, Out

from fpgaccl.hw.stream.beat import beat_stream
from fpgaccl.hw.stream.fifo import BeatFIFO
from fpgaccl.proto.reduce import BITWISE_OPS, DTYPE_BITS, OP_BITS, DType, ReduceOp

from .common import FloatFormat
from .float_add import FloatAdd
from .float_minmax import FloatMinMax
from .float_mul import FloatMul
from .int_lane import IntLane

INT_WIDTHS = (8, 16, 32, 64)
FLOAT_TYPES = (DType.FLOAT16, DType.BFLOAT16, DType.FLOAT32, DType.FLOAT64)
# Every lane result is padded to the slowest lane, then one register selects the result.
LANE_LATENCY = max(IntLane.latency, FloatAdd.latency, FloatMul.latency, FloatMinMax.latency)
PATH_LATENCY = LANE_LATENCY + 1   # ReduceDatapath: the lanes, then the result select
OUT_DEPTH = PATH_LATENCY + 3      # beats the output FIFO holds: in flight + its own latency
LATENCY = PATH_LATENCY + 2        # taken -> offered, through the FIFO's registered output


def _lane_kinds() -> dict[tuple[str, str], tuple[int, object, int]]:
    """(kind, type) -> (element width, lane factory, lane latency), for every lane kind."""
    kinds: dict[tuple[str, str], tuple[int, object, int]] = {}
    for w in INT_WIDTHS:
        kinds["int", str(w)] = (w, lambda w=w: IntLane(w), IntLane.latency)
    for d in FLOAT_TYPES:
        fmt = FloatFormat(d.info.exp_bits, d.info.frac_bits)
        name = d.name.lower()
        kinds["add", name] = (d.bits, lambda fmt=fmt: FloatAdd(fmt), FloatAdd.latency)
        kinds["mul", name] = (d.bits, lambda fmt=fmt: FloatMul(fmt), FloatMul.latency)
        kinds["minmax", name] = (d.bits, lambda fmt=fmt: FloatMinMax(fmt), FloatMinMax.latency)
    return kinds


def _subset(dtypes, ops) -> tuple[tuple[DType, ...], tuple[ReduceOp, ...]]:
    dtypes = tuple(DType) if dtypes is None else tuple(sorted({DType(d) for d in dtypes}))
    ops = tuple(ReduceOp) if ops is None else tuple(sorted({ReduceOp(o) for o in ops}))
    if not dtypes:
        raise ValueError("dtypes: a reduction unit needs at least one element type")
    if not ops:
        raise ValueError("ops: a reduction unit needs at least one operator")
    return dtypes, ops


def _delay(m: Module, v: Value, cycles: int, name: str) -> Value:
    for i in range(cycles):
        r = Signal(len(v), name=f"{name}_d{i}")
        m.d.sync += r.eq(v)
        v = r
    return v


class StallableLane(wiring.Component):
    """A lane with its registers gated by ``en``: the form in which a lane is exported
    as a module of its own (see ``separate_lanes``)."""

    def __init__(self, lane: wiring.Component) -> None:
        self.lane = lane
        super().__init__({**dict(lane.signature.members.items()), "en": In(1)})

    def elaborate(self, platform) -> Module:
        m = Module()
        m.submodules.lane = EnableInserter(self.en)(self.lane)
        for name, member in self.lane.signature.members.items():
            if member.flow == wiring.In:
                m.d.comb += getattr(self.lane, name).eq(getattr(self, name))
            else:
                m.d.comb += getattr(self, name).eq(getattr(self.lane, name))
        return m


class ReduceDatapath(wiring.Component):
    """The lanes and the result select, as a plain pipeline with no flow control: every
    register advances every cycle. :class:`ReduceUnit` stalls it with an enable.

    With ``separate_lanes`` the lanes become instances of external modules, one module
    per lane kind (:attr:`lane_modules` maps each module name to a factory of its
    :class:`StallableLane`): a simulator then compiles each kind once rather than once
    per lane, which at 512 bits is the difference between seconds and many minutes.
    Registers in those lanes are gated by ``en`` explicitly, since an enable inserted
    around this component does not reach into instances.

    ``dtypes``/``ops`` (default: all) restrict what is built: only their lanes exist,
    and a dtype/op code outside them gives zeros (as an undefined code does). With a
    single op the ``op`` input is ignored and the lanes see a constant, so synthesis
    drops what that op does not need (the integer multipliers, for a sum-only build);
    the result select still checks the op code.
    """

    def __init__(self, width: int, *, separate_lanes: bool = False,
                 dtypes=None, ops=None) -> None:
        self.width = width
        self.dtypes, self.ops = _subset(dtypes, ops)
        self.separate_lanes = separate_lanes
        self.lane_modules = {
            f"fpgaccl_reduce_{kind}_{name}": (lambda make=make: StallableLane(make()))
            for (kind, name), (_, make, _) in _lane_kinds().items()}
        super().__init__({
            "a": In(width),
            "b": In(width),
            "dtype": In(DTYPE_BITS),
            "op": In(OP_BITS),
            "en": In(1),
            "o": Out(width),
        })

    def elaborate(self, platform) -> Module:
        m = Module()
        width = self.width
        results: dict[tuple[str, object], Value] = {}

        def lanes(key, **ctl):
            """``width // elem_w`` copies of a lane, their outputs concatenated."""
            elem_w, make, latency = _lane_kinds()[key]
            out = Signal(width, name=f"{key[0]}_{key[1]}")
            module = f"fpgaccl_reduce_{key[0]}_{key[1]}"
            for i in range(width // elem_w):
                sl = slice(i * elem_w, (i + 1) * elem_w)
                name = f"{key[0]}_{key[1]}_{i}"
                if self.separate_lanes:
                    m.submodules[name] = Instance(
                        module, i_clk=ClockSignal(), i_rst=ResetSignal(), i_en=self.en,
                        i_a=self.a[sl], i_b=self.b[sl], o_o=out[sl],
                        **{f"i_{k}": v for k, v in ctl.items()})
                    continue
                lane = make()
                m.submodules[name] = lane
                m.d.comb += [lane.a.eq(self.a[sl]), lane.b.eq(self.b[sl]), out[sl].eq(lane.o)]
                for k, v in ctl.items():
                    m.d.comb += getattr(lane, k).eq(v)
            results[key] = _delay(m, out, LANE_LATENCY - latency, f"{key[0]}_{key[1]}")

        dtypes, ops = self.dtypes, self.ops
        op = Const(ops[0], OP_BITS) if len(ops) == 1 else self.op
        lane_ops = [o for o in ops if o not in BITWISE_OPS]
        is_signed = Signal()
        with m.Switch(self.dtype):
            for d in DType:
                with m.Case(d):
                    m.d.comb += is_signed.eq(d.is_signed)
            with m.Default():
                m.d.comb += is_signed.eq(0)
        if lane_ops:
            for w in INT_WIDTHS:
                if any(not d.is_float and d.bits == w for d in dtypes):
                    lanes(("int", str(w)), op=op, is_signed=is_signed)
        is_max = Signal()
        m.d.comb += is_max.eq(op == ReduceOp.MAX)
        for d in FLOAT_TYPES:
            if d not in dtypes:
                continue
            name = d.name.lower()
            if ReduceOp.SUM in ops:
                lanes(("add", name))
            if ReduceOp.PROD in ops:
                lanes(("mul", name))
            if ReduceOp.MIN in ops or ReduceOp.MAX in ops:
                lanes(("minmax", name), is_max=is_max)

        has_bitwise = any(o in BITWISE_OPS for o in ops)
        bitwise = Signal(width)
        with m.Switch(op):
            with m.Case(ReduceOp.BAND):
                m.d.comb += bitwise.eq(self.a & self.b)
            with m.Case(ReduceOp.BOR):
                m.d.comb += bitwise.eq(self.a | self.b)
            with m.Default():
                m.d.comb += bitwise.eq(self.a ^ self.b)
        bitwise_d = _delay(m, bitwise, LANE_LATENCY, "bitwise") if has_bitwise else None
        dtype_d = _delay(m, self.dtype, LANE_LATENCY, "dtype")
        # The select looks at the op code even in a single-op build, so a code the build
        # leaves out still gives zeros.
        op_d = _delay(m, self.op, LANE_LATENCY, "op")

        # Bitwise ops on a float type are not a supported pair (proto.is_supported);
        # they give the raw bitwise result rather than garbage.
        with m.Switch(dtype_d):
            for d in dtypes:
                with m.Case(d), m.Switch(op_d):
                    if has_bitwise:
                        with m.Case(*(o for o in ops if o in BITWISE_OPS)):
                            m.d.sync += self.o.eq(bitwise_d)
                    if d.is_float:
                        name = d.name.lower()
                        if ReduceOp.SUM in ops:
                            with m.Case(ReduceOp.SUM):
                                m.d.sync += self.o.eq(results["add", name])
                        if ReduceOp.PROD in ops:
                            with m.Case(ReduceOp.PROD):
                                m.d.sync += self.o.eq(results["mul", name])
                        minmax = [o for o in (ReduceOp.MIN, ReduceOp.MAX) if o in ops]
                        if minmax:
                            with m.Case(*minmax):
                                m.d.sync += self.o.eq(results["minmax", name])
                    elif lane_ops:
                        with m.Case(*lane_ops):
                            m.d.sync += self.o.eq(results["int", str(d.bits)])
                    with m.Default():
                        m.d.sync += self.o.eq(0)
            with m.Default():
                # A code proto does not define (or this build leaves out): zeros, not the
                # previous beat's data.
                m.d.sync += self.o.eq(0)
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

    The pipeline never stalls: its results go into an output FIFO with room for every
    beat in flight, and a beat is taken only while the FIFO and the pipeline together
    hold fewer than :data:`OUT_DEPTH` (a count kept in one register). A stall enable
    would fan out to every pipeline register (3,500 flip-flops in the ECP5 node), which
    placement cannot keep short.

    Every lane kind (integer per width; float add/mul/min-max per format) is built for
    every element position and the result is selected by dtype/op: simple and uniform,
    but not area-frugal; ``dtypes``/``ops`` build a subset instead (see
    :class:`ReduceDatapath`). ``separate_lanes`` only changes how the lanes are exported
    (as external modules, for fast simulator builds).
    """

    latency = LATENCY

    def __init__(self, width: int, *, separate_lanes: bool = False,
                 dtypes=None, ops=None) -> None:
        dtypes, ops = _subset(dtypes, ops)
        widest = max(d.bits for d in dtypes)
        if width < widest or width % widest:
            raise ValueError(f"width: {width} is not a multiple of the widest element "
                             f"({widest} bits)")
        self.width = width
        self.dtypes, self.ops = dtypes, ops
        self.path = ReduceDatapath(width, separate_lanes=separate_lanes, dtypes=dtypes,
                                   ops=ops)
        super().__init__({
            "a": In(beat_stream(width)),
            "b": In(beat_stream(width)),
            "o": Out(beat_stream(width)),
            "dtype": In(DTYPE_BITS),
            "op": In(OP_BITS),
        })

    def elaborate(self, platform) -> Module:
        m = Module()
        path = self.path
        m.submodules.path = path
        m.d.comb += path.en.eq(1)
        m.submodules.out = out = BeatFIFO(self.width, OUT_DEPTH)
        wiring.connect(m, out.o, wiring.flipped(self.o))

        # Beats in the pipeline or the FIFO: a new one is taken only while there is room
        # for it, so the FIFO never refuses what the pipeline delivers.
        held = Signal(range(OUT_DEPTH + 1))
        take = Signal()
        m.d.comb += [
            take.eq(self.a.valid & self.b.valid & (held < OUT_DEPTH)),
            self.a.ready.eq(take),
            self.b.ready.eq(take),
            path.a.eq(self.a.payload.data),
            path.b.eq(self.b.payload.data),
            path.dtype.eq(self.dtype),
            path.op.eq(self.op),
        ]
        m.d.sync += held.eq(held + take - (out.o.valid & out.o.ready))

        # Valid and framing ride alongside the data.
        prev = Cat(take, self.a.payload.keep, self.a.payload.first, self.a.payload.last)
        for i in range(PATH_LATENCY):
            r = Signal(len(prev), name=f"side_{i}")
            m.d.sync += r.eq(prev)
            prev = r
        kw = len(self.a.payload.keep)
        m.d.comb += [
            out.i.valid.eq(prev[0]),
            out.i.payload.data.eq(path.o),
            out.i.payload.keep.eq(prev[1:1 + kw]),
            out.i.payload.first.eq(prev[1 + kw]),
            out.i.payload.last.eq(prev[2 + kw]),
        ]
        return m
