"""The cluster bench's bus driver, shared by the cluster bench (sim/benches/cluster.py)
and the sim backend's server (sim/benches/sim_server.py): reset, CSR reads/writes over
the shared bus and memory backdoor accesses, both steered to one node by ``sel``, and
the IN|OUT|TMP|TMP2 buffer layout of a node's memory."""

from __future__ import annotations

from cocotb.clock import Clock
from cocotb.triggers import ClockCycles, RisingEdge

from fpgaccl.host.csr_plan import Peer
from fpgaccl.proto.regmap import default_map
from fpgaccl.sim.hdl.switch import node_ip, node_mac

CLOCK_NS = 4
"""The bench clock: 4 ns, i.e. 250 MHz (the clock sim-backend times are stated at)."""


class TB:
    def __init__(self, dut, p):
        self.dut, self.p = dut, p
        self.nodes, self.width = p["nodes"], p["width"]
        self.nb = self.width // 8
        self.rmap = default_map(qps=p["qps"], imem_words=p["imem_words"])
        Clock(dut.clk, CLOCK_NS, unit="ns").start()

    async def reset(self):
        d = self.dut
        for s in (d.csr__w_stb, d.csr__r_stb, d.bd_we, d.loss):
            s.value = 0
        d.rst.value = 1
        await ClockCycles(d.clk, 4)
        d.rst.value = 0
        await ClockCycles(d.clk, 2)

    async def csr_write(self, node, writes):
        d = self.dut
        d.sel.value = node
        for addr, value in writes:
            d.csr__addr.value, d.csr__w_data.value, d.csr__w_stb.value = addr, value, 1
            await RisingEdge(d.clk)
        d.csr__w_stb.value = 0

    async def csr_read(self, node, addr):
        d = self.dut
        d.sel.value, d.csr__addr.value, d.csr__r_stb.value = node, addr, 1
        await RisingEdge(d.clk)
        d.csr__r_stb.value = 0
        await RisingEdge(d.clk)
        return int(d.csr__r_data.value)

    async def mem_write(self, node, addr, raw: bytes):
        assert addr % self.nb == 0
        raw = raw + bytes(-len(raw) % self.nb)
        d = self.dut
        d.sel.value = node
        for i in range(0, len(raw), self.nb):
            d.bd_addr.value = (addr + i) // self.nb
            d.bd_wdata.value = int.from_bytes(raw[i:i + self.nb], "little")
            d.bd_we.value = 1
            await RisingEdge(d.clk)
        d.bd_we.value = 0

    async def mem_read(self, node, addr, length) -> bytes:
        d = self.dut
        d.sel.value = node
        out = bytearray()
        for i in range(0, length + self.nb, self.nb):
            d.bd_addr.value = (addr + i) // self.nb
            await RisingEdge(d.clk)
            await RisingEdge(d.clk)
            out += int(d.bd_rdata.value).to_bytes(self.nb, "little")
        return bytes(out[:length])

    def layout(self, nbytes):
        # IN, OUT, TMP, TMP2 one after the other, each rounded up to 4 KiB, scratch with
        # room for the chunk padding of the programs' geometry.
        span = -(-(nbytes + 4096) // 4096) * 4096
        return [i * span for i in range(4)]

    def peers(self, world, bufs):
        """Every node's addresses and buffers (the rendezvous table of a real run)."""
        return [Peer(node_mac(k), node_ip(k), 0x1000 + k, bufs) for k in range(world)]
