"""The frame gate: whole frames or nothing."""

from __future__ import annotations

from amaranth.hdl import Module, Signal
from amaranth.lib import data, stream, wiring
from amaranth.lib.wiring import In, Out
from amaranth.utils import ceil_log2

from fpgaccl.proto.drops import DROP_COUNTER_BITS

from ..net.parser import sat_inc
from ..stream.beat import beat_stream
from ..stream.commit_fifo import CommitFIFO
from .symbols import RxDrop, rx_beat_layout


def frame_depth(width: int, max_frame: int) -> int:
    """Entries for two frames of ``max_frame`` bytes: one drains while the next fills."""
    return 1 << ceil_log2(2 * -(-max_frame // (width // 8)) + 2)


class FrameGate(wiring.Component):
    """Beats with a verdict on each frame's last one in; only the frames whose verdict
    is :attr:`RxDrop.NONE` out, each whole and back to back.

    Store and forward: a frame is written into a
    :class:`~fpgaccl.hw.stream.commit_fifo.CommitFIFO` and committed or rewound at its
    last beat, so a consumer never sees a byte of a bad frame. A frame longer than the
    whole buffer is thrown away and counted as :attr:`RxDrop.OVERFLOW`. ``frames[v]``
    counts frames by verdict (``frames[NONE]``: passed), saturating."""

    def __init__(self, width: int, depth: int) -> None:
        self.width = width
        self.depth = depth
        super().__init__({
            "i": In(stream.Signature(rx_beat_layout(width))),
            "o": Out(beat_stream(width)),
            "frames": Out(data.ArrayLayout(DROP_COUNTER_BITS, len(RxDrop))),
        })

    def elaborate(self, platform) -> Module:
        m = Module()
        m.submodules.fifo = fifo = CommitFIFO(self.width, self.depth)
        wiring.connect(m, fifo.o, wiring.flipped(self.o))
        beat = self.i.payload.beat
        discarding = Signal()
        too_long = Signal()
        take = Signal()
        m.d.comb += [
            too_long.eq(fifo.pending == self.depth),
            # Never wait on a frame that cannot fit: it would wait forever.
            self.i.ready.eq((fifo.space_r != 0) | too_long | discarding),
            take.eq(self.i.valid & self.i.ready),
            fifo.w_data.eq(beat),
            fifo.w_en.eq(take & ~discarding),
        ]
        with m.If(take & (discarding | too_long)):
            m.d.comb += fifo.rewind.eq(1)
            m.d.sync += discarding.eq(~beat.last)
            with m.If(beat.last):
                sat_inc(m, self.frames[RxDrop.OVERFLOW.value])
        with m.Elif(take & beat.last):
            with m.If(self.i.payload.drop == RxDrop.NONE):
                m.d.comb += fifo.commit.eq(1)
            with m.Else():
                m.d.comb += fifo.rewind.eq(1)
            with m.Switch(self.i.payload.drop):
                for v in RxDrop:
                    with m.Case(v):
                        sat_inc(m, self.frames[v.value])
        return m
