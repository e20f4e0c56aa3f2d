"""Harness of the DmaNode pair (:class:`~fpgaccl.sim.tb.dma_node_top.DmaNodePair`): host
and GPU memory models on every AXI port, one CSR bus steered by ``sel``, and a per-node
view that :class:`~fpgaccl.sim.tb.dma_harness.Driver` drives. Shared by the DmaNode bench
and the simulated board's server."""

from __future__ import annotations

from cocotb.clock import Clock
from cocotb.triggers import ClockCycles, FallingEdge, RisingEdge

from fpgaccl.sim import bench_params
from fpgaccl.sim.models.gpu import GpuKernel, GpuMemory
from fpgaccl.sim.models.host_memory import HostMemory
from fpgaccl.sim.tb.dma_harness import CLK_NS, AxiPort, CsrBus, _CsrOp, reset_then
from fpgaccl.sim.tb.dma_node_top import PARAMS


class TB:
    def __init__(self, dut, *, seed: int = 0) -> None:
        from fpgaccl.proto.regmap import default_map
        self.dut = dut
        self.width = bench_params().get("width", 64)
        self.rmap = default_map(qps=PARAMS["qps"], regions=PARAMS["regions"],
                                imem_words=PARAMS["imem_words"],
                                gpu_pages=PARAMS["gpu_pages"])
        Clock(dut.clk, CLK_NS, unit="ns").start()
        self.hosts = [HostMemory(self.width, seed=seed + 1 + k) for k in range(2)]
        self.gpus = [GpuMemory(self.width, pages=PARAMS["gpu_pages"], seed=seed + 3 + k)
                     for k in range(2)]
        self.ports = [AxiPort(dut, f"{kind}{k}", mem) for k in range(2)
                      for kind, mem in (("host", self.hosts[k]), ("gpu", self.gpus[k]))]
        self.csr = CsrBus(dut, steered=True)
        self.kernels: list[GpuKernel] = []
        self.tx_sops: list[list[int]] = [[], []]
        self.cycle = 0

    async def reset(self) -> None:
        await reset_then(self.dut, self._loop)

    async def _loop(self) -> None:
        dut = self.dut
        fe, re = FallingEdge(dut.clk), RisingEdge(dut.clk)
        while True:
            await fe
            for p in self.ports:
                p.sample()
            sop = dut.tx_sop.value.to_unsigned()
            self.csr.sample()
            await re
            self.cycle += 1
            for k in range(2):
                if sop >> k & 1:
                    self.tx_sops[k].append(self.cycle)
            for p in self.ports:
                p.step(self.cycle)
            self.csr.step(self.cycle)
            for kern in self.kernels:
                kern.poll(self.cycle)

    async def wait_cycles(self, n: int) -> None:
        await ClockCycles(self.dut.clk, n)

    def view(self, k: int) -> NodeView:
        return NodeView(self, k)


class NodeView:
    """One node as :class:`~.dma_harness.Driver` expects a bench: its CSR space and its
    memories."""

    def __init__(self, tb: TB, k: int) -> None:
        self.tb, self.k = tb, k
        self.rmap, self.host, self.gpu = tb.rmap, tb.hosts[k], tb.gpus[k]

    async def write_raw(self, addr: int, value: int, who: str = "host") -> _CsrOp:
        return await self.tb.csr.access(addr, value, who=who, node=self.k)

    async def csr_write(self, path: str, value: int = 0, copy: int = 0, *,
                        who: str = "host", **fields: int) -> _CsrOp:
        block, reg = path.split(".")
        if fields:
            value = self.rmap[block][reg].encode(**fields)
        return await self.write_raw(self.rmap.address(path, copy), value, who)

    async def csr_read_reg(self, path: str, copy: int = 0) -> int:
        return (await self.tb.csr.access(self.rmap.address(path, copy), None,
                                         node=self.k)).result

    async def wait_cycles(self, n: int) -> None:
        await self.tb.wait_cycles(n)
