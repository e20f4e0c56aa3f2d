"""Read mover: segments -> AR bursts; R beats -> a packed beat stream + completions.

Up to ``max_outstanding`` bursts in flight (a runtime limit no larger than the build's
``outstanding``); one ID, so data returns in request order and needs no reorder buffer.
R is back-pressured straight from the output, so a stalled consumer stalls the bus
rather than overflowing anything.
"""

from __future__ import annotations

from amaranth.hdl import Cat, Const, Module, Mux, Signal
from amaranth.lib import data, fifo, stream, wiring
from amaranth.lib.wiring import In, Out

from .axi import BURST_INCR, AXI4ReadSignature, Resp
from .burst import BurstSplitter
from .layouts import CPL, LEN_BITS, SEG, TAG_BITS, Status, dma_beat_layout


def desc_meta_layout(width: int) -> data.StructLayout:
    nb = width // 8
    return data.StructLayout({
        "tag": TAG_BITS,
        "dlen": LEN_BITS,
        "status": 2,
        "shift": max((nb - 1).bit_length(), 1),
        "obeats": LEN_BITS,      # beats on the packed side
        "mbeats": LEN_BITS,      # bus beats
        "last_keep": nb,         # keep of the last packed beat
        "first_strb": nb,
        "last_strb": nb,
    })


def compute_meta(m: Module, width: int, burst, meta) -> None:
    """Per-descriptor counts and masks, from the descriptor's first burst."""
    nb = width // 8
    nb_bits = (nb - 1).bit_length()
    dlen, shift = burst.dlen, burst.shift
    rem = Signal(nb_bits + 1)
    end = Signal(nb_bits + 1)
    m.d.comb += [
        rem.eq(((dlen - 1) & (nb - 1)) + 1),
        end.eq((shift + dlen) & (nb - 1)),
        meta.tag.eq(burst.tag), meta.dlen.eq(dlen), meta.status.eq(burst.status),
        meta.shift.eq(shift),
        meta.obeats.eq((dlen + nb - 1) >> nb_bits),
        meta.mbeats.eq(Mux(dlen == 0, 0, (shift + dlen + nb - 1) >> nb_bits)),
        meta.last_keep.eq(((Const(1, nb + 1) << rem) - 1)[:nb]),
        meta.first_strb.eq((Const((1 << nb) - 1, nb) << shift)[:nb]),
        meta.last_strb.eq(Mux(end == 0, (1 << nb) - 1, ((Const(1, nb + 1) << end) - 1)[:nb])),
    ]


class ReadMover(wiring.Component):
    def __init__(self, width: int, *, outstanding: int = 16) -> None:
        self.width = width
        self.outstanding = outstanding
        super().__init__({
            "seg": In(stream.Signature(SEG)),
            "bus": Out(AXI4ReadSignature(width, user_bits=1)),
            "data": Out(stream.Signature(dma_beat_layout(width))),
            "cpl": Out(stream.Signature(CPL)),
            "max_outstanding": In(range(outstanding + 1), init=outstanding),
            "bus_error": Out(1),    # pulse per burst answered with an error
            "inflight": Out(range(outstanding + 1)),
        })

    def elaborate(self, platform) -> Module:
        m = Module()
        w = self.width
        nb = w // 8
        nb_bits = (nb - 1).bit_length()
        mlay = desc_meta_layout(w)

        m.submodules.split = split = BurstSplitter(w)
        wiring.connect(m, wiring.flipped(self.seg), split.seg)
        m.submodules.meta = metaq = fifo.SyncFIFOBuffered(width=mlay.size,
                                                          depth=self.outstanding + 2)

        # Front: one AR per cycle while under the outstanding limit.
        inflight = Signal(range(self.outstanding + 1))
        ar = self.bus.ar
        b = split.burst.payload
        new_meta = Signal(mlay)
        compute_meta(m, w, b, new_meta)
        limit = Mux(self.max_outstanding == 0, 1, self.max_outstanding)
        can_issue = (~ar.valid | ar.ready) & (b.null | (inflight < limit))
        take = split.burst.valid & can_issue & (~b.dfirst | metaq.w_rdy)
        issue = Signal()
        m.d.comb += [
            split.burst.ready.eq(take),
            metaq.w_data.eq(new_meta), metaq.w_en.eq(take & b.dfirst),
            issue.eq(take & ~b.null),
        ]
        with m.If(ar.ready):
            m.d.sync += ar.valid.eq(0)
        with m.If(issue):
            m.d.sync += [
                ar.valid.eq(1),
                ar.payload.addr.eq(b.addr), ar.payload.len.eq(b.len),
                ar.payload.size.eq(nb_bits), ar.payload.burst.eq(BURST_INCR),
                ar.payload.user.eq(b.space),
            ]

        # Back: realign bus words into packed beats.
        meta = Signal(mlay)
        m.d.comb += meta.eq(metaq.r_data)
        have = metaq.r_rdy
        j = Signal(LEN_BITS)       # bus beats taken for this descriptor
        k = Signal(LEN_BITS)       # packed beats emitted
        prev = Signal(w)
        flush = Signal()
        err = Signal()
        r, o, c = self.bus.r, self.data, self.cpl
        load_ok = ~o.valid | o.ready
        cpl_ok = ~c.valid | c.ready
        with m.If(o.ready):
            m.d.sync += o.valid.eq(0)
        with m.If(c.ready):
            m.d.sync += c.valid.eq(0)

        refused = meta.status != Status.OK
        finished = (k == meta.obeats) & (refused | ((j == meta.mbeats) & ~flush))

        def emit(value, beat_err):
            m.d.sync += [
                o.valid.eq(1),
                o.payload.data.eq(value),
                o.payload.keep.eq(Mux(k == meta.obeats - 1, meta.last_keep, (1 << nb) - 1)),
                o.payload.first.eq(k == 0),
                o.payload.last.eq(k == meta.obeats - 1),
                o.payload.err.eq(beat_err),
                k.eq(k + 1),
            ]

        sh = Cat(Const(0, 3), meta.shift)
        r_bad = r.payload.resp[1]  # SLVERR / DECERR
        m.d.comb += r.ready.eq(have & ~refused & load_ok & (j < meta.mbeats) & ~flush)
        rx = r.valid & r.ready
        with m.If(have & finished), m.If(cpl_ok):
            m.d.comb += metaq.r_en.eq(1)
            m.d.sync += [
                c.valid.eq(1), c.payload.tag.eq(meta.tag), c.payload.len.eq(meta.dlen),
                c.payload.status.eq(Mux(refused, meta.status,
                                        Mux(err, Status.BUS_ERROR, Status.OK))),
                j.eq(0), k.eq(0), err.eq(0), prev.eq(0),
            ]
        with m.Elif(have & refused), m.If(load_ok):
            emit(0, 1)
        with m.Elif(have & flush), m.If(load_ok):
            emit((Cat(prev, Const(0, w)) >> sh)[:w], err)
            m.d.sync += flush.eq(0)
        with m.Elif(rx):
            beat_err = err | r_bad
            m.d.sync += [j.eq(j + 1), prev.eq(r.payload.data), err.eq(beat_err)]
            with m.If(meta.shift == 0):
                emit(r.payload.data, beat_err)
            with m.Elif(j != 0):
                emit((Cat(prev, r.payload.data) >> sh)[:w], beat_err)
                with m.If((j == meta.mbeats - 1) & (meta.obeats == meta.mbeats)):
                    m.d.sync += flush.eq(1)
            with m.Elif(meta.mbeats == 1):
                emit((Cat(r.payload.data, Const(0, w)) >> sh)[:w], beat_err)

        # A burst ends with its last R beat; a bus error is counted once per burst.
        rdone = r.valid & r.ready & r.payload.last
        m.d.sync += self.bus_error.eq(rdone & (r.payload.resp != Resp.OKAY))
        m.d.sync += inflight.eq(inflight + issue - rdone)
        m.d.comb += self.inflight.eq(inflight)
        return m
