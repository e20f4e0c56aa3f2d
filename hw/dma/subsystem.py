"""The DMA half of a node with a CSR bank of its own: what the DMA benches simulate.

The node top (``hw/node.py``) wires :class:`~fpgaccl.hw.dma.engine.DmaEngine` to the
node's shared bank instead; the connections are the same few lines as here.
"""

from __future__ import annotations

from amaranth.hdl import Module
from amaranth.lib import stream, wiring
from amaranth.lib.wiring import In, Out

from fpgaccl.hw.csr.bank import CSRBank
from fpgaccl.hw.csr.bus import CSRBusSignature
from fpgaccl.proto.regmap import RegisterMap, default_map

from .axi import AXI4Signature
from .engine import DmaEngine
from .layouts import WORK_DONE, WQE


def subsystem_map(host_windows: int = 4, gpu_pages: int = 64) -> RegisterMap:
    # The other blocks stay in the map (so addresses match the node's) but small.
    return default_map(qps=2, regions=2, imem_words=4, dma_host_windows=host_windows,
                       gpu_pages=gpu_pages)


class DmaSubsystem(wiring.Component):
    def __init__(self, width: int, *, outstanding: int = 16, host_windows: int = 4,
                 gpu_pages: int = 64) -> None:
        self.width = width
        self.regmap = subsystem_map(host_windows, gpu_pages)
        self.engine = DmaEngine(width, outstanding=outstanding, host_windows=host_windows,
                                gpu_pages=gpu_pages)
        self.bank = CSRBank(self.regmap)
        super().__init__({
            "csr": In(CSRBusSignature(16)),
            "host": Out(AXI4Signature(width)),
            "gpu": Out(AXI4Signature(width)),
            "work": Out(stream.Signature(WQE)),
            "work_done": In(stream.Signature(WORK_DONE)),
        })

    def elaborate(self, platform) -> Module:
        m = Module()
        m.submodules.bank = bank = self.bank
        m.submodules.engine = eng = self.engine
        wiring.connect(m, wiring.flipped(self.csr), bank.bus)
        for port in ("host", "gpu", "work", "work_done"):
            wiring.connect(m, wiring.flipped(getattr(self, port)), getattr(eng, port))
        m.d.comb += [
            eng.ctl.eq(bank.dma_ctl), eng.wstb.eq(bank.dma_wstb), eng.clr.eq(bank.dma_clr),
            bank.dma_sts.eq(eng.sts), eng.host_win.eq(bank.dma_host_ctl),
            bank.dma_gpt_raddr.eq(eng.pte_addr), eng.pte_data.eq(bank.dma_gpt_rdata),
        ]
        return m
