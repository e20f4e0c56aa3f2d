"""N nodes, their memories and a switch in one design: the multi-node simulation that
runs at Verilator speed. The testbench reaches node ``k`` through one shared CSR bus
and one memory backdoor, both steered by a select input; everything else (frames,
memory traffic, reductions) stays in hardware."""

from __future__ import annotations

from amaranth.hdl import Module, Signal
from amaranth.lib import wiring
from amaranth.lib.wiring import In, Out

from fpgaccl.hw.csr.bus import CSRBusSignature
from fpgaccl.hw.node import Node

from .memory import SimMemory
from .switch import Switch


class Cluster(wiring.Component):
    def __init__(self, nodes: int, width: int = 64, *, mem_bytes: int = 1 << 20,
                 qps: int | None = None, imem_words: int = 512, mtu: int = 1024,
                 mem_latency: int = 16, timeout: int = 1 << 12, seed: int = 1) -> None:
        self.nodes, self.width, self.mem_bytes = nodes, width, mem_bytes
        self.qps = qps or max(2, nodes)
        self.imem_words, self.mtu, self.mem_latency = imem_words, mtu, mem_latency
        self.timeout, self.seed = timeout, seed
        words = mem_bytes // (width // 8)
        super().__init__({
            "sel": In(range(max(2, nodes))),
            "csr": In(CSRBusSignature(16)),
            "bd_addr": In(range(words)),
            "bd_wdata": In(width),
            "bd_we": In(1),
            "bd_rdata": Out(width),
            "loss": In(16),
            "done": Out(nodes),
            "busy": Out(nodes),
            "dropped": Out(32),
            "cycles": Out(48),
        })

    def elaborate(self, platform) -> Module:
        m = Module()
        m.submodules.switch = sw = Switch(self.width, self.nodes, seed=self.seed)
        m.d.comb += [sw.loss.eq(self.loss), self.dropped.eq(sw.dropped)]
        cycles = Signal(48)
        m.d.sync += cycles.eq(cycles + 1)
        m.d.comb += self.cycles.eq(cycles)
        for k in range(self.nodes):
            node = Node(self.width, qps=self.qps, imem_words=self.imem_words, mtu=self.mtu,
                        seg_bytes=min(self.mtu, 4096), timeout=self.timeout)
            mem = SimMemory(self.width, self.mem_bytes, latency=self.mem_latency)
            m.submodules[f"node{k}"] = node
            m.submodules[f"mem{k}"] = mem
            wiring.connect(m, node.rd_req, mem.rd_req)
            wiring.connect(m, mem.rd_resp, node.rd_resp)
            wiring.connect(m, node.wr, mem.wr)
            wiring.connect(m, node.tx, getattr(sw, f"i{k}"))
            wiring.connect(m, getattr(sw, f"o{k}"), node.rx)
            here = self.sel == k
            m.d.comb += [
                node.csr.addr.eq(self.csr.addr), node.csr.w_data.eq(self.csr.w_data),
                node.csr.w_stb.eq(self.csr.w_stb & here),
                node.csr.r_stb.eq(self.csr.r_stb & here),
                mem.bd_addr.eq(self.bd_addr), mem.bd_wdata.eq(self.bd_wdata),
                mem.bd_we.eq(self.bd_we & here),
                self.done[k].eq(node.done), self.busy[k].eq(node.busy),
            ]
            with m.If(here):
                m.d.comb += [self.csr.r_data.eq(node.csr.r_data),
                             self.bd_rdata.eq(mem.bd_rdata)]
        return m
