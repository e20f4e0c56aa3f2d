"""A store-and-forward beat FIFO: beats become visible only once their packet commits.

The writer pushes beats with ``w_en``; at the end of a packet it pulses ``commit`` (the
beats written so far, including one written in the same cycle, become readable) or
``rewind`` (they are forgotten: the write pointer returns to the last commit, and a beat
written in the same cycle is discarded too). The reader sees a plain beat stream with a
registered output, one beat per cycle. ``space`` (free entries) is computed from
registers only; ``pending`` (uncommitted entries) is a register. ``space_r`` is a
register too: the free entries as of the previous cycle's reads (``space`` less one
for the cycle after a read, else equal), for a writer whose ready must not wait for
a subtract: it never claims room that is not there.
"""

from __future__ import annotations

from amaranth.hdl import Module, Mux, Shape, Signal
from amaranth.lib import memory, wiring
from amaranth.lib.wiring import In, Out
from amaranth.utils import ceil_log2

from .beat import beat_layout, beat_stream


class CommitFIFO(wiring.Component):
    def __init__(self, width: int, depth: int) -> None:
        if depth & (depth - 1) or depth < 4:
            raise ValueError(f"depth {depth} must be a power of two >= 4")
        self.width = width
        self.depth = depth
        super().__init__({
            "w_en": In(1),
            "w_data": In(beat_layout(width)),
            "commit": In(1),
            "rewind": In(1),
            "space": Out(range(depth + 1)),
            "space_r": Out(range(depth + 1), init=depth),
            "pending": Out(range(depth + 1)),
            "o": Out(beat_stream(width)),
        })

    def elaborate(self, platform) -> Module:
        m = Module()
        abits = ceil_log2(self.depth)
        bits = Shape.cast(beat_layout(self.width)).width
        m.submodules.mem = mem = memory.Memory(shape=bits, depth=self.depth, init=[])
        wp = mem.write_port()
        rp = mem.read_port(domain="sync")

        wr = Signal(abits + 1)
        done = Signal(abits + 1)  # committed write pointer
        rd = Signal(abits + 1)
        m.d.comb += self.space.eq(self.depth - (wr - rd)[:abits + 1])
        # pending = wr - done, kept as a register: a commit or rewind empties it.
        wrote = Signal()
        m.d.comb += wrote.eq(self.w_en & ~self.rewind)
        with m.If(self.rewind | self.commit):
            m.d.sync += self.pending.eq(0)
        with m.Elif(wrote):
            m.d.sync += self.pending.eq(self.pending + 1)

        m.d.comb += [wp.addr.eq(wr[:abits]), wp.data.eq(self.w_data),
                     wp.en.eq(self.w_en & ~self.rewind)]
        wr_next = Signal.like(wr)
        m.d.comb += wr_next.eq(wr + (self.w_en & ~self.rewind))
        m.d.sync += wr.eq(wr_next)
        with m.If(self.rewind):
            m.d.sync += wr.eq(done)
        with m.Elif(self.commit):
            m.d.sync += done.eq(wr_next)

        # Read side: the memory's read register is the output register.
        pop = Signal()
        m.d.comb += [
            pop.eq((rd != done) & (~self.o.valid | self.o.ready)),
            rp.addr.eq(rd[:abits]),
            rp.en.eq(pop),
            self.o.payload.eq(rp.data),
        ]
        # space_r = depth - (wr - rd as of a cycle ago): a read frees its entry here a
        # cycle late; a write takes one at once, a rewind returns the pending ones.
        pop_r = Signal()
        m.d.sync += [pop_r.eq(pop),
                     self.space_r.eq(self.space_r + pop_r - wrote
                                     + Mux(self.rewind, self.pending, 0))]
        with m.If(pop):
            m.d.sync += [rd.eq(rd + 1), self.o.valid.eq(1)]
        with m.Elif(self.o.ready):
            m.d.sync += self.o.valid.eq(0)
        return m
