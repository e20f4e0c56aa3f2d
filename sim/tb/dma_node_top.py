"""Two DmaNodes back to back (node 0's tx is node 1's rx and the reverse): the one
Verilator build the DmaNode test and the latency bench share. The testbench reaches
node ``k``'s registers through one CSR bus steered by ``sel`` (as the cluster does);
each node's host and GPU AXI ports are separate top-level ports for the memory models.
``tx_sop`` marks the cycle a frame's first beat leaves each node."""

from __future__ import annotations

from amaranth.hdl import Module, Signal
from amaranth.lib import wiring
from amaranth.lib.wiring import In, Out

from fpgaccl.hw.csr.bus import CSRBusSignature
from fpgaccl.hw.dma.axi import AXI4Signature
from fpgaccl.hw.dma_node import DmaNode

# The build both users share: small program memory and page table keep it quick.
PARAMS = {"qps": 2, "regions": 2, "imem_words": 64, "mtu": 1024, "seg_bytes": 1024,
          "timeout": 1 << 12, "gpu_pages": 64}


class DmaNodePair(wiring.Component):
    def __init__(self, width: int = 64, **kw) -> None:
        self.width = width
        self.params = {**PARAMS, **kw}
        self.nodes = [DmaNode(width, **self.params) for _ in range(2)]
        self.regmap = self.nodes[0].regmap
        members = {
            "sel": In(1),
            "csr": In(CSRBusSignature(16)),
            "cycles": Out(48),
            "tx_sop": Out(2),
            "done": Out(2),
            "busy": Out(2),
        }
        for k in range(2):
            members[f"host{k}"] = Out(AXI4Signature(width))
            members[f"gpu{k}"] = Out(AXI4Signature(width))
        super().__init__(members)

    def elaborate(self, platform) -> Module:
        m = Module()
        cycles = Signal(48)
        m.d.sync += cycles.eq(cycles + 1)
        m.d.comb += self.cycles.eq(cycles)
        for k, node in enumerate(self.nodes):
            m.submodules[f"node{k}"] = node
            wiring.connect(m, node.host, wiring.flipped(getattr(self, f"host{k}")))
            wiring.connect(m, node.gpu, wiring.flipped(getattr(self, f"gpu{k}")))
            here = self.sel == k
            m.d.comb += [
                node.csr.addr.eq(self.csr.addr), node.csr.w_data.eq(self.csr.w_data),
                node.csr.w_stb.eq(self.csr.w_stb & here),
                node.csr.r_stb.eq(self.csr.r_stb & here),
                self.done[k].eq(node.done), self.busy[k].eq(node.busy),
                self.tx_sop[k].eq(node.tx.valid & node.tx.ready & node.tx.payload.first),
            ]
            with m.If(here):
                m.d.comb += self.csr.r_data.eq(node.csr.r_data)
        a, b = self.nodes
        wiring.connect(m, a.tx, b.rx)
        wiring.connect(m, b.tx, a.rx)
        return m
