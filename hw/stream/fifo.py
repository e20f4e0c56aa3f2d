"""A beat FIFO: elastic buffering between stages of the packet datapath."""

from __future__ import annotations

from amaranth.hdl import Module, Shape, Signal
from amaranth.lib import fifo, wiring
from amaranth.lib.wiring import In, Out

from .beat import beat_stream


class BeatFIFO(wiring.Component):
    """Synchronous FIFO of packet beats, ``depth`` entries, registered output.

    Accepts a beat whenever it is not full and offers one whenever it is not empty, so it
    sustains one beat per cycle in both directions.
    """

    def __init__(self, width: int, depth: int) -> None:
        self.width = width
        self.depth = depth
        super().__init__({
            "i": In(beat_stream(width)),
            "o": Out(beat_stream(width)),
            "level": Out(range(depth + 1)),
        })

    def elaborate(self, platform) -> Module:
        m = Module()
        bits = Shape.cast(self.i.payload.shape()).width
        m.submodules.mem = mem = fifo.SyncFIFOBuffered(width=bits, depth=self.depth)
        raw_out = Signal(bits)
        m.d.comb += [
            mem.w_data.eq(self.i.payload),
            mem.w_en.eq(self.i.valid),
            self.i.ready.eq(mem.w_rdy),
            raw_out.eq(mem.r_data),
            self.o.payload.eq(raw_out),
            self.o.valid.eq(mem.r_rdy),
            mem.r_en.eq(self.o.ready),
            self.level.eq(mem.level),
        ]
        return m
