"""Glue between the node's simple memory ports and the DMA movers, and an AXI4 arbiter
that lets two managers share one memory port.

Address spaces: the simple ports carry one 64-bit address, and bit
:data:`~fpgaccl.proto.queues.NODE_SPACE_BIT` (63) of it names the space: clear = host
IOVA (checked against the host windows), set = GPU VA in the peer window (the page
table). The runtime tags GPU buffers with :func:`fpgaccl.proto.queues.node_addr` wherever
it gives the node an address, so the sequencer, the transport and the engines stay
unaware of spaces, and an RDMA WRITE from a peer lands in GPU memory when the peer was
handed a tagged address.

Reads map one to one: a request becomes a read descriptor; the read mover's packed
beats are the answer (a refused read still answers with zero beats, so the requester
never hangs; the fault is reported on ``fault``). Writes arrive as beats with their own
addresses and only ``last`` says where a burst ends, so :class:`WriteAdapter` buffers
the beats and issues one descriptor per contiguous run once it is closed.

Ordering: the simple port promised that a read issued after a write sees it (the
transport writes a packet, the sequencer then reduces it). The movers give no such
order between their AR and AW channels, so :class:`ReadAdapter` holds read requests
while any closed write burst has not had its B response (``fence``).
"""

from __future__ import annotations

from amaranth.hdl import Const, Module, Mux, Signal
from amaranth.lib import fifo, stream, wiring
from amaranth.lib.wiring import In, Out

from fpgaccl.hw.stream.beat import beat_stream
from fpgaccl.hw.transport.layouts import MEM_READ_REQ, mem_write_layout
from fpgaccl.proto.queues import NODE_SPACE_BIT

from .axi import AXI4Signature
from .layouts import CPL, DESC, Status, dma_beat_layout, host_ctl_layout
from .read import ReadMover
from .split import AxiSplit
from .translate import Translator
from .write import WriteMover


def _fault(m: Module, cpl, fault, fault_status) -> None:
    """Completions are only watched for their status: always accepted."""
    m.d.comb += cpl.ready.eq(1)
    m.d.sync += fault.eq(cpl.valid & (cpl.payload.status != Status.OK))
    with m.If(cpl.valid):
        m.d.sync += fault_status.eq(cpl.payload.status)


class ReadAdapter(wiring.Component):
    """Simple read requests -> read-mover descriptors; mover beats -> the answer."""

    def __init__(self, width: int) -> None:
        self.width = width
        super().__init__({
            "req": In(stream.Signature(MEM_READ_REQ)),
            "resp": Out(beat_stream(width)),
            "desc": Out(stream.Signature(DESC)),
            "data": In(stream.Signature(dma_beat_layout(width))),
            "cpl": In(stream.Signature(CPL)),
            "fence": In(1),         # hold new requests (writes not yet acknowledged)
            "fault": Out(1),        # pulse: a read completed with fault_status != OK
            "fault_status": Out(2),
        })

    def elaborate(self, platform) -> Module:
        m = Module()
        d, r = self.desc, self.req
        with m.If(d.ready):
            m.d.sync += d.valid.eq(0)
        m.d.comb += r.ready.eq((~d.valid | d.ready) & ~self.fence)
        with m.If(r.valid & r.ready):
            m.d.sync += [
                d.valid.eq(1),
                d.payload.space.eq(r.payload.addr[NODE_SPACE_BIT]),
                d.payload.addr.eq(r.payload.addr[:NODE_SPACE_BIT]),
                d.payload.len.eq(r.payload.len),
                d.payload.tag.eq(0),
            ]
        m.d.comb += [
            self.resp.valid.eq(self.data.valid),
            self.resp.payload.data.eq(self.data.payload.data),
            self.resp.payload.keep.eq(self.data.payload.keep),
            self.resp.payload.first.eq(self.data.payload.first),
            self.resp.payload.last.eq(self.data.payload.last),
            self.data.ready.eq(self.resp.ready),
        ]
        _fault(m, self.cpl, self.fault, self.fault_status)
        return m


class WriteAdapter(wiring.Component):
    """Per-beat-addressed write bursts -> write-mover descriptors + packed data.

    A descriptor covers a run of beats that are contiguous (each beat's address is the
    previous one's plus its byte count) and closes at ``last``, after a beat that is not
    full (the movers' packed beats are full but for the last), before a beat that is
    not contiguous, or at ``max_bytes``. Beats wait in a FIFO of two runs, so the next
    run fills while the mover drains one; a run's bytes go out only after it closed.
    Beats without a byte (``keep`` 0) are dropped: there is nothing to write.
    """

    def __init__(self, width: int, max_bytes: int = 4096) -> None:
        nb = width // 8
        if max_bytes % nb:
            raise ValueError("max_bytes must be whole beats")
        self.width, self.max_bytes = width, max_bytes
        self.max_beats = max_bytes // nb
        super().__init__({
            "wr": In(stream.Signature(mem_write_layout(width))),
            "desc": Out(stream.Signature(DESC)),
            "data": Out(stream.Signature(dma_beat_layout(width))),
            "cpl": In(stream.Signature(CPL)),
            "pending": Out(1),      # a closed run has not been acknowledged yet
            "idle": Out(1),         # every beat taken is in memory (or refused)
            "fault": Out(1),
            "fault_status": Out(2),
        })

    def elaborate(self, platform) -> Module:
        m = Module()
        w = self.width
        nb = w // 8
        blay = dma_beat_layout(w)
        m.submodules.beats = beats = fifo.SyncFIFOBuffered(width=blay.size,
                                                           depth=2 * self.max_beats)
        m.submodules.descs = descs = fifo.SyncFIFOBuffered(width=DESC.size, depth=4)

        is_open = Signal()
        start = Signal(64)
        nbytes = Signal(range(self.max_bytes + 1))
        nbeats = Signal(range(self.max_beats + 1))
        outstanding = Signal(16)

        p = self.wr.payload
        count = Signal(range(nb + 1))
        m.d.comb += count.eq(sum(p.keep[i] for i in range(nb)))
        full = p.keep == (1 << nb) - 1
        has_bytes = p.keep != 0
        breaks = is_open & (p.addr != start + nbytes)

        new_desc = Signal(DESC)
        m.d.comb += [descs.w_data.eq(new_desc),
                     new_desc.space.eq(start[NODE_SPACE_BIT]),
                     new_desc.addr.eq(start[:NODE_SPACE_BIT]),
                     new_desc.len.eq(nbytes)]

        beat = Signal(blay)
        m.d.comb += [beat.data.eq(p.data), beat.keep.eq(p.keep), beat.first.eq(~is_open),
                     beat.err.eq(0), beats.w_data.eq(beat)]

        # A beat that breaks the run closes it first and starts the next a cycle later.
        with m.If(self.wr.valid & breaks), m.If(descs.w_rdy):
            m.d.comb += descs.w_en.eq(1)
            m.d.sync += is_open.eq(0)
        with m.Elif(self.wr.valid & ~has_bytes):
            # Nothing to write; a `last` still ends the open run.
            m.d.comb += self.wr.ready.eq(~p.last | ~is_open | descs.w_rdy)
            with m.If(p.last & is_open & descs.w_rdy):
                m.d.comb += descs.w_en.eq(1)
                m.d.sync += is_open.eq(0)
        with m.Elif(self.wr.valid):
            closes = p.last | ~full | (nbeats + 1 == self.max_beats)
            m.d.comb += [
                self.wr.ready.eq(beats.w_rdy & (~closes | descs.w_rdy)),
                beat.last.eq(closes),
            ]
            with m.If(self.wr.ready):
                m.d.comb += beats.w_en.eq(1)
                with m.If(~is_open):
                    m.d.sync += [start.eq(p.addr), nbytes.eq(count), nbeats.eq(1),
                                 is_open.eq(~closes)]
                    m.d.comb += new_desc.addr.eq(p.addr[:NODE_SPACE_BIT])
                    m.d.comb += new_desc.space.eq(p.addr[NODE_SPACE_BIT])
                    m.d.comb += new_desc.len.eq(count)
                with m.Else():
                    m.d.sync += [nbytes.eq(nbytes + count), nbeats.eq(nbeats + 1),
                                 is_open.eq(~closes)]
                    m.d.comb += new_desc.len.eq(nbytes + count)
                m.d.comb += descs.w_en.eq(closes)

        m.d.comb += [
            self.desc.valid.eq(descs.r_rdy), self.desc.payload.eq(descs.r_data),
            descs.r_en.eq(self.desc.ready),
            self.data.valid.eq(beats.r_rdy), self.data.payload.eq(beats.r_data),
            beats.r_en.eq(self.data.ready),
        ]
        # Runs closed and not yet acknowledged (a refused run completes too, so the
        # count always returns to zero).
        m.d.sync += outstanding.eq(outstanding + descs.w_en - (self.cpl.valid & self.cpl.ready))
        m.d.comb += [self.pending.eq(outstanding != 0),
                     self.idle.eq((outstanding == 0) & ~is_open)]
        _fault(m, self.cpl, self.fault, self.fault_status)
        return m


class AxiArbiter(wiring.Component):
    """Two AXI4 managers onto one subordinate port, bursts interleaved, responses routed
    back in order (single ID: the subordinate answers in request order per channel).

    AR and AW are granted round-robin into registered outputs; which manager each went
    to is queued, and R (until ``last``), W (its own ``last``) and B follow the queues.
    ``depth`` bounds the bursts in flight per direction.
    """

    def __init__(self, width: int, *, depth: int = 32) -> None:
        self.width, self.depth = width, depth
        super().__init__({
            "m0": In(AXI4Signature(width)),
            "m1": In(AXI4Signature(width)),
            "s": Out(AXI4Signature(width)),
        })

    def elaborate(self, platform) -> Module:
        m = Module()
        mgrs = (self.m0, self.m1)
        s = self.s
        m.submodules.rq = rq = fifo.SyncFIFOBuffered(width=1, depth=self.depth)
        m.submodules.wq = wq = fifo.SyncFIFOBuffered(width=1, depth=self.depth)
        m.submodules.bq = bq = fifo.SyncFIFOBuffered(width=1, depth=self.depth)

        def grant(ch: str, queues) -> None:
            out = getattr(s, ch)
            ins = [getattr(mg, ch) for mg in mgrs]
            prefer1 = Signal(name=f"{ch}_prefer1")
            room = Const(1)
            for q in queues:
                room = room & q.w_rdy
            can = (~out.valid | out.ready) & room
            pick1 = ins[1].valid & (prefer1 | ~ins[0].valid)
            with m.If(out.ready):
                m.d.sync += out.valid.eq(0)
            with m.If(can & (ins[0].valid | ins[1].valid)):
                m.d.comb += [ins[0].ready.eq(~pick1), ins[1].ready.eq(pick1)]
                m.d.sync += [out.valid.eq(1), prefer1.eq(~pick1),
                             out.payload.eq(Mux(pick1, ins[1].payload, ins[0].payload))]
                for q in queues:
                    m.d.comb += [q.w_en.eq(1), q.w_data.eq(pick1)]

        grant("ar", (rq,))
        grant("aw", (wq, bq))

        # R and B back to whoever asked first.
        for ch, q, on_last in (("r", rq, True), ("b", bq, False)):
            up = getattr(s, ch)
            for i, mg in enumerate(mgrs):
                mine = q.r_rdy & (q.r_data == i)
                m.d.comb += [getattr(mg, ch).valid.eq(up.valid & mine),
                             getattr(mg, ch).payload.eq(up.payload)]
                with m.If(mine):
                    m.d.comb += up.ready.eq(getattr(mg, ch).ready)
            fire = up.valid & up.ready
            m.d.comb += q.r_en.eq(fire & (up.payload.last if on_last else 1))

        # W from whoever's AW is oldest without its data.
        for i, mg in enumerate(mgrs):
            with m.If(wq.r_rdy & (wq.r_data == i)):
                m.d.comb += [s.w.valid.eq(mg.w.valid), s.w.payload.eq(mg.w.payload),
                             mg.w.ready.eq(s.w.ready)]
        m.d.comb += wq.r_en.eq(s.w.valid & s.w.ready & s.w.payload.last)
        return m


class NodeMemory(wiring.Component):
    """The node's simple ports onto the two address spaces: the adapters, a translator
    and a mover per direction (one translator per mover, as the queue engine has them:
    see :mod:`.translate`), and a split onto one AXI4 port per space.

    The translation setup (host windows, GPU window base, page table) is the queue
    engine's: both read the same registers; ``pte_addr``/``pte_data`` is a page-table
    read port of this block's own (answering a cycle later), which its two translators
    share on alternate cycles.
    """

    def __init__(self, width: int, *, host_windows: int = 4, gpu_pages: int = 256,
                 outstanding: int = 16, max_bytes: int = 4096) -> None:
        self.width, self.host_windows, self.gpu_pages = width, host_windows, gpu_pages
        self.outstanding, self.max_bytes = outstanding, max_bytes
        super().__init__({
            "rd_req": In(stream.Signature(MEM_READ_REQ)),
            "rd_resp": Out(beat_stream(width)),
            "wr": In(stream.Signature(mem_write_layout(width))),
            "host": Out(AXI4Signature(width)),
            "gpu": Out(AXI4Signature(width)),
            "host_win": In(host_ctl_layout(host_windows)),
            "gpu_va": In(64),
            "pte_addr": Out(range(gpu_pages)),
            "pte_data": In(32),
            "max_rd": In(range(outstanding + 1), init=outstanding),
            "max_wr": In(range(outstanding + 1), init=outstanding),
            # Pulses for the fault counters (per refused descriptor, per bad burst).
            "unmapped": Out(1),
            "forbidden": Out(1),
            "bus_error": Out(1),
            # Every write taken is acknowledged: what the node wrote is visible.
            "writes_idle": Out(1),
            # Pulse per descriptor completed with a fault (status in fault_status).
            "fault": Out(1),
            "fault_status": Out(2),
        })

    def elaborate(self, platform) -> Module:
        m = Module()
        w = self.width
        m.submodules.rda = rda = ReadAdapter(w)
        m.submodules.wra = wra = WriteAdapter(w, self.max_bytes)
        m.submodules.xl_rd = xr = Translator(host_windows=self.host_windows,
                                             gpu_pages=self.gpu_pages)
        m.submodules.xl_wr = xw = Translator(host_windows=self.host_windows,
                                             gpu_pages=self.gpu_pages)
        m.submodules.rd = rd = ReadMover(w, outstanding=self.outstanding)
        m.submodules.wr = wr = WriteMover(w, outstanding=self.outstanding)
        m.submodules.split = split = AxiSplit(w, depth=2 * self.outstanding)

        wiring.connect(m, wiring.flipped(self.rd_req), rda.req)
        wiring.connect(m, rda.resp, wiring.flipped(self.rd_resp))
        wiring.connect(m, wiring.flipped(self.wr), wra.wr)
        wiring.connect(m, rda.desc, xr.rd_req)
        wiring.connect(m, wra.desc, xw.wr_req)
        wiring.connect(m, xr.rd_seg, rd.seg)
        wiring.connect(m, xw.wr_seg, wr.seg)
        wiring.connect(m, rd.data, rda.data)
        wiring.connect(m, rd.cpl, rda.cpl)
        wiring.connect(m, wra.data, wr.data)
        wiring.connect(m, wr.cpl, wra.cpl)
        m.d.comb += [rda.fence.eq(wra.pending), self.writes_idle.eq(wra.idle)]

        wiring.connect(m, rd.bus.ar, split.up.ar)
        wiring.connect(m, split.up.r, rd.bus.r)
        wiring.connect(m, wr.bus.aw, split.up.aw)
        wiring.connect(m, wr.bus.w, split.up.w)
        wiring.connect(m, split.up.b, wr.bus.b)
        wiring.connect(m, split.host, wiring.flipped(self.host))
        wiring.connect(m, split.gpu, wiring.flipped(self.gpu))

        turn = Signal()
        m.d.sync += turn.eq(~turn)
        for xl, mine in ((xr, ~turn), (xw, turn)):
            m.d.comb += [xl.host.eq(self.host_win), xl.gpu_va.eq(self.gpu_va),
                         xl.pte_data.eq(self.pte_data), xl.pte_grant.eq(mine)]
        m.d.comb += self.pte_addr.eq(Mux(turn, xw.pte_addr, xr.pte_addr))
        for mover, limit in ((rd, self.max_rd), (wr, self.max_wr)):
            m.d.comb += mover.max_outstanding.eq(
                Mux(limit > self.outstanding, self.outstanding, limit))

        m.d.comb += [self.unmapped.eq(xr.unmapped | xw.unmapped),
                     self.forbidden.eq(xr.forbidden | xw.forbidden),
                     self.bus_error.eq(rd.bus_error | wr.bus_error),
                     self.fault.eq(rda.fault | wra.fault),
                     self.fault_status.eq(Mux(rda.fault, rda.fault_status,
                                              wra.fault_status))]
        return m


__all__ = ["AxiArbiter", "NodeMemory", "ReadAdapter", "WriteAdapter"]
