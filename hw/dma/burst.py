"""Segments -> bursts: the address half shared by the read and the write mover.

A burst never crosses a 4 KiB boundary (AXI4's rule) nor exceeds 256 beats; it starts
at the bus-aligned address below the segment's first byte (the movers realign data).
"""

from __future__ import annotations

from amaranth.hdl import Module, Mux, Signal
from amaranth.lib import data, stream, wiring
from amaranth.lib.wiring import In, Out

from .layouts import LEN_BITS, SEG, TAG_BITS

BOUNDARY = 4096


def burst_bytes(width: int) -> int:
    return min(BOUNDARY, 256 * width // 8)


def burst_layout(width: int) -> data.StructLayout:
    nb_bits = (width // 8 - 1).bit_length()
    return data.StructLayout({
        "addr": 64,        # bus-aligned
        "len": 8,          # beats - 1
        "space": 1,
        "null": 1,         # no bus transaction: a refused or zero-length descriptor
        "dfirst": 1,       # first burst of its descriptor
        "dlast": 1,
        "tag": TAG_BITS,
        "dlen": LEN_BITS,
        "shift": max(nb_bits, 1),  # the descriptor's first byte within a bus word
        "status": 2,
    })


class BurstSplitter(wiring.Component):
    """One burst per cycle while a segment lasts; one idle cycle to load each segment
    (segments are a whole host descriptor or a 64 KiB GPU page, so that cycle is noise).
    """

    def __init__(self, width: int) -> None:
        self.width = width
        super().__init__({
            "seg": In(stream.Signature(SEG)),
            "burst": Out(stream.Signature(burst_layout(width))),
        })

    def elaborate(self, platform) -> Module:
        m = Module()
        nb = self.width // 8
        nb_bits = (nb - 1).bit_length()
        bb = burst_bytes(self.width)
        bb_bits = (bb - 1).bit_length()

        active = Signal()
        at_first = Signal()
        cur = Signal(64)
        rem = Signal(LEN_BITS)
        seg = Signal(SEG)
        shift = Signal(max(nb_bits, 1))

        room = Signal(bb_bits + 1)
        blen = Signal(LEN_BITS)
        beats = Signal(LEN_BITS + 1)
        m.d.comb += [
            room.eq(bb - cur[:bb_bits]),
            blen.eq(Mux(rem < room, rem, room)),
            beats.eq((cur[:nb_bits] + blen + nb - 1) >> nb_bits),
        ]
        out = self.burst
        with m.If(out.ready):
            m.d.sync += out.valid.eq(0)
        with m.If(~out.valid | out.ready):
            with m.If(active):
                done = blen == rem
                m.d.sync += [
                    out.valid.eq(1),
                    out.payload.addr.eq(cur & ~(nb - 1)),
                    out.payload.len.eq(beats - 1),
                    out.payload.space.eq(seg.space),
                    out.payload.null.eq(rem == 0),
                    out.payload.dfirst.eq(at_first),
                    out.payload.dlast.eq(seg.last & done),
                    out.payload.tag.eq(seg.tag),
                    out.payload.dlen.eq(seg.dlen),
                    out.payload.shift.eq(shift),
                    out.payload.status.eq(seg.status),
                    cur.eq(cur + blen),
                    rem.eq(rem - blen),
                    at_first.eq(0),
                ]
                with m.If(done):
                    m.d.sync += active.eq(0)
            with m.Else():
                m.d.comb += self.seg.ready.eq(1)
                with m.If(self.seg.valid):
                    p = self.seg.payload
                    m.d.sync += [active.eq(1), at_first.eq(p.first), cur.eq(p.addr),
                                 rem.eq(p.len), seg.eq(p)]
                    with m.If(p.first):
                        m.d.sync += shift.eq(p.addr[:nb_bits] if nb_bits else 0)
        return m
