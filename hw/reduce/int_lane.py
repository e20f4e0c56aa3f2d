"""One integer lane: sum, product, min, max; the bitwise ops are lane-independent and
live in the unit."""

from __future__ import annotations

from amaranth.hdl import Module, Mux, Signal
from amaranth.lib import wiring
from amaranth.lib.wiring import In, Out

from fpgaccl.proto.reduce import ReduceOp


class IntLane(wiring.Component):
    """``o = a op b`` modulo ``2**width`` after :attr:`latency` cycles.

    ``op`` is a :class:`~fpgaccl.proto.reduce.ReduceOp` code (sum/prod/min/max);
    ``is_signed`` picks two's complement or unsigned comparison for min/max (sum and
    product are the same bits either way). The product takes two stages: the partial
    products of the operands' halves, each within DSP blocks, are registered before
    they are added (the DSP and the adder in one cycle were the node's slowest path on
    the ECP5, whose DSPs get no pipeline registers from yosys).
    """

    latency = 3

    def __init__(self, width: int) -> None:
        self.width = width
        super().__init__({
            "a": In(width),
            "b": In(width),
            "op": In(3),
            "is_signed": In(1),
            "o": Out(width),
        })

    def elaborate(self, platform) -> Module:
        m = Module()
        w = self.width
        a, b = self.a, self.b
        less = Signal()
        m.d.comb += less.eq(a < b)
        with m.If(self.is_signed):
            m.d.comb += less.eq(a.as_signed() < b.as_signed())

        s1_fast = Signal(w)
        s1_is_prod = Signal()
        with m.Switch(self.op):
            with m.Case(ReduceOp.MIN):
                m.d.sync += s1_fast.eq(Mux(less, a, b))
            with m.Case(ReduceOp.MAX):
                m.d.sync += s1_fast.eq(Mux(less, b, a))
            with m.Default():
                m.d.sync += s1_fast.eq(a + b)
        m.d.sync += s1_is_prod.eq(self.op == ReduceOp.PROD)

        # The product modulo 2**w: low x low whole, and of the two cross products only
        # the bits that land below 2**w (the high x high one lands above it).
        h = w // 2
        pp_ll = Signal(2 * h)
        pp_lh = Signal(w - h)
        pp_hl = Signal(w - h)
        m.d.sync += [pp_ll.eq(a[:h] * b[:h]), pp_lh.eq(a[:h] * b[h:]),
                     pp_hl.eq(a[h:] * b[:h])]
        s2_fast = Signal(w)
        s2_prod = Signal(w)
        s2_is_prod = Signal()
        m.d.sync += [s2_prod.eq(pp_ll + ((pp_lh + pp_hl) << h)), s2_fast.eq(s1_fast),
                     s2_is_prod.eq(s1_is_prod)]
        m.d.sync += self.o.eq(Mux(s2_is_prod, s2_prod, s2_fast))
        return m
