"""Write mover: segments + a packed beat stream -> AW/W bursts with strobes; B -> completions.

W beats are the input shifted to the bus alignment of the destination, so an unaligned
start or end is a partial strobe, never a read-modify-write. A descriptor completes when
the B of its last burst returns (the data is then visible to a later reader: the queue
engine relies on this to order a CQE before the completion flag).
"""

from __future__ import annotations

from amaranth.hdl import Cat, Const, Module, Mux, Signal
from amaranth.lib import data, fifo, stream, wiring
from amaranth.lib.wiring import In, Out

from .axi import BURST_INCR, AXI4WriteSignature, Resp
from .burst import BurstSplitter
from .layouts import CPL, LEN_BITS, SEG, TAG_BITS, Status, dma_beat_layout
from .read import compute_meta, desc_meta_layout

TRACK = data.StructLayout({
    "tag": TAG_BITS, "dlen": LEN_BITS, "status": 2,
    "last": 1,     # last burst of its descriptor
    "null": 1,     # no B will come (refused or zero-length descriptor)
})


class WriteMover(wiring.Component):
    def __init__(self, width: int, *, outstanding: int = 16) -> None:
        self.width = width
        self.outstanding = outstanding
        super().__init__({
            "seg": In(stream.Signature(SEG)),
            "data": In(stream.Signature(dma_beat_layout(width))),
            "bus": Out(AXI4WriteSignature(width, user_bits=1)),
            "cpl": Out(stream.Signature(CPL)),
            "max_outstanding": In(range(outstanding + 1), init=outstanding),
            "bus_error": Out(1),
            "inflight": Out(range(outstanding + 1)),
        })

    def elaborate(self, platform) -> Module:
        m = Module()
        w = self.width
        nb = w // 8
        nb_bits = (nb - 1).bit_length()
        mlay = desc_meta_layout(w)
        depth = self.outstanding + 2

        m.submodules.split = split = BurstSplitter(w)
        wiring.connect(m, wiring.flipped(self.seg), split.seg)
        m.submodules.meta = metaq = fifo.SyncFIFOBuffered(width=mlay.size, depth=depth)
        m.submodules.wlen = wlenq = fifo.SyncFIFOBuffered(width=8, depth=depth)
        m.submodules.track = trackq = fifo.SyncFIFOBuffered(width=TRACK.size, depth=2 * depth)
        m.submodules.poison = poisonq = fifo.SyncFIFOBuffered(width=1, depth=depth)

        # Front: AW per burst; W beat counts, per-descriptor meta and B tracking queued.
        inflight = Signal(range(self.outstanding + 1))
        aw = self.bus.aw
        b = split.burst.payload
        new_meta = Signal(mlay)
        compute_meta(m, w, b, new_meta)
        limit = Mux(self.max_outstanding == 0, 1, self.max_outstanding)
        can_issue = (~aw.valid | aw.ready) & (b.null | ((inflight < limit) & wlenq.w_rdy))
        take = (split.burst.valid & can_issue & trackq.w_rdy & (~b.dfirst | metaq.w_rdy))
        issue = Signal()
        trk_in = Signal(TRACK)
        m.d.comb += [
            split.burst.ready.eq(take),
            metaq.w_data.eq(new_meta), metaq.w_en.eq(take & b.dfirst),
            issue.eq(take & ~b.null),
            wlenq.w_data.eq(b.len), wlenq.w_en.eq(issue),
            trk_in.tag.eq(b.tag), trk_in.dlen.eq(b.dlen), trk_in.status.eq(b.status),
            trk_in.last.eq(b.dlast), trk_in.null.eq(b.null),
            trackq.w_data.eq(trk_in), trackq.w_en.eq(take),
        ]
        with m.If(aw.ready):
            m.d.sync += aw.valid.eq(0)
        with m.If(issue):
            m.d.sync += [
                aw.valid.eq(1),
                aw.payload.addr.eq(b.addr), aw.payload.len.eq(b.len),
                aw.payload.size.eq(nb_bits), aw.payload.burst.eq(BURST_INCR),
                aw.payload.user.eq(b.space),
            ]

        # W: shift packed input beats to the destination alignment.
        meta = Signal(mlay)
        m.d.comb += meta.eq(metaq.r_data)
        j = Signal(LEN_BITS)     # bus beat of this descriptor
        bb = Signal(8)           # beat within the current burst
        prev = Signal(w)
        poisoned = Signal()
        wo, din = self.bus.w, self.data
        with m.If(wo.ready):
            m.d.sync += wo.valid.eq(0)
        refused = meta.status != Status.OK
        with m.If(metaq.r_rdy & refused):
            # Nothing was issued: swallow the descriptor's beats so the stream stays framed.
            with m.If(j == meta.obeats):
                m.d.comb += metaq.r_en.eq(1)
                m.d.sync += j.eq(0)
            with m.Else():
                m.d.comb += din.ready.eq(1)
                with m.If(din.valid):
                    m.d.sync += j.eq(j + 1)
        with m.Elif(metaq.r_rdy & (meta.mbeats == 0)):
            m.d.comb += metaq.r_en.eq(1)   # zero-length: no beats either way
        with m.Elif(metaq.r_rdy & wlenq.r_rdy & (~wo.valid | wo.ready)):
            need_in = j < meta.obeats
            with m.If(~need_in | din.valid):
                m.d.comb += din.ready.eq(need_in)
                cur = Mux(need_in, din.payload.data, 0)
                bad = poisoned | (need_in & din.payload.err)
                strb = Signal(nb)
                m.d.comb += strb.eq(Mux(j == 0, meta.first_strb, (1 << nb) - 1)
                                    & Mux(j == meta.mbeats - 1, meta.last_strb, (1 << nb) - 1))
                sh = Cat(Const(0, 3), nb - meta.shift)
                wlast = bb == wlenq.r_data
                m.d.sync += [
                    wo.valid.eq(1),
                    wo.payload.data.eq((Cat(prev, cur) >> sh)[:w]),
                    wo.payload.strb.eq(Mux(bad, 0, strb)),
                    wo.payload.last.eq(wlast),
                    prev.eq(cur),
                    poisoned.eq(bad),
                    bb.eq(Mux(wlast, 0, bb + 1)),
                    j.eq(j + 1),
                ]
                m.d.comb += wlenq.r_en.eq(wlast)
                with m.If(j == meta.mbeats - 1):
                    m.d.comb += [metaq.r_en.eq(1), poisonq.w_en.eq(1), poisonq.w_data.eq(bad)]
                    m.d.sync += [j.eq(0), prev.eq(0), poisoned.eq(0)]

        # B: completions in order; a refused descriptor completes when it reaches the head.
        trk = Signal(TRACK)
        m.d.comb += trk.eq(trackq.r_data)
        c, bch = self.cpl, self.bus.b
        cpl_ok = ~c.valid | c.ready
        berr = Signal()
        with m.If(c.ready):
            m.d.sync += c.valid.eq(0)
        b_bad = bch.payload.resp != Resp.OKAY
        with m.If(trackq.r_rdy & trk.null), m.If(cpl_ok):
            m.d.comb += trackq.r_en.eq(1)
            m.d.sync += [c.valid.eq(1), c.payload.tag.eq(trk.tag),
                         c.payload.len.eq(trk.dlen), c.payload.status.eq(trk.status)]
        with m.Elif(trackq.r_rdy):
            m.d.comb += bch.ready.eq(cpl_ok & (~trk.last | poisonq.r_rdy))
            with m.If(bch.valid & bch.ready):
                m.d.comb += trackq.r_en.eq(1)
                with m.If(trk.last):
                    bad = berr | b_bad | poisonq.r_data
                    m.d.comb += poisonq.r_en.eq(1)
                    m.d.sync += [c.valid.eq(1), c.payload.tag.eq(trk.tag),
                                 c.payload.len.eq(trk.dlen),
                                 c.payload.status.eq(Mux(bad, Status.BUS_ERROR, Status.OK)),
                                 berr.eq(0)]
                with m.Else():
                    m.d.sync += berr.eq(berr | b_bad)

        bdone = bch.valid & bch.ready
        m.d.sync += self.bus_error.eq(bdone & b_bad)
        m.d.sync += inflight.eq(inflight + issue - bdone)
        m.d.comb += self.inflight.eq(inflight)
        return m
