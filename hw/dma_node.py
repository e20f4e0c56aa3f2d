"""The node with its DMA: one network port, one CSR bus, one AXI4 port per address space.

    csr ──┬─ node bank (every block but the DMA's) ── Node ── rx/tx
          └─ DMA bank (dma, dma_host, dma_gpt) ── queue engine ──┐   (SQ/CQ, flag)
    Node simple ports ── NodeMemory (adapters, translators, movers) ──┤
                                          arbiter per space ──────────┴── host, gpu

* Register map: :func:`fpgaccl.proto.regmap.default_map` with this build's parameters,
  served by two banks behind the one bus, routed by address: the node's bank (the map
  without the DMA blocks; the node is built with ``dma=True`` so ``ctrl.features.dma``
  says they are here) and the DMA bank.
* Addresses on the node's memory port name their space with bit 63
  (:data:`fpgaccl.proto.queues.NODE_SPACE_BIT`): the node's datapath reaches host memory
  and the GPU-peer window through the same host windows and page table as the queue
  engine (a mirror of the page table, written by the same bus writes, gives its
  translators a read port of their own).
* WORK entries start a collective: the entry's ``imm`` is written into the node's
  ``ctrl.doorbell`` through the node's CSR bus (in a cycle the outside bus leaves free),
  and the entry completes when the program ends, so the completion flag a GPU kernel
  polls is written after the collective finished. CQE status: OK, a memory fault of the
  node's datapath during the program (UNMAPPED/FORBIDDEN/BUS_ERROR), PROGRAM_ERROR
  (the sequencer stopped on an error) or NOT_STARTED (the node did not start: disabled).
* Faults of the node's datapath are counted in ``dma.unmapped``/``forbidden``/
  ``bus_errors`` together with the queue engine's, and read back as ``ctrl.status.error``
  until the next doorbell. A refused access moves no byte: a refused read answers zeros
  (the datapath keeps its framing), a refused write is dropped.
"""

from __future__ import annotations

from amaranth.hdl import Cat, Const, Module, Mux, Signal
from amaranth.lib import memory, wiring
from amaranth.lib.wiring import In, Out

from fpgaccl.hw.csr.bank import CSRBank
from fpgaccl.hw.csr.bus import CSRBusSignature
from fpgaccl.hw.dma.adapters import AxiArbiter, NodeMemory
from fpgaccl.hw.dma.axi import AXI4Signature
from fpgaccl.hw.dma.engine import DmaEngine
from fpgaccl.hw.dma.layouts import Status
from fpgaccl.hw.node import Node
from fpgaccl.hw.stream.beat import beat_stream
from fpgaccl.proto.regmap import DMA_BLOCKS, RegisterMap, default_map

START_WINDOW = 8   # cycles from the doorbell write to the sequencer's busy (it takes 2)


class DmaNode(wiring.Component):
    def __init__(self, width: int = 64, *, qps: int = 8, regions: int = 8,
                 imem_words: int = 512, mtu: int = 4096, seg_bytes: int = 4096,
                 timeout: int = 1 << 14, host_windows: int = 4, gpu_pages: int = 256,
                 outstanding: int = 16, dtypes=None, ops=None) -> None:
        self.width = width
        self.node = Node(width, qps=qps, regions=regions, imem_words=imem_words, mtu=mtu,
                         seg_bytes=seg_bytes, timeout=timeout, dtypes=dtypes, ops=ops,
                         dma=True)
        self.regmap = default_map(qps=qps, regions=regions, imem_words=imem_words,
                                  dma_host_windows=host_windows, gpu_pages=gpu_pages)
        self.dma_map = RegisterMap(tuple(self.regmap[b] for b in DMA_BLOCKS))
        self.host_windows, self.gpu_pages, self.outstanding = (
            host_windows, gpu_pages, outstanding)
        # Write runs are at most one packet's payload or one engine segment.
        self.max_write = max(mtu, seg_bytes)
        super().__init__({
            "rx": In(beat_stream(width)),
            "tx": Out(beat_stream(width)),
            "csr": In(CSRBusSignature(16)),
            "host": Out(AXI4Signature(width)),
            "gpu": Out(AXI4Signature(width)),
            "done": Out(1),
            "busy": Out(1),
        })

    def elaborate(self, platform) -> Module:
        m = Module()
        w = self.width
        m.submodules.node = node = self.node
        m.submodules.dbank = dbank = CSRBank(self.dma_map)
        m.submodules.engine = eng = DmaEngine(w, outstanding=self.outstanding,
                                              host_windows=self.host_windows,
                                              gpu_pages=self.gpu_pages)
        m.submodules.nmem = nmem = NodeMemory(w, host_windows=self.host_windows,
                                              gpu_pages=self.gpu_pages,
                                              outstanding=self.outstanding,
                                              max_bytes=self.max_write)
        m.submodules.arb_host = arb_host = AxiArbiter(w, depth=2 * self.outstanding)
        m.submodules.arb_gpu = arb_gpu = AxiArbiter(w, depth=2 * self.outstanding)

        wiring.connect(m, wiring.flipped(self.rx), node.rx)
        wiring.connect(m, node.tx, wiring.flipped(self.tx))
        m.d.comb += [self.done.eq(node.done), self.busy.eq(node.busy)]

        # Memory: the node's datapath and the queue engine share each space's port.
        wiring.connect(m, node.rd_req, nmem.rd_req)
        wiring.connect(m, nmem.rd_resp, node.rd_resp)
        wiring.connect(m, node.wr, nmem.wr)
        wiring.connect(m, eng.host, arb_host.m0)
        wiring.connect(m, nmem.host, arb_host.m1)
        wiring.connect(m, eng.gpu, arb_gpu.m0)
        wiring.connect(m, nmem.gpu, arb_gpu.m1)
        wiring.connect(m, arb_host.s, wiring.flipped(self.host))
        wiring.connect(m, arb_gpu.s, wiring.flipped(self.gpu))

        ctl = dbank.dma_ctl
        m.d.comb += [
            eng.ctl.eq(ctl), eng.wstb.eq(dbank.dma_wstb), eng.clr.eq(dbank.dma_clr),
            eng.host_win.eq(dbank.dma_host_ctl),
            dbank.dma_gpt_raddr.eq(eng.pte_addr), eng.pte_data.eq(dbank.dma_gpt_rdata),
            nmem.host_win.eq(dbank.dma_host_ctl),
            nmem.gpu_va.eq(Cat(ctl.gpu_va_lo.value, ctl.gpu_va_hi.value)),
            nmem.max_rd.eq(ctl.control.max_rd), nmem.max_wr.eq(ctl.control.max_wr),
        ]

        # The page-table mirror for the datapath's translators.
        gpt = self.regmap["dma_gpt"]
        m.submodules.gpt_mirror = mirror = memory.Memory(shape=32, depth=self.gpu_pages,
                                                         init=[])
        mw, mr = mirror.write_port(), mirror.read_port()
        bus = self.csr
        in_gpt = (bus.addr >= gpt.base) & (bus.addr < gpt.base + gpt.size)
        m.d.comb += [mw.addr.eq((bus.addr - gpt.base)[2:]), mw.data.eq(bus.w_data),
                     mw.en.eq(bus.w_stb & in_gpt),
                     mr.addr.eq(nmem.pte_addr), nmem.pte_data.eq(mr.data)]

        # Fault counters: the engine's own plus the datapath's, saturating, one clear.
        sts = eng.sts
        m.d.comb += dbank.dma_sts.eq(sts)
        for name, pulse in (("unmapped", nmem.unmapped), ("forbidden", nmem.forbidden),
                            ("bus_errors", nmem.bus_error)):
            mine = Signal(32, name=f"node_{name}")
            with m.If(getattr(dbank.dma_clr, name)):
                m.d.sync += mine.eq(0)
            with m.Elif(pulse & (mine != 0xFFFF_FFFF)):
                m.d.sync += mine.eq(mine + 1)
            total = Signal(33, name=f"total_{name}")
            m.d.comb += [
                total.eq(getattr(sts, name).value + mine),
                getattr(dbank.dma_sts, name).value.eq(
                    Mux(total[32], 0xFFFF_FFFF, total[:32])),
            ]

        # CSR bus: the DMA blocks' addresses go to the DMA bank, the rest to the node.
        dma_hit = Const(0)
        for b in self.dma_map:
            dma_hit = dma_hit | ((bus.addr >= b.base) & (bus.addr < b.base + b.size))
        doorbell_addr = self.regmap.address("ctrl.doorbell")
        status_addr = self.regmap.address("ctrl.status")
        m.d.comb += [
            dbank.bus.addr.eq(bus.addr), dbank.bus.w_data.eq(bus.w_data),
            dbank.bus.w_stb.eq(bus.w_stb & dma_hit), dbank.bus.r_stb.eq(bus.r_stb & dma_hit),
        ]
        ring = Signal()          # the WORK glue wants to write the node's doorbell
        ring_data = Signal(32)
        node_busy_bus = (bus.w_stb | bus.r_stb) & ~dma_hit
        rang = Signal()
        m.d.comb += rang.eq(ring & ~node_busy_bus)
        with m.If(rang):
            m.d.comb += [node.csr.addr.eq(doorbell_addr), node.csr.w_data.eq(ring_data),
                         node.csr.w_stb.eq(1)]
        with m.Else():
            m.d.comb += [node.csr.addr.eq(bus.addr), node.csr.w_data.eq(bus.w_data),
                         node.csr.w_stb.eq(bus.w_stb & ~dma_hit),
                         node.csr.r_stb.eq(bus.r_stb & ~dma_hit)]

        # ctrl.status.error also reports a datapath memory fault since the last doorbell.
        mem_fault = Signal()
        rd_dma = Signal()
        rd_status = Signal()
        with m.If(bus.r_stb):
            m.d.sync += [rd_dma.eq(dma_hit), rd_status.eq(bus.addr == status_addr)]
        doorbell = rang | (bus.w_stb & (bus.addr == doorbell_addr))
        with m.If(doorbell):
            m.d.sync += mem_fault.eq(0)
        with m.Elif(nmem.fault):
            m.d.sync += mem_fault.eq(1)
        error_bit = 1 << self.regmap["ctrl"]["status"].field_offset("error")
        m.d.comb += bus.r_data.eq(Mux(rd_dma, dbank.bus.r_data,
                                      node.csr.r_data | Mux(rd_status & mem_fault,
                                                            error_bit, 0)))

        # WORK entries: ring the node's doorbell, answer when the program ended.
        work, done = eng.work, eng.work_done
        timer = Signal(range(START_WINDOW + 1))
        saw_done = Signal()
        fault_st = Signal(2)
        with m.If(done.ready):
            m.d.sync += done.valid.eq(0)
        with m.FSM():
            with m.State("IDLE"):
                # A program the host started itself runs to its end first.
                m.d.comb += work.ready.eq(~node.busy)
                with m.If(work.valid & ~node.busy):
                    m.d.sync += ring_data.eq(work.payload.imm[:32])
                    m.next = "RING"
            with m.State("RING"):
                m.d.comb += ring.eq(1)
                with m.If(rang):
                    m.d.sync += [timer.eq(0), saw_done.eq(0), fault_st.eq(Status.OK)]
                    m.next = "START"
            with m.State("START"):
                m.d.sync += timer.eq(timer + 1)
                with m.If(node.busy):
                    m.next = "RUN"
                with m.Elif(timer == START_WINDOW):
                    m.d.sync += [done.valid.eq(1), done.payload.status.eq(Status.NOT_STARTED),
                                 done.payload.len.eq(0)]
                    m.next = "ANSWER"
            with m.State("RUN"):
                with m.If(node.done):
                    m.d.sync += saw_done.eq(1)
                with m.If(nmem.fault & (fault_st == Status.OK)):
                    m.d.sync += fault_st.eq(nmem.fault_status)
                with m.If(~node.busy):
                    m.d.sync += saw_done.eq(saw_done | node.done)
                    m.next = "DRAIN"
            with m.State("DRAIN"):
                # The engines call a write done once the port took it; the completion
                # (and the flag after it) must wait until memory has it.
                with m.If(nmem.fault & (fault_st == Status.OK)):
                    m.d.sync += fault_st.eq(nmem.fault_status)
                with m.If(nmem.writes_idle & ~nmem.fault):
                    m.d.sync += [
                        done.valid.eq(1), done.payload.len.eq(0),
                        done.payload.status.eq(Mux(fault_st != Status.OK, fault_st,
                                                   Mux(saw_done, Status.OK,
                                                       Status.PROGRAM_ERROR))),
                    ]
                    m.next = "ANSWER"
            with m.State("ANSWER"), m.If(done.valid & done.ready):
                m.next = "IDLE"
        return m


def export_verilog(width: int = 64, *, name: str = "fpgaccl_dma_node", **params) -> str:
    """The node with its DMA engine as one Verilog text (module ``name`` and its
    submodules); lint it with :func:`fpgaccl.hw.node.lint_command`."""
    from amaranth.back import verilog
    return verilog.convert(DmaNode(width, **params), name=name, emit_src=False)


__all__ = ["DMA_BLOCKS", "DmaNode", "export_verilog"]
