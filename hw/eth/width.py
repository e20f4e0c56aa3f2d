"""Width conversion between the node's beats and the MAC's one byte per cycle."""

from __future__ import annotations

from amaranth.hdl import Cat, Module, Mux, Signal
from amaranth.lib import stream, wiring
from amaranth.lib.wiring import In, Out

from ..stream.beat import beat_layout, beat_stream
from .symbols import BYTE, RX_BYTE, RxDrop, rx_beat_layout


class BeatsToBytes(wiring.Component):
    """A beat stream in, its bytes out in wire order; ``last`` on the frame's last byte.

    ``keep`` must be a contiguous low mask (the beat format's rule); a beat with none
    set still sends one byte, so a ``last`` is never lost."""

    def __init__(self, width: int) -> None:
        self.width = width
        super().__init__({"i": In(beat_stream(width)), "o": Out(stream.Signature(BYTE))})

    def elaborate(self, platform) -> Module:
        m = Module()
        n = self.width // 8
        held = Signal(beat_layout(self.width))
        full = Signal()
        idx = Signal(range(n))
        top = Signal(range(n))  # index of the beat's last valid byte
        final = Signal()
        m.d.comb += [
            final.eq(idx == top),
            self.o.valid.eq(full),
            self.o.payload.data.eq(held.data.word_select(idx, 8)),
            self.o.payload.last.eq(held.last & final),
            self.i.ready.eq(~full | (self.o.ready & final)),
        ]
        with m.If(self.o.valid & self.o.ready):
            m.d.sync += idx.eq(idx + 1)
            with m.If(final):
                m.d.sync += [full.eq(0), idx.eq(0)]
        with m.If(self.i.valid & self.i.ready):
            keep = self.i.payload.keep
            m.d.sync += [held.eq(self.i.payload), full.eq(1), idx.eq(0), top.eq(0)]
            for b in range(1, n):
                with m.If(keep[b]):
                    m.d.sync += top.eq(b)
        return m


class BytesToBeats(wiring.Component):
    """Received bytes (no back-pressure: a PHY cannot wait) packed into beats that
    carry the frame's verdict on the last one.

    A beat the consumer has not taken when the next is complete is lost, and the
    frame it belonged to ends with :attr:`RxDrop.OVERFLOW`, so the gate discards what
    it kept of it; if the lost beat was the last, an empty last beat with that verdict
    is sent at the first room instead. Frames lost whole while that marker waits are
    counted with it, once."""

    def __init__(self, width: int) -> None:
        self.width = width
        super().__init__({
            "i": In(stream.Signature(RX_BYTE, always_ready=True)),
            "o": Out(stream.Signature(rx_beat_layout(width))),
        })

    def elaborate(self, platform) -> Module:
        m = Module()
        n = self.width // 8
        acc = Signal(self.width)
        idx = Signal(range(n))
        start = Signal(init=1)  # the next byte opens a frame
        lost = Signal()         # this frame lost a beat: it must end as OVERFLOW
        owe = Signal()          # a frame's last beat was lost: an end marker is due
        first = Signal()        # the beat being filled is the frame's first
        byte = self.i.payload
        lanes = [Mux(idx == k, byte.data, Mux(idx > k, acc[8 * k:8 * k + 8], 0))
                 for k in range(n)]
        emit = Signal()
        room = Signal()
        m.d.comb += [emit.eq(self.i.valid & (byte.last | (idx == n - 1))),
                     room.eq(~self.o.valid | self.o.ready)]
        with m.If(self.o.ready):
            m.d.sync += self.o.valid.eq(0)
        with m.If(self.i.valid):
            m.d.sync += [acc.word_select(idx, 8).eq(byte.data), idx.eq(idx + 1),
                         start.eq(byte.last)]
            with m.If(start):
                m.d.sync += first.eq(1)
            with m.If(emit):
                m.d.sync += [idx.eq(0), first.eq(0)]
        with m.If(owe & room):
            # Close the frame whose last beat was lost; a beat completing now is lost.
            m.d.sync += [self.o.valid.eq(1), self.o.payload.beat.last.eq(1),
                         self.o.payload.beat.keep.eq(0), self.o.payload.beat.first.eq(0),
                         self.o.payload.drop.eq(RxDrop.OVERFLOW), owe.eq(0)]
        with m.If(emit & room & ~owe):
            out = self.o.payload
            verdict = Mux(byte.last & lost & (byte.drop == RxDrop.NONE),
                          RxDrop.OVERFLOW, byte.drop)
            keep = Cat(*(idx >= k for k in range(n)))
            m.d.sync += [
                self.o.valid.eq(1),
                out.beat.data.eq(Cat(*lanes)),
                out.beat.keep.eq(keep),
                out.beat.first.eq(first | start),
                out.beat.last.eq(byte.last),
                out.drop.eq(Mux(byte.last, verdict, RxDrop.NONE)),
            ]
            with m.If(byte.last):
                m.d.sync += lost.eq(0)
        with m.Elif(emit):
            with m.If(byte.last):
                m.d.sync += [owe.eq(1), lost.eq(0)]
            with m.Else():
                m.d.sync += lost.eq(1)
        return m
