"""A register slice for any stream."""

from __future__ import annotations

from amaranth.hdl import Module, Signal
from amaranth.lib import stream, wiring
from amaranth.lib.wiring import In, Out

__all__ = ["SkidBuffer"]


class SkidBuffer(wiring.Component):
    """A stream register slice that cuts both directions: ``o``'s valid and payload
    are registers, and so is ``i.ready`` (a second register catches the beat that
    arrives in the cycle ``o`` stalls). Full throughput, one cycle of latency; what
    ``o.ready`` drives is two register enables, so a long ready chain downstream
    stops here instead of reaching the source."""

    def __init__(self, layout) -> None:
        self.layout = layout
        super().__init__({"i": In(stream.Signature(layout)),
                          "o": Out(stream.Signature(layout))})

    def elaborate(self, platform) -> Module:
        m = Module()
        full = Signal()
        held = Signal(self.layout)
        m.d.comb += self.i.ready.eq(~full)
        with m.If(~self.o.valid | self.o.ready):
            with m.If(full):
                m.d.sync += [self.o.valid.eq(1), self.o.payload.eq(held), full.eq(0)]
            with m.Else():
                m.d.sync += [self.o.valid.eq(self.i.valid), self.o.payload.eq(self.i.payload)]
        with m.Elif(self.i.valid & ~full):
            m.d.sync += [held.eq(self.i.payload), full.eq(1)]
        return m
