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
    product are the same bits either way). The product gets a stage of its own so a
    synthesiser can pipeline the multiplier into DSP blocks.
    """

    latency = 2

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
        s1_prod = Signal(w)
        s1_is_prod = Signal()
        with m.Switch(self.op):
            with m.Case(ReduceOp.MIN):
                m.d.sync += s1_fast.eq(Mux(less, a, b))
            with m.Case(ReduceOp.MAX):
                m.d.sync += s1_fast.eq(Mux(less, b, a))
            with m.Default():
                m.d.sync += s1_fast.eq(a + b)
        m.d.sync += [s1_prod.eq(a * b), s1_is_prod.eq(self.op == ReduceOp.PROD)]
        m.d.sync += self.o.eq(Mux(s1_is_prod, s1_prod, s1_fast))
        return m
