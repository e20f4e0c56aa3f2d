"""One floating-point min/max lane: NaN propagates, -0 orders below +0."""

from __future__ import annotations

from amaranth.hdl import Cat, Module, Mux, Signal
from amaranth.lib import wiring
from amaranth.lib.wiring import In, Out

from .common import FloatFormat, Unpacked


def order_key(u: Unpacked, width: int):
    """Map a non-NaN float to an unsigned integer with the same order (-0 < +0):
    positives get the sign bit set, negatives are inverted."""
    return Mux(u.sign, ~u.bits, Cat(u.mag, 1))[:width]


class FloatMinMax(wiring.Component):
    """``o = max(a, b)`` if ``is_max`` else ``min(a, b)``, one cycle later."""

    latency = 1

    def __init__(self, fmt: FloatFormat) -> None:
        self.fmt = fmt
        super().__init__({
            "a": In(fmt.width),
            "b": In(fmt.width),
            "is_max": In(1),
            "o": Out(fmt.width),
        })

    def elaborate(self, platform) -> Module:
        m = Module()
        f = self.fmt
        a, b = Unpacked(m, f, self.a), Unpacked(m, f, self.b)
        a_less = Signal()
        m.d.comb += a_less.eq(order_key(a, f.width) < order_key(b, f.width))
        with m.If(a.is_nan):
            m.d.sync += self.o.eq(a.quieted)
        with m.Elif(b.is_nan):
            m.d.sync += self.o.eq(b.quieted)
        with m.Elif(a_less ^ self.is_max):
            m.d.sync += self.o.eq(self.a)
        with m.Else():
            m.d.sync += self.o.eq(self.b)
        return m
