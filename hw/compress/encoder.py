"""The send-path compressor: raw elements in, :mod:`fpgaccl.proto.codec` bytes out."""

from __future__ import annotations

from amaranth.hdl import Cat, Module, Mux, Signal
from amaranth.lib import stream, wiring
from amaranth.lib.wiring import In, Out

from fpgaccl.proto.codec import BLOCK, Format

from ..stream.beat import beat_layout
from .block import beats_per_block, buffer_bytes, encode_block

__all__ = ["BlockEncoder"]


def keep_mask(count: Signal, nbytes: int) -> Signal:
    """``nbytes`` keep bits with the first ``count`` set."""
    return Cat(*(count > j for j in range(nbytes)))


class BlockEncoder(wiring.Component):
    """Codes each message of ``i`` (raw elements of ``fmt``, ``first``..``last``; keep a
    prefix of whole elements, only the last beat partial, at least one element) into
    ``o``: its coded blocks, then its remaining elements raw, packed into beats with the
    final one partial and marked last.

    A block is gathered beat by beat, coded from a register the cycle after it fills
    (while the next block gathers), and appended to a byte buffer that ``o`` drains a
    beat at a time. ``i`` takes a beat every cycle while ``o`` takes one: a block's coded
    bytes are never more than its raw bytes plus the 2-byte header, and the buffer has
    room for some backlog; a long run of raw blocks makes ``i`` wait for the 2 bytes each
    adds (``bench/codec_hdl.py``: 0.988 beats per cycle at 512 bits on random bits).
    """

    def __init__(self, fmt: Format, width: int) -> None:
        self.fmt = fmt
        self.width = width
        self.beats = beats_per_block(fmt, width)
        self.buffer_bytes = buffer_bytes(fmt, width)
        super().__init__({"i": In(stream.Signature(beat_layout(width))),
                          "o": Out(stream.Signature(beat_layout(width)))})

    def elaborate(self, platform) -> Module:
        m = Module()
        f, W, P = self.fmt, self.width, self.beats
        WB, EB = self.width // 8, f.bits // 8
        block_bytes = BLOCK * EB

        # gather
        acc = Signal(BLOCK * f.bits)
        beat = Signal(range(P))
        pend = Signal(BLOCK * f.bits)
        pend_valid = Signal()
        pend_tail = Signal()       # a message's last elements: raw, no header
        pend_bytes = Signal(range(block_bytes + 1))
        pend_last = Signal()
        taken = Signal()           # the buffer takes the pending block this cycle

        valid_bytes = Signal(range(WB + 1))
        m.d.comb += valid_bytes.eq(sum(self.i.payload.keep))
        completes = (beat == P - 1) | self.i.payload.last
        m.d.comb += self.i.ready.eq(~pend_valid | ~completes)
        merged = Signal.like(acc)
        m.d.comb += merged.eq(acc)
        with m.Switch(beat):
            for b in range(P):
                with m.Case(b):
                    m.d.comb += merged[b * W:(b + 1) * W].eq(self.i.payload.data)
        with m.If(self.i.valid & self.i.ready):
            m.d.sync += acc.eq(merged)
            with m.If(completes):
                total = Signal(range(block_bytes + 1))
                m.d.comb += total.eq(beat * WB + valid_bytes)
                m.d.sync += [beat.eq(0), pend_valid.eq(1), pend_last.eq(self.i.payload.last),
                             pend_bytes.eq(total), pend_tail.eq(total != block_bytes)]
                # bytes past a tail's end must be zero where they join the buffer
                for j in range(block_bytes):
                    m.d.sync += pend[8 * j:8 * j + 8].eq(
                        merged[8 * j:8 * j + 8] & (total > j).replicate(8))
            with m.Else():
                m.d.sync += beat.eq(beat + 1)
        with m.If(taken):
            m.d.sync += pend_valid.eq(0)

        # code
        chunk, chunk_bytes = encode_block(m, f, pend)
        add = Signal(len(chunk))
        add_bytes = Signal(range(f.max_block_bytes + 1))
        with m.If(pend_tail):
            m.d.comb += [add.eq(pend), add_bytes.eq(pend_bytes)]
        with m.Else():
            m.d.comb += [add.eq(chunk), add_bytes.eq(chunk_bytes)]

        # pack
        G = self.buffer_bytes
        buf = Signal(8 * G)
        fill = Signal(range(G + 1))
        flush = Signal()           # a message's last bytes are in: drain, then mark last
        out_bytes = Signal(range(WB + 1))
        m.d.comb += [
            out_bytes.eq(Mux(fill >= WB, WB, fill)),
            self.o.valid.eq((fill >= WB) | (flush & (fill != 0))),
            self.o.payload.data.eq(buf[:W]),
            self.o.payload.keep.eq(keep_mask(out_bytes, WB)),
            self.o.payload.last.eq(flush & (fill <= WB)),
            taken.eq(pend_valid & ~flush & (fill + add_bytes <= G)),
        ]
        first = Signal(init=1)
        m.d.comb += self.o.payload.first.eq(first)
        sent = Signal(range(WB + 1))
        with m.If(self.o.valid & self.o.ready):
            m.d.comb += sent.eq(out_bytes)
            m.d.sync += first.eq(self.o.payload.last)
            with m.If(self.o.payload.last):
                m.d.sync += flush.eq(0)
        rest = Signal(8 * G)
        kept = Signal(range(G + 1))
        m.d.comb += [rest.eq(buf >> (sent * 8)), kept.eq(fill - sent)]
        with m.If(taken):
            m.d.sync += [buf.eq(rest | (add << (kept * 8))[:8 * G]),
                         fill.eq(kept + add_bytes), flush.eq(pend_last)]
        with m.Else():
            m.d.sync += [buf.eq(rest), fill.eq(fill - sent)]
        return m
