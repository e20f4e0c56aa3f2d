"""Address translation: descriptors (space, device address, length) -> bus segments.

Host memory: the address is an IOVA, passed through unchanged if one host window holds
the whole range with the needed right. GPU-peer window: the GPU VA indexes a page table
of 64 KiB pages (``gpu_va`` is entry 0), each entry the bus address of a pinned page, as
GPUDirect-RDMA registration hands them out; a descriptor becomes one segment per page
touched, since pinned pages are not contiguous on the bus.

Every page of a descriptor is checked *before* its first segment leaves, so a refused
descriptor moves no byte at all: it becomes one zero-length segment with the status.

A translator takes read and write descriptors (alternating per descriptor), but the DMA
engine gives each mover its own: a copy streams the read mover into the write mover, so
a translator stuck emitting one side's segments while the other side waits for its
first would deadlock. The two share the bank's single page-table read port through
``pte_grant`` (alternate cycles).
"""

from __future__ import annotations

from amaranth.hdl import Cat, Module, Mux, Signal
from amaranth.lib import stream, wiring
from amaranth.lib.wiring import In, Out

from fpgaccl.proto.regmap import GPU_PAGE_BITS

from .layouts import DESC, LEN_BITS, PTE, SEG, Space, Status, host_ctl_layout

PAGE = 1 << GPU_PAGE_BITS


class Translator(wiring.Component):
    def __init__(self, *, host_windows: int = 4, gpu_pages: int = 256) -> None:
        if host_windows < 2:
            raise ValueError("the bank makes an array of host windows only for 2 or more")
        self.host_windows = host_windows
        self.gpu_pages = gpu_pages
        super().__init__({
            "rd_req": In(stream.Signature(DESC)),
            "wr_req": In(stream.Signature(DESC)),
            "rd_seg": Out(stream.Signature(SEG)),
            "wr_seg": Out(stream.Signature(SEG)),
            "host": In(host_ctl_layout(host_windows)),
            "gpu_va": In(64),
            "pte_addr": Out(range(gpu_pages)),
            "pte_data": In(32),
            # The table's read port is ours this cycle (two translators share the
            # bank's one port, alternating); tie high when the port is not shared.
            "pte_grant": In(1, init=1),
            "unmapped": Out(1),     # pulse per refused descriptor, by reason
            "forbidden": Out(1),
        })

    def elaborate(self, platform) -> Module:
        m = Module()
        desc = Signal(DESC)
        is_wr = Signal()
        prio_wr = Signal()
        page = Signal(range(self.gpu_pages))
        last_page = Signal(range(self.gpu_pages))
        off = Signal(65)        # byte offset into the GPU window of the next segment
        rem = Signal(LEN_BITS)
        status = Signal(2)
        first = Signal()
        pte = Signal(PTE)
        m.d.comb += [pte.eq(self.pte_data), self.pte_addr.eq(page)]
        m.d.sync += [self.unmapped.eq(0), self.forbidden.eq(0)]

        # Host windows: one comparison per window, in parallel.
        end = desc.addr + desc.len     # 65 bits: a range wrapping past 2**64 is refused
        inside = Signal(self.host_windows)
        allowed = Signal(self.host_windows)
        for i in range(self.host_windows):
            win = self.host[i]
            base = Cat(win.base_lo.value, win.base_hi.value)
            m.d.comb += [
                inside[i].eq((win.length.value != 0) & (desc.addr >= base)
                             & (end <= base + win.length.value)),
                allowed[i].eq(inside[i] & Mux(is_wr, win.access.write, win.access.read)),
            ]
        gpu_off = desc.addr - self.gpu_va    # negative (below the window) shows in bit 64
        gpu_end = gpu_off + desc.len

        out = Signal(SEG)
        rd, wr = self.rd_seg, self.wr_seg
        port_free = Mux(is_wr, ~wr.valid | wr.ready, ~rd.valid | rd.ready)
        with m.If(rd.ready):
            m.d.sync += rd.valid.eq(0)
        with m.If(wr.ready):
            m.d.sync += wr.valid.eq(0)

        def send(seg_addr, seg_len, last, st):
            m.d.comb += [
                out.addr.eq(seg_addr), out.len.eq(seg_len), out.space.eq(desc.space),
                out.first.eq(first), out.last.eq(last), out.dlen.eq(desc.len),
                out.tag.eq(desc.tag), out.status.eq(st),
            ]
            with m.If(is_wr):
                m.d.sync += [wr.valid.eq(1), wr.payload.eq(out)]
            with m.Else():
                m.d.sync += [rd.valid.eq(1), rd.payload.eq(out)]
            m.d.sync += first.eq(0)

        def refuse(st):
            m.d.sync += [status.eq(st), self.unmapped.eq(st == Status.UNMAPPED),
                         self.forbidden.eq(st == Status.FORBIDDEN)]
            m.next = "REFUSE"

        with m.FSM():
            with m.State("IDLE"):
                pick_wr = self.wr_req.valid & (prio_wr | ~self.rd_req.valid)
                with m.If(pick_wr):
                    m.d.comb += self.wr_req.ready.eq(1)
                    m.d.sync += [desc.eq(self.wr_req.payload), is_wr.eq(1), prio_wr.eq(0)]
                    m.next = "CHECK"
                with m.Elif(self.rd_req.valid):
                    m.d.comb += self.rd_req.ready.eq(1)
                    m.d.sync += [desc.eq(self.rd_req.payload), is_wr.eq(0), prio_wr.eq(1)]
                    m.next = "CHECK"
                m.d.sync += first.eq(1)
            with m.State("CHECK"):
                with m.If(desc.len == 0):
                    m.d.sync += status.eq(Status.OK)
                    m.next = "REFUSE"      # a zero-length descriptor: one empty segment
                with m.Elif(desc.space == Space.HOST):
                    with m.If(end[64] | (inside == 0)):
                        refuse(Status.UNMAPPED)
                    with m.Elif(allowed == 0):
                        refuse(Status.FORBIDDEN)
                    with m.Else():
                        m.next = "HOST"
                with m.Else():
                    with m.If(gpu_off[64] | (gpu_end > self.gpu_pages * PAGE)):
                        refuse(Status.UNMAPPED)
                    with m.Else():
                        m.d.sync += [page.eq(gpu_off[GPU_PAGE_BITS:]),
                                     last_page.eq((gpu_end - 1)[GPU_PAGE_BITS:]),
                                     off.eq(gpu_off), rem.eq(desc.len)]
                        m.next = "WALK"
            with m.State("HOST"), m.If(port_free):
                send(desc.addr, desc.len, 1, Status.OK)
                m.next = "IDLE"
            with m.State("WALK"), m.If(self.pte_grant):
                m.next = "WALK_PTE"        # the page table answers a cycle later
            with m.State("WALK_PTE"):
                with m.If(~pte.valid):
                    refuse(Status.UNMAPPED)
                with m.Elif(~Mux(is_wr, pte.write, pte.read)):
                    refuse(Status.FORBIDDEN)
                with m.Elif(page == last_page):
                    m.d.sync += page.eq(off[GPU_PAGE_BITS:])
                    m.next = "EMIT"
                with m.Else():
                    m.d.sync += page.eq(page + 1)
                    m.next = "WALK"
            with m.State("EMIT"), m.If(self.pte_grant):
                m.next = "EMIT_PTE"
            with m.State("EMIT_PTE"):
                room = PAGE - off[:GPU_PAGE_BITS]
                seg_len = Mux(rem < room, rem, room)
                with m.If(port_free):
                    done = rem == seg_len
                    send(Cat(off[:GPU_PAGE_BITS], pte.page), seg_len, done, Status.OK)
                    m.d.sync += [off.eq(off + seg_len), rem.eq(rem - seg_len),
                                 page.eq(page + 1)]
                    m.next = "EMIT"
                    with m.If(done):
                        m.next = "IDLE"
                with m.Else():
                    m.next = "EMIT"    # the entry is on the port this cycle only: re-read
            with m.State("REFUSE"), m.If(port_free):
                send(desc.addr, 0, 1, status)
                m.next = "IDLE"
        return m
