"""The DMA engine: submission/completion queues in memory, doorbells, the GPU
completion flag, around the translator and the two movers.

Work flow, one work request at a time (queue processing is not the bandwidth path; the
movers are): the doorbell (``sq_tail``, written by the host, or by a GPU kernel through
the peer window) makes SQ non-empty -> fetch the 64-byte entry with the read mover ->
execute it (COPY streams read-mover beats straight into the write mover; WRITE_IMM
writes an immediate; WORK hands the entry to the node and waits for its answer) ->
write the CQE -> once the CQE's write response is back, write the completion count to
the flag address (normally GPU memory, which a GPU kernel polls). Because the flag
write starts only after the CQE write completed, a poller that sees the count can read
the CQE.

A fault on a queue access itself (SQ fetch, CQE or flag write) stops the engine with
``status.error`` (disable and re-enable to restart): it means the rings are misplaced,
and carrying on would lose completions. Faults of the work (COPY to an unmapped page...)
are reported in the CQE and counted; the engine goes on.
"""

from __future__ import annotations

from amaranth.hdl import Cat, Const, Module, Mux, Signal
from amaranth.lib import stream, wiring
from amaranth.lib.wiring import In, Out

from .axi import AXI4Signature
from .layouts import (
    CQE,
    CQE_BYTES,
    WORK_DONE,
    WQE,
    WQE_BYTES,
    Opcode,
    Status,
    dma_beat_layout,
    dma_clr_layout,
    dma_ctl_layout,
    dma_sts_layout,
    dma_wstb_layout,
    host_ctl_layout,
)
from .read import ReadMover
from .split import AxiSplit
from .translate import Translator
from .write import WriteMover

BAD_OPCODE = Status.BAD_OPCODE


class DmaEngine(wiring.Component):
    def __init__(self, width: int, *, outstanding: int = 16, host_windows: int = 4,
                 gpu_pages: int = 256) -> None:
        self.width = width
        self.outstanding = outstanding
        self.host_windows = host_windows
        self.gpu_pages = gpu_pages
        super().__init__({
            "host": Out(AXI4Signature(width)),
            "gpu": Out(AXI4Signature(width)),
            "ctl": In(dma_ctl_layout()),
            "wstb": In(dma_wstb_layout()),
            "clr": In(dma_clr_layout()),
            "sts": Out(dma_sts_layout()),
            "host_win": In(host_ctl_layout(host_windows)),
            "pte_addr": Out(range(gpu_pages)),
            "pte_data": In(32),
            "work": Out(stream.Signature(WQE)),
            "work_done": In(stream.Signature(WORK_DONE)),
        })

    def elaborate(self, platform) -> Module:
        m = Module()
        w = self.width
        nb = w // 8
        ctl, sts = self.ctl, self.sts
        # One translator per mover (see translate.py: a shared one can deadlock a copy).
        m.submodules.xl_rd = xr = Translator(host_windows=self.host_windows,
                                             gpu_pages=self.gpu_pages)
        m.submodules.xl_wr = xw = Translator(host_windows=self.host_windows,
                                             gpu_pages=self.gpu_pages)
        m.submodules.rd = rd = ReadMover(w, outstanding=self.outstanding)
        m.submodules.wr = wr = WriteMover(w, outstanding=self.outstanding)
        m.submodules.split = split = AxiSplit(w, depth=2 * self.outstanding)
        wiring.connect(m, wiring.flipped(self.host), split.host)
        wiring.connect(m, wiring.flipped(self.gpu), split.gpu)
        wiring.connect(m, rd.bus.ar, split.up.ar)
        wiring.connect(m, split.up.r, rd.bus.r)
        wiring.connect(m, wr.bus.aw, split.up.aw)
        wiring.connect(m, wr.bus.w, split.up.w)
        wiring.connect(m, split.up.b, wr.bus.b)
        wiring.connect(m, xr.rd_seg, rd.seg)
        wiring.connect(m, xw.wr_seg, wr.seg)
        turn = Signal()
        m.d.sync += turn.eq(~turn)
        for xl, mine in ((xr, ~turn), (xw, turn)):
            m.d.comb += [
                xl.host.eq(self.host_win),
                xl.gpu_va.eq(Cat(ctl.gpu_va_lo.value, ctl.gpu_va_hi.value)),
                xl.pte_data.eq(self.pte_data), xl.pte_grant.eq(mine),
            ]
        m.d.comb += self.pte_addr.eq(Mux(turn, xw.pte_addr, xr.pte_addr))
        for mover, field in ((rd, ctl.control.max_rd), (wr, ctl.control.max_wr)):
            m.d.comb += mover.max_outstanding.eq(
                Mux(field > self.outstanding, self.outstanding, field))

        # Saturating fault counters, cleared by a CSR write.
        def counter(reg, clear, *incs):
            v = reg.value
            n = sum(incs)
            with m.If(clear):
                m.d.sync += v.eq(0)
            with m.Elif(v + n > 0xFFFF_FFFF):
                m.d.sync += v.eq(0xFFFF_FFFF)
            with m.Else():
                m.d.sync += v.eq(v + n)

        wqe_done = Signal()
        counter(sts.completed, self.clr.completed, wqe_done)
        counter(sts.unmapped, self.clr.unmapped, xr.unmapped, xw.unmapped)
        counter(sts.forbidden, self.clr.forbidden, xr.forbidden, xw.forbidden)
        counter(sts.bus_errors, self.clr.bus_errors, rd.bus_error, wr.bus_error)

        # Descriptor registers toward the translator.
        rq, wq = xr.rd_req, xw.wr_req
        with m.If(rq.ready):
            m.d.sync += rq.valid.eq(0)
        with m.If(wq.ready):
            m.d.sync += wq.valid.eq(0)

        def read(space, addr, length):
            m.d.sync += [rq.valid.eq(1), rq.payload.space.eq(space),
                         rq.payload.addr.eq(addr), rq.payload.len.eq(length)]

        def write(space, addr, length):
            m.d.sync += [wq.valid.eq(1), wq.payload.space.eq(space),
                         wq.payload.addr.eq(addr), wq.payload.len.eq(length)]

        # Small writes (immediates, CQEs, the flag) come from a shift register.
        sw_bits = max(8 * CQE_BYTES, w)
        sw_buf = Signal(sw_bits)
        sw_left = Signal(range(CQE_BYTES + 1))     # bytes still to send
        sw_first = Signal()
        sw_beat = Signal(dma_beat_layout(w))
        m.d.comb += [
            sw_beat.data.eq(sw_buf[:w]),
            sw_beat.keep.eq(Mux(sw_left >= nb, (1 << nb) - 1,
                                ((Const(1, nb + 1) << sw_left) - 1)[:nb])),
            sw_beat.first.eq(sw_first),
            sw_beat.last.eq(sw_left <= nb),
        ]

        def small(space, addr, value, length):
            write(space, addr, length)
            m.d.sync += [sw_buf.eq(value), sw_left.eq(length), sw_first.eq(1)]

        # Engine state.
        sq_head = Signal(16)
        cq_tail = Signal(16)
        total = Signal(64)          # work requests completed since reset: the flag value
        fatal = Signal()
        wqe = Signal(WQE)
        st = Signal(8)
        moved = Signal(32)
        got_rd = Signal()
        got_wr = Signal()
        rd_st = Signal(2)
        wr_st = Signal(2)
        sq_mask = Signal(16)
        cq_mask = Signal(16)
        m.d.comb += [
            sq_mask.eq((Const(1, 17) << ctl.sq_cfg.log2_size) - 1),
            cq_mask.eq((Const(1, 17) << ctl.cq_cfg.log2_size) - 1),
            sts.sq_head.value.eq(sq_head), sts.cq_tail.value.eq(cq_tail),
            sts.status.error.eq(fatal),
        ]
        sq_base = Cat(ctl.sq_base_lo.value, ctl.sq_base_hi.value)
        cq_base = Cat(ctl.cq_base_lo.value, ctl.cq_base_hi.value)
        flag = Cat(ctl.flag_lo.value, ctl.flag_hi.value)
        cq_used = (cq_tail - ctl.cq_head.value)[:16]
        with m.If(~ctl.control.enable):
            m.d.sync += fatal.eq(0)

        rdata, wdata = rd.data, wr.data
        cpl_r, cpl_w = rd.cpl, wr.cpl
        work = self.work
        with m.If(work.ready):
            m.d.sync += work.valid.eq(0)

        with m.FSM() as fsm:
            start = (ctl.control.enable & ~fatal & (ctl.sq_tail.index != sq_head)
                     & (cq_used <= cq_mask))
            with m.State("IDLE"), m.If(start):
                read(ctl.sq_cfg.space, sq_base + (sq_head & sq_mask) * WQE_BYTES, WQE_BYTES)
                m.next = "FETCH"
            with m.State("FETCH"):
                m.d.comb += [rdata.ready.eq(1), cpl_r.ready.eq(1)]
                with m.If(rdata.valid):
                    if w >= WQE.size:
                        m.d.sync += wqe.eq(rdata.payload.data[:WQE.size])
                    else:
                        m.d.sync += wqe.as_value().eq(Cat(wqe.as_value()[w:],
                                                          rdata.payload.data))
                with m.If(cpl_r.valid):
                    with m.If(cpl_r.payload.status != Status.OK):
                        m.d.sync += fatal.eq(1)
                        m.next = "IDLE"
                    with m.Else():
                        m.d.sync += [sq_head.eq(sq_head + 1), st.eq(Status.OK),
                                     moved.eq(0), got_rd.eq(0), got_wr.eq(0)]
                        m.next = "DISPATCH"
            with m.State("DISPATCH"), m.Switch(wqe.opcode):
                with m.Case(Opcode.NOP):
                    m.next = "CQE"
                with m.Case(Opcode.COPY):
                    read(wqe.src_space, wqe.src_addr, wqe.len)
                    write(wqe.dst_space, wqe.dst_addr, wqe.len)
                    m.next = "COPY"
                with m.Case(Opcode.WRITE_IMM):
                    n = Mux(wqe.len > 8, 8, wqe.len)
                    small(wqe.dst_space, wqe.dst_addr, wqe.imm, n)
                    m.d.sync += got_rd.eq(1)
                    m.next = "COPY"
                with m.Case(Opcode.WORK):
                    m.d.sync += [work.valid.eq(1), work.payload.eq(wqe)]
                    m.next = "WORK"
                with m.Default():
                    m.d.sync += st.eq(BAD_OPCODE)
                    m.next = "CQE"
            with m.State("COPY"):
                # COPY: read beats flow into the write mover; WRITE_IMM: the shift register.
                with m.If(wqe.opcode == Opcode.COPY):
                    wiring.connect(m, rdata, wdata)
                self._small_source(m, fsm, wdata, sw_beat, sw_buf, sw_left, sw_first,
                                   wqe.opcode != Opcode.COPY, w, nb)
                m.d.comb += [cpl_r.ready.eq(~got_rd), cpl_w.ready.eq(~got_wr)]
                with m.If(cpl_r.valid & ~got_rd):
                    m.d.sync += [got_rd.eq(1), rd_st.eq(cpl_r.payload.status)]
                with m.If(cpl_w.valid & ~got_wr):
                    m.d.sync += [got_wr.eq(1), wr_st.eq(cpl_w.payload.status),
                                 moved.eq(cpl_w.payload.len)]
                with m.If(got_rd & got_wr):
                    # The read's fault explains a poisoned write: report the read's.
                    m.d.sync += st.eq(Mux(rd_st != Status.OK, rd_st, wr_st))
                    with m.If((rd_st != Status.OK) | (wr_st != Status.OK)):
                        m.d.sync += moved.eq(0)
                    m.next = "CQE"
            with m.State("WORK"):
                m.d.comb += self.work_done.ready.eq(~work.valid)
                with m.If(self.work_done.valid & ~work.valid):
                    m.d.sync += [st.eq(self.work_done.payload.status),
                                 moved.eq(self.work_done.payload.len)]
                    m.next = "CQE"
            with m.State("CQE"):
                cqe = Signal(CQE)
                m.d.comb += [cqe.wr_id.eq(wqe.wr_id), cqe.len.eq(moved),
                             cqe.opcode.eq(wqe.opcode), cqe.status.eq(st),
                             cqe.phase.eq(~(cq_tail >> ctl.cq_cfg.log2_size)[0])]
                small(ctl.cq_cfg.space, cq_base + (cq_tail & cq_mask) * CQE_BYTES, cqe,
                      CQE_BYTES)
                m.next = "CQE_WAIT"
            with m.State("CQE_WAIT"):
                self._small_source(m, fsm, wdata, sw_beat, sw_buf, sw_left, sw_first, 1, w,
                                   nb)
                m.d.comb += cpl_w.ready.eq(1)
                with m.If(cpl_w.valid):
                    with m.If(cpl_w.payload.status != Status.OK):
                        m.d.sync += fatal.eq(1)
                        m.next = "IDLE"
                    with m.Else():
                        m.d.comb += wqe_done.eq(1)
                        m.d.sync += [cq_tail.eq(cq_tail + 1), total.eq(total + 1)]
                        m.next = "FLAG"
            with m.State("FLAG"):
                with m.If(ctl.flag_cfg.enable):
                    small(ctl.flag_cfg.space, flag, total, 8)
                    m.next = "FLAG_WAIT"
                with m.Else():
                    m.next = "IDLE"
            with m.State("FLAG_WAIT"):
                self._small_source(m, fsm, wdata, sw_beat, sw_buf, sw_left, sw_first, 1, w,
                                   nb)
                m.d.comb += cpl_w.ready.eq(1)
                with m.If(cpl_w.valid):
                    with m.If(cpl_w.payload.status != Status.OK):
                        m.d.sync += fatal.eq(1)
                    m.next = "IDLE"
        m.d.comb += sts.status.busy.eq(~fsm.ongoing("IDLE"))
        return m

    @staticmethod
    def _small_source(m, fsm, wdata, sw_beat, sw_buf, sw_left, sw_first, active, w, nb):
        with m.If(active & (sw_left != 0)):
            m.d.comb += [wdata.valid.eq(1), wdata.payload.eq(sw_beat)]
            with m.If(wdata.ready):
                m.d.sync += [sw_buf.eq(sw_buf >> w), sw_first.eq(0),
                             sw_left.eq(Mux(sw_left > nb, sw_left - nb, 0))]

