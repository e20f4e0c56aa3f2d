"""cocotb harness of :class:`fpgaccl.hw.dma.subsystem.DmaSubsystem`: AXI memory models on
the host and GPU ports, a CSR bus driver, a stand-in for the node on the work port, and
a driver model of the host runtime (rings in memory, doorbell, CQ polling).

Speed: one coroutine steps everything once per cycle. It samples at the falling edge,
when every handshake the next rising edge will take is settled, and drives new values
just after the rising edge; models act per handshake (a whole burst per AR), so the
per-cycle Python is a few signal reads per port.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass

import cocotb
from cocotb.clock import Clock
from cocotb.triggers import ClockCycles, FallingEdge, RisingEdge

from fpgaccl.hw.dma.axi import B_LAYOUT, addr_layout, r_layout, w_layout
from fpgaccl.hw.dma.layouts import CQE, CQE_BYTES, WORK_DONE, WQE, WQE_BYTES, Space
from fpgaccl.hw.dma.subsystem import subsystem_map
from fpgaccl.sim.models.gpu import VA_BASE, GpuKernel, GpuMemory
from fpgaccl.sim.models.host_memory import AxiMemory, HostMemory
from fpgaccl.sim.models.stream import pack, unpack

CLK_NS = 4


def _u(h) -> int:
    return h.value.to_unsigned()


class AxiPort:
    """Binds an :class:`AxiMemory` to the DUT's ``<prefix>__*`` AXI4 manager port."""

    def __init__(self, dut, prefix: str, model: AxiMemory) -> None:
        self.model = model
        g = lambda ch, sig: getattr(dut, f"{prefix}__{ch}__{sig}")  # noqa: E731
        self.sig = {f"{ch}_{s}": g(ch, s) for ch in ("ar", "r", "aw", "w", "b")
                    for s in ("valid", "ready", "payload")}
        w = model.width
        self.lay = {"ar": addr_layout(), "aw": addr_layout(), "r": r_layout(w),
                    "w": w_layout(w), "b": B_LAYOUT}
        self.o = model.outputs()
        self._last: dict[str, int] = {}
        self._drive()

    def _drive(self) -> None:
        # A write through the simulator interface costs far more than a dict lookup, and
        # most outputs hold for many cycles: write only what changed.
        o, s, last = self.o, self.sig, self._last
        want = {"ar_ready": int(o["ar_ready"]), "aw_ready": int(o["aw_ready"]),
                "w_ready": int(o["w_ready"]), "r_valid": int(o["r_valid"]),
                "b_valid": int(o["b_valid"])}
        if o["r"]:
            want["r_payload"] = pack(self.lay["r"], o["r"])
        if o["b"]:
            want["b_payload"] = pack(self.lay["b"], o["b"])
        for name, value in want.items():
            if last.get(name) != value:
                s[name].value = value
                last[name] = value

    def sample(self) -> None:
        o, s, hs = self.o, self.sig, {}
        if o["ar_ready"] and s["ar_valid"].value:
            hs["ar"] = unpack(self.lay["ar"], _u(s["ar_payload"]))
        if o["aw_ready"] and s["aw_valid"].value:
            hs["aw"] = unpack(self.lay["aw"], _u(s["aw_payload"]))
        if o["w_ready"] and s["w_valid"].value:
            hs["w"] = unpack(self.lay["w"], _u(s["w_payload"]))
        hs["r"] = bool(o["r_valid"] and s["r_ready"].value)
        hs["b"] = bool(o["b_valid"] and s["b_ready"].value)
        self.hs = hs

    def step(self, cycle: int) -> None:
        self.model.cycle = cycle     # handshakes are stamped with the bench's cycle count
        self.model.commit(**self.hs)
        self.o = self.model.outputs()
        self._drive()


@dataclass
class _CsrOp:
    addr: int
    value: int | None          # None: a read
    who: str
    done: cocotb.triggers.Event
    result: int = 0
    cycle: int = 0


class CsrBus:
    """The CSR strobe bus, one access at a time. ``r_data`` is registered: a read's word
    is sampled at the falling edge after its ``r_stb`` edge. With ``steered`` the bus
    drives ``sel`` with each access's node (a DUT holding several nodes)."""

    def __init__(self, dut, *, steered: bool = False) -> None:
        self.dut = dut
        self.steered = steered
        self.queue: deque[tuple[int, _CsrOp]] = deque()
        self.pending: _CsrOp | None = None
        self.log: list[_CsrOp] = []
        self._rdata = 0
        dut.csr__w_stb.value = 0
        dut.csr__r_stb.value = 0

    async def access(self, addr: int, value: int | None, *, who: str = "host",
                     node: int = 0) -> _CsrOp:
        op = _CsrOp(addr, value, who, cocotb.triggers.Event())
        self.queue.append((node, op))
        await op.done.wait()
        return op

    def sample(self) -> None:
        """At the falling edge."""
        if self.pending is not None:
            self._rdata = _u(self.dut.csr__r_data)

    def step(self, cycle: int) -> None:
        """Just after the rising edge."""
        dut = self.dut
        if self.pending is not None and cycle > self.pending.cycle + 1:
            op, self.pending = self.pending, None
            op.result = self._rdata
            op.done.set()
        elif self.pending is not None:
            return
        dut.csr__w_stb.value = 0
        dut.csr__r_stb.value = 0
        if self.queue:
            node, op = self.queue.popleft()
            op.cycle = cycle
            if self.steered:
                dut.sel.value = node
            dut.csr__addr.value = op.addr
            if op.value is None:
                dut.csr__r_stb.value = 1
                self.pending = op
            else:
                dut.csr__w_data.value = op.value
                dut.csr__w_stb.value = 1
                op.done.set()
            self.log.append(op)


async def reset_then(dut, loop) -> None:
    """Hold reset three cycles, release it, then start the bench's per-cycle ``loop``."""
    dut.rst.value = 1
    await ClockCycles(dut.clk, 3)
    dut.rst.value = 0
    await ClockCycles(dut.clk, 1)
    cocotb.start_soon(loop())


class TB:
    def __init__(self, dut, *, width: int, stall: float = 0.0, seed: int = 0,
                 host_kw: dict | None = None, gpu_kw: dict | None = None,
                 gpu_pages: int = 64) -> None:
        self.dut = dut
        self.width = width
        self.rmap = subsystem_map(gpu_pages=gpu_pages)
        self.rng = random.Random(seed)
        Clock(dut.clk, CLK_NS, unit="ns").start()
        self.host = HostMemory(width, stall=stall, seed=seed + 1, **(host_kw or {}))
        self.gpu = GpuMemory(width, pages=gpu_pages, stall=stall, seed=seed + 2,
                             **(gpu_kw or {}))
        self.ports = [AxiPort(dut, "host", self.host), AxiPort(dut, "gpu", self.gpu)]
        self.csr = CsrBus(dut)
        self.work_latency = 50
        self.work_log: list[tuple[int, dict]] = []
        self._work_due: deque[tuple[int, dict]] = deque()
        self.kernels: list[GpuKernel] = []
        self.cycle = 0
        dut.work__ready.value = 1
        dut.work_done__valid.value = 0

    # -- clocking --------------------------------------------------------------
    async def reset(self) -> None:
        await reset_then(self.dut, self._loop)

    async def _loop(self) -> None:
        dut = self.dut
        fe, re = FallingEdge(dut.clk), RisingEdge(dut.clk)
        while True:
            await fe
            for p in self.ports:
                p.sample()
            work = None
            if dut.work__valid.value:
                work = unpack(WQE, _u(dut.work__payload))
            done_taken = bool(dut.work_done__valid.value and dut.work_done__ready.value)
            self.csr.sample()
            await re
            self.cycle += 1
            for p in self.ports:
                p.step(self.cycle)
            self.csr.step(self.cycle)
            self._work_step(work, done_taken)
            for k in self.kernels:
                k.poll(self.cycle)

    def _work_step(self, work, done_taken: bool) -> None:
        """Stand-in for the node: a WORK entry is done ``work_latency`` cycles later."""
        dut = self.dut
        if work is not None:
            self.work_log.append((self.cycle, work))
            self._work_due.append((self.cycle + self.work_latency, work))
        if done_taken:
            self._work_due.popleft()
            dut.work_done__valid.value = 0
        if self._work_due and self._work_due[0][0] <= self.cycle:
            dut.work_done__valid.value = 1
            dut.work_done__payload.value = pack(WORK_DONE, {"status": 0, "len": 0})

    # -- CSR access (the host's BAR, or the GPU's peer-window stores) -------------
    async def csr_write(self, path: str, value: int = 0, copy: int = 0, *,
                        who: str = "host", **fields: int) -> _CsrOp:
        block, reg = path.split(".")
        if fields:
            value = self.rmap[block][reg].encode(**fields)
        return await self.csr.access(self.rmap.address(path, copy), value, who=who)

    async def csr_read_reg(self, path: str, copy: int = 0) -> int:
        return (await self.csr.access(self.rmap.address(path, copy), None)).result

    async def wait_cycles(self, n: int) -> None:
        await ClockCycles(self.dut.clk, n)


class Driver:
    """The host runtime's view: rings in host (or GPU) memory, windows, registration,
    posting work, the doorbell, reaping completions by their phase bit."""

    SQ = 0x0800_0000
    CQ = 0x0801_0000

    def __init__(self, tb: TB, *, sq_log2: int = 4, cq_log2: int = 4,
                 sq_space: int = Space.HOST, sq_va: int | None = None) -> None:
        self.tb = tb
        self.sq_log2, self.cq_log2 = sq_log2, cq_log2
        self.sq_space = sq_space
        self.sq_addr = sq_va if sq_space == Space.GPU else self.SQ
        self.tail = 0
        self.cq_head = 0
        self.next_id = 1

    async def setup(self, *, host_windows=((0, 0xFFFF_F000, True, True),),
                    flag_va: int | None = None, enable: bool = True, max_rd: int = 16,
                    max_wr: int = 16) -> None:
        tb = self.tb
        for i, (base, length, r, w) in enumerate(host_windows):
            await tb.csr_write("dma_host.base_lo", base & 0xFFFF_FFFF, i)
            await tb.csr_write("dma_host.base_hi", base >> 32, i)
            await tb.csr_write("dma_host.length", length & 0xFFFF_FFFF, i)
            await tb.csr_write("dma_host.access", copy=i, read=int(r), write=int(w))
        await tb.csr_write("dma.gpu_va_lo", VA_BASE & 0xFFFF_FFFF)
        await tb.csr_write("dma.gpu_va_hi", VA_BASE >> 32)
        await tb.csr_write("dma.sq_base_lo", self.sq_addr & 0xFFFF_FFFF)
        await tb.csr_write("dma.sq_base_hi", self.sq_addr >> 32)
        await tb.csr_write("dma.sq_cfg", log2_size=self.sq_log2, space=self.sq_space)
        await tb.csr_write("dma.cq_base_lo", self.CQ & 0xFFFF_FFFF)
        await tb.csr_write("dma.cq_base_hi", self.CQ >> 32)
        await tb.csr_write("dma.cq_cfg", log2_size=self.cq_log2, space=Space.HOST)
        tb.host.mem.write(self.CQ, bytes(CQE_BYTES << self.cq_log2))
        if flag_va is not None:
            await tb.csr_write("dma.flag_lo", flag_va & 0xFFFF_FFFF)
            await tb.csr_write("dma.flag_hi", flag_va >> 32)
            await tb.csr_write("dma.flag_cfg", enable=1, space=Space.GPU)
        await tb.csr_write("dma.control", enable=int(enable), max_rd=max_rd, max_wr=max_wr)

    async def register_gpu(self, va: int, nbytes: int, *, write: bool = True) -> None:
        """Install the pages' entries, as the runtime does after pinning them."""
        reg = self.tb.rmap["dma_gpt"]["pte0"]
        for pte in self.tb.gpu.register(va, nbytes, write=write):
            value = reg.encode(valid=1, read=int(pte.read), write=int(pte.write),
                               page=pte.bus >> 16)
            await self.tb.csr_write(f"dma_gpt.pte{pte.index}", value)

    async def unregister_gpu(self, va: int, nbytes: int) -> None:
        """Invalidate the entries (the page table lives in RAM: reset does not clear it)."""
        first = (va - VA_BASE) >> 16
        for i in range(first, -(-(va + nbytes - VA_BASE) // (1 << 16))):
            await self.tb.csr_write(f"dma_gpt.pte{i}", 0)

    def put_wqe(self, **fields: int) -> int:
        """Write an entry into the SQ (no doorbell); returns its wr_id."""
        fields.setdefault("wr_id", self.next_id)
        self.next_id += 1
        raw = pack(WQE, fields).to_bytes(WQE_BYTES, "little")
        addr = self.sq_addr + (self.tail % (1 << self.sq_log2)) * WQE_BYTES
        if self.sq_space == Space.GPU:
            self.tb.gpu.write_va(addr, raw)
        else:
            self.tb.host.mem.write(addr, raw)
        self.tail = (self.tail + 1) & 0xFFFF
        return fields["wr_id"]

    async def doorbell(self, who: str = "host") -> _CsrOp:
        return await self.tb.csr_write("dma.sq_tail", index=self.tail, who=who)

    async def doorbell_after(self, _wr_id: int, who: str = "host") -> _CsrOp:
        return await self.doorbell(who)

    def poll_cqe(self) -> dict | None:
        slot = self.cq_head % (1 << self.cq_log2)
        raw = self.tb.host.mem.read(self.CQ + slot * CQE_BYTES, CQE_BYTES)
        cqe = unpack(CQE, int.from_bytes(raw, "little"))
        phase = 1 - (self.cq_head >> self.cq_log2) % 2
        if cqe["phase"] != phase:
            return None
        self.cq_head = (self.cq_head + 1) & 0xFFFF
        return cqe

    async def idle(self) -> None:
        """Until the engine is idle (the last CQE's and flag's writes have completed)."""
        status = self.tb.rmap["dma"]["status"]
        while status.decode(await self.tb.csr_read_reg("dma.status"))["busy"]:
            await self.tb.wait_cycles(8)

    async def reap(self, n: int, timeout: int = 100_000) -> list[dict]:
        out: list[dict] = []
        waited = 0
        while len(out) < n:
            cqe = self.poll_cqe()
            if cqe is None:
                await self.tb.wait_cycles(8)
                waited += 8
                if waited > timeout:
                    regs = {r: await self.tb.csr_read_reg(f"dma.{r}") for r in (
                        "status", "sq_head", "cq_tail", "unmapped", "forbidden",
                        "bus_errors")}
                    raise AssertionError(
                        f"only {len(out)} of {n} completions; {regs}; "
                        f"host {self.tb.host.counts}, gpu {self.tb.gpu.counts}")
                continue
            out.append(cqe)
        await self.tb.csr_write("dma.cq_head", self.cq_head)
        return out
