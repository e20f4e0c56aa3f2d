"""The receive-path decompressor: :mod:`fpgaccl.proto.codec` bytes in, raw elements out."""

from __future__ import annotations

from amaranth.hdl import Cat, Module, Mux, Signal
from amaranth.lib import data, stream, wiring
from amaranth.lib.wiring import In, Out

from fpgaccl.proto.codec import BLOCK, HEADER_BYTES, Format

from ..stream.beat import beat_layout
from .block import beats_per_block, buffer_bytes, decode_block, header_length
from .encoder import keep_mask

__all__ = ["BlockDecoder", "coded_beat_layout", "decoded_beat_layout"]

COUNT_BITS = 32


def coded_beat_layout(width: int) -> data.StructLayout:
    """A beat of coded bytes; ``count`` (elements of the message) is read on its first beat."""
    return data.StructLayout({**beat_layout(width).members, "count": COUNT_BITS})


def decoded_beat_layout(width: int) -> data.StructLayout:
    """A beat of raw elements; ``error`` marks the empty last beat of a message whose
    coded bytes were malformed (what came before it is not to be used)."""
    return data.StructLayout({**beat_layout(width).members, "error": 1})


class BlockDecoder(wiring.Component):
    """Decodes each message of ``i`` (coded bytes, ``count`` on its first beat, at least
    one element) into ``o``: ``count`` raw elements of ``fmt``, the final beat partial.

    Coded bytes collect in a buffer; whenever the output register is free (or frees this
    cycle) and the buffer holds the next block whole, the block is decoded into it, then
    leaves a beat per cycle. A block's coded bytes are fewer than its raw bytes except in
    raw blocks, so ``o`` runs a beat per cycle while ``i`` keeps up. A header that
    cannot be (reserved bits, ``k`` or ``base`` too large, ``z`` without ``k`` or
    ``base``), a code past the exponent field, input ending short of ``count`` or going
    on past it: the rest of the message is dropped, ``o`` gets one empty last beat with
    ``error`` set and ``errors`` counts it.
    """

    def __init__(self, fmt: Format, width: int) -> None:
        self.fmt = fmt
        self.width = width
        self.beats = beats_per_block(fmt, width)
        self.buffer_bytes = buffer_bytes(fmt, width)
        super().__init__({"i": In(stream.Signature(coded_beat_layout(width))),
                          "o": Out(stream.Signature(decoded_beat_layout(width))),
                          "errors": Out(32)})

    def elaborate(self, platform) -> Module:
        m = Module()
        f, W, P = self.fmt, self.width, self.beats
        WB, EB = W // 8, f.bits // 8
        G = self.buffer_bytes

        buf = Signal(8 * G)
        fill = Signal(range(G + 1))
        active = Signal()              # a message's count is known
        in_done = Signal()             # its last coded beat is in
        blocks = Signal(COUNT_BITS)    # coded blocks still to decode
        tail = Signal(range(BLOCK))    # raw elements after them
        failed = Signal()              # malformed: drop to the input's last, then report

        out = Signal(BLOCK * f.bits)
        out_beats = Signal(range(P + 1))
        out_last_bytes = Signal(range(WB + 1))   # bytes of the final beat of this block
        out_final = Signal()                     # this block ends the message
        out_error = Signal()
        first = Signal(init=1)

        m.d.comb += [
            self.o.valid.eq(out_beats != 0),
            self.o.payload.data.eq(out[:W]),
            self.o.payload.first.eq(first),
            self.o.payload.last.eq(out_final & (out_beats == 1)),
            self.o.payload.error.eq(out_error),
            self.o.payload.keep.eq(Mux(out_beats == 1, keep_mask(out_last_bytes, WB),
                                       (1 << WB) - 1)),
        ]
        emitted = Signal()
        m.d.comb += emitted.eq(self.o.valid & self.o.ready)
        with m.If(emitted):
            m.d.sync += [out.eq(out >> W), out_beats.eq(out_beats - 1),
                         first.eq(self.o.payload.last)]
        free = Signal()
        m.d.comb += free.eq((out_beats == 0) | ((out_beats == 1) & self.o.ready))

        # the next step of the message: a block, or the raw tail
        need = Signal(range(G + 1))
        bad = Signal()
        length, bad_header = header_length(m, f, buf[:8 * HEADER_BYTES])
        raw, overflow = decode_block(m, f, buf[:8 * f.max_block_bytes])
        tail_bytes = Signal(range(BLOCK * EB))
        m.d.comb += tail_bytes.eq(tail * EB)
        with m.If(blocks != 0):
            m.d.comb += [need.eq(Mux(fill >= HEADER_BYTES, length, HEADER_BYTES)),
                         bad.eq((fill >= HEADER_BYTES) & bad_header
                                | (fill >= length) & overflow)]
        with m.Else():
            m.d.comb += need.eq(tail_bytes)
        remaining = Signal()
        m.d.comb += remaining.eq((blocks != 0) | (tail != 0))
        # the message's last step waits for all its input, so nothing can follow it
        final = Signal()
        m.d.comb += final.eq(Mux(blocks != 0, (blocks == 1) & (tail == 0), 1))
        step = Signal()
        m.d.comb += step.eq(active & ~failed & remaining & ~bad & (fill >= need) & free
                            & (~final | in_done & (fill == need)))
        short = in_done & remaining & (fill < need)
        extra = final & in_done & remaining & (fill > need)

        # coded bytes in
        m.d.comb += self.i.ready.eq(Mux(failed, ~in_done,
                                        ~in_done & (fill + WB <= G)))
        consumed = Signal(range(G + 1))
        arrived = Signal(range(WB + 1))
        m.d.comb += consumed.eq(Mux(step, need, 0))
        with m.If(self.i.valid & self.i.ready):
            m.d.comb += arrived.eq(Mux(failed, 0, sum(self.i.payload.keep)))
            m.d.sync += in_done.eq(self.i.payload.last)
            with m.If(~active):
                m.d.sync += [active.eq(1), blocks.eq(self.i.payload.count // BLOCK),
                             tail.eq(self.i.payload.count % BLOCK)]
        incoming = Signal(W)  # bytes past keep are not the stream's: zero where they join
        with m.If(arrived != 0):
            m.d.comb += incoming.eq(self.i.payload.data & Cat(
                *(self.i.payload.keep[j].replicate(8) for j in range(WB))))
        rest = Signal(8 * G)
        kept = Signal(range(G + 1))
        m.d.comb += [rest.eq(buf >> (consumed * 8)), kept.eq(fill - consumed)]
        m.d.sync += [buf.eq(rest | (incoming << (kept * 8))[:8 * G]),
                     fill.eq(kept + arrived)]

        with m.If(step):
            with m.If(blocks != 0):
                m.d.sync += [out.eq(raw), out_beats.eq(P), out_last_bytes.eq(WB),
                             blocks.eq(blocks - 1), out_final.eq((blocks == 1) & (tail == 0))]
            with m.Else():
                m.d.sync += [out.eq(buf[:len(out)]), tail.eq(0), out_final.eq(1),
                             out_beats.eq((tail_bytes + WB - 1) // WB),
                             out_last_bytes.eq(tail_bytes - (tail_bytes - 1) // WB * WB)]
            m.d.sync += out_error.eq(0)
        with m.Elif(active & ~failed & (bad | short | extra)):
            m.d.sync += [failed.eq(1), self.errors.eq(self.errors + 1)]

        # a message ends when its last step is taken and its input is all in
        with m.If(active & ~failed & in_done & ~remaining & (fill == 0)):
            m.d.sync += [active.eq(0), in_done.eq(0)]
        with m.If(failed & in_done & free):
            m.d.sync += [failed.eq(0), active.eq(0), in_done.eq(0), fill.eq(0), buf.eq(0),
                         blocks.eq(0), tail.eq(0), out_beats.eq(1), out_final.eq(1),
                         out_last_bytes.eq(0), out_error.eq(1)]
        return m
