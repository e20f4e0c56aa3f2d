"""Route a mover's AXI4 traffic to one port per address space, by the AR/AW ``user`` bit.

Responses come back from two independent memories, so a FIFO remembers which port each
burst went to and R/W/B are taken from that port in request order: the movers keep
their single-ID, in-order view.
"""

from __future__ import annotations

from amaranth.hdl import Module, Mux
from amaranth.lib import fifo, wiring
from amaranth.lib.wiring import In, Out

from .axi import AXI4Signature


class AxiSplit(wiring.Component):
    def __init__(self, width: int, *, depth: int = 32) -> None:
        self.width = width
        self.depth = depth
        super().__init__({
            "up": In(AXI4Signature(width, user_bits=1)),
            "host": Out(AXI4Signature(width)),
            "gpu": Out(AXI4Signature(width)),
        })

    def elaborate(self, platform) -> Module:
        m = Module()
        up, ports = self.up, (self.host, self.gpu)
        m.submodules.rq = rq = fifo.SyncFIFO(width=1, depth=self.depth)
        m.submodules.wq = wq = fifo.SyncFIFO(width=1, depth=self.depth)
        m.submodules.bq = bq = fifo.SyncFIFO(width=1, depth=self.depth)

        def route_addr(ch, q, *more):
            sel = getattr(up, ch).payload.user
            room = q.w_rdy
            for extra in more:
                room = room & extra.w_rdy
            for i, p in enumerate(ports):
                dn = getattr(p, ch)
                m.d.comb += [
                    dn.payload.addr.eq(getattr(up, ch).payload.addr),
                    dn.payload.len.eq(getattr(up, ch).payload.len),
                    dn.payload.size.eq(getattr(up, ch).payload.size),
                    dn.payload.burst.eq(getattr(up, ch).payload.burst),
                    dn.valid.eq(getattr(up, ch).valid & (sel == i) & room),
                ]
            fire = getattr(up, ch).valid & room & Mux(sel, getattr(ports[1], ch).ready,
                                                       getattr(ports[0], ch).ready)
            m.d.comb += getattr(up, ch).ready.eq(room & Mux(sel, getattr(ports[1], ch).ready,
                                                             getattr(ports[0], ch).ready))
            for q_ in (q, *more):
                m.d.comb += [q_.w_data.eq(sel), q_.w_en.eq(fire)]

        route_addr("ar", rq)
        route_addr("aw", wq, bq)

        def route_back(ch, q, pop_on_last):
            sel = q.r_data
            src_valid = Mux(sel, getattr(ports[1], ch).valid, getattr(ports[0], ch).valid)
            m.d.comb += [
                getattr(up, ch).valid.eq(q.r_rdy & src_valid),
                getattr(up, ch).payload.eq(Mux(sel, getattr(ports[1], ch).payload,
                                               getattr(ports[0], ch).payload)),
            ]
            for i, p in enumerate(ports):
                m.d.comb += getattr(p, ch).ready.eq(q.r_rdy & (sel == i)
                                                    & getattr(up, ch).ready)
            fire = getattr(up, ch).valid & getattr(up, ch).ready
            m.d.comb += q.r_en.eq(fire & (getattr(up, ch).payload.last if pop_on_last else 1))

        route_back("r", rq, True)
        route_back("b", bq, False)

        # W goes the way of its AW, which the bus lets lead its data.
        sel = wq.r_data
        for i, p in enumerate(ports):
            m.d.comb += [p.w.payload.eq(up.w.payload),
                         p.w.valid.eq(up.w.valid & wq.r_rdy & (sel == i))]
        m.d.comb += up.w.ready.eq(wq.r_rdy & Mux(sel, ports[1].w.ready, ports[0].w.ready))
        m.d.comb += wq.r_en.eq(up.w.valid & up.w.ready & up.w.payload.last)
        return m
