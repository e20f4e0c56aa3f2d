"""A small iterative divider: the sequencer divides once per SETUP, so one bit per
cycle costs nothing and saves a wide combinational divider on the critical path."""

from __future__ import annotations

from amaranth.hdl import Cat, Module, Mux, Signal
from amaranth.lib import wiring
from amaranth.lib.wiring import In, Out


class CeilDivider(wiring.Component):
    """``quotient = ceil(dividend / divisor)`` in ``width`` cycles after ``start``.

    A zero divisor yields zero (the sequencer treats ``nchunks = 0`` as an error before
    it gets here).
    """

    def __init__(self, width: int = 32, divisor_width: int = 16) -> None:
        self.width = width
        super().__init__({
            "start": In(1),
            "dividend": In(width),
            "divisor": In(divisor_width),
            "busy": Out(1),
            "quotient": Out(width + 1),
        })

    def elaborate(self, platform) -> Module:
        m = Module()
        w = self.width
        num = Signal(w + 1)      # dividend + divisor - 1, shifted out MSB first
        rem = Signal(w + 2)
        quo = Signal(w + 1)
        den = Signal.like(self.divisor)
        count = Signal(range(w + 2))
        m.d.comb += [self.busy.eq(count != 0), self.quotient.eq(quo)]
        with m.If(self.start):
            m.d.sync += [
                num.eq(self.dividend + self.divisor - 1),
                den.eq(self.divisor), rem.eq(0), quo.eq(0), count.eq(w + 1),
            ]
        with m.Elif(count != 0):
            trial = Signal(w + 2)
            m.d.comb += trial.eq((rem << 1) | num[w])
            # One subtraction, its borrow the comparison: a single carry chain a step
            # instead of a compare and a subtract side by side feeding a mux.
            diff = Signal(w + 3)
            m.d.comb += diff.eq(trial - den)
            fits = (den != 0) & ~diff[-1]
            m.d.sync += [num.eq(num << 1), count.eq(count - 1),
                         rem.eq(Mux(fits, diff[:w + 2], trial)), quo.eq(Cat(fits, quo))]
        return m
