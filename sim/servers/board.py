"""The DmaNode pair as the ``board`` backend's device.

Two :class:`fpgaccl.hw.dma_node.DmaNode` engines, back to back, each with its host- and
GPU-memory models (:class:`~fpgaccl.sim.tb.dma_node_tb.TB`). Each rank of the ``board``
backend connects over a Unix socket (:mod:`fpgaccl.sim.servers.loop`), claims node
``rank`` and then does exactly what a driver does with a PCIe board
(:class:`fpgaccl.host.board_device.SimDevice` is the client): posted register writes and
register reads through the BAR, loads and stores in its pinned host memory, GPU memory
and page pinning for the GPU-peer window.
Everything else -- fetching work entries, DMA, the collective, completions -- is the
hardware's.

The clock runs free in batches of :data:`BATCH` cycles while any rank is connected (a
board does not stop while its host thinks); requests are served between batches. Like a
card, the board outlives the processes that use it: ranks may come and go (the engines
keep their state, the driver re-attaches), and it ends on a ``shutdown`` request or after
``idle_timeout_s`` without any rank.
Messages: the ``>II`` + JSON header + payload frames of :mod:`fpgaccl.proto.framing`.
"""

from __future__ import annotations

from cocotb.triggers import ClockCycles

from fpgaccl.proto.regmap import ENGINE_ID
from fpgaccl.sim.hdl.switch import node_ip, node_mac
from fpgaccl.sim.models.gpu import VA_BASE
from fpgaccl.sim.tb.dma_node_tb import TB
from fpgaccl.sim.tb.dma_node_top import PARAMS

from .loop import Client

BATCH = 32
"""Clock cycles between two looks at the socket."""


class BoardServer:
    """The DmaNode pair as the ``board`` backend's device (driven by
    :func:`fpgaccl.sim.servers.loop.serve`)."""

    name = "board server"

    def __init__(self, dut, p: dict) -> None:
        self.tb = TB(dut, seed=p.get("seed", 0))
        self.clients: dict[int, Client] = {}
        self.stop = False
        self.csr_ops = 0

    async def _csr(self, node: int, addr: int, value: int | None) -> int:
        op = await self.tb.csr.access(addr, value, node=node)
        self.csr_ops += 1
        return op.result

    async def handle(self, client: Client, h: dict, payload: bytes) -> None:
        op, tb = h.get("op"), self.tb
        if op == "hello":
            node = h.get("node")
            if not isinstance(node, int) or not 0 <= node < len(tb.hosts):
                return client.error("rank", f"node {node!r}: the device has "
                                    f"{len(tb.hosts)} engines")
            if node in self.clients:
                return client.error("rank", f"node {node} is already claimed")
            client.node = node
            self.clients[node] = client
            # A card's MAC comes from its EEPROM and its IP from the admin; these stand in.
            return client.ok({"nodes": len(tb.hosts), "width": tb.width,
                                 "mac": node_mac(node), "ip": node_ip(node),
                                 "gpu_va_base": VA_BASE, "clock_ns": 4, **PARAMS})
        node = client.node
        if node is None:
            return client.error("hello", f"{op!r} before hello")
        if op == "csr_write":
            for addr, value in h["writes"]:
                await self._csr(node, int(addr), int(value))
            return client.ok({"cycle": tb.cycle})
        if op == "csr_read":
            return client.ok({"value": await self._csr(node, int(h["addr"]), None)})
        if op == "host_write":
            tb.hosts[node].mem.write(int(h["addr"]), payload)
            return client.ok({})
        if op == "host_read":
            return client.ok({}, tb.hosts[node].mem.read(int(h["addr"]), int(h["n"])))
        if op == "gpu_alloc":
            return client.ok({"va": tb.gpus[node].alloc(int(h["nbytes"]))})
        if op == "gpu_write":
            tb.gpus[node].write_va(int(h["va"]), payload)
            return client.ok({})
        if op == "gpu_read":
            return client.ok({}, tb.gpus[node].read_va(int(h["va"]), int(h["n"])))
        if op == "gpu_pin":
            ptes = tb.gpus[node].register(int(h["va"]), int(h["nbytes"]), write=h["write"])
            return client.ok({"pages": [[e.index, e.bus, e.read, e.write] for e in ptes]})
        if op == "pause":
            await ClockCycles(tb.dut.clk, int(h.get("cycles", BATCH)))
            return client.ok({"cycle": tb.cycle})
        if op == "stats":
            return client.ok({"cycle": tb.cycle, "csr_ops": self.csr_ops})
        if op == "shutdown":
            self.stop = True
            return None
        return client.error("op", f"unknown request {op!r}")

    async def start(self) -> None:
        await self.tb.reset()
        for k in range(len(self.tb.hosts)):
            assert await self._csr(k, self.tb.rmap.address("ctrl.id"), None) == ENGINE_ID

    def left(self, client: Client) -> None:
        if client.node is not None and self.clients.get(client.node) is client:
            del self.clients[client.node]

    def busy(self) -> bool:
        return bool(self.clients)

    async def step(self) -> None:
        if self.clients:
            await ClockCycles(self.tb.dut.clk, BATCH)

    def sockets(self) -> list:
        return []

    def finished(self) -> bool:
        return False  # a board outlives its users: it ends on shutdown or when idle

    async def summary(self) -> dict:
        return {"cycles": self.tb.cycle, "csr_ops": self.csr_ops}

    def close(self) -> None:
        pass
