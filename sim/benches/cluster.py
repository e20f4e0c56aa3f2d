"""cocotb bench: collectives on N simulated nodes (the full HDL node: parser, transport,
sequencer, router, engines) joined by the hardware switch. Python only programs the
registers and fills/reads memories; the run itself is Verilator alone."""

import json
import random
import time

import cocotb
import numpy as np
from cocotb.clock import Clock
from cocotb.triggers import ClockCycles, RisingEdge

from fpgaccl.host.csr_plan import Peer, collective_writes, connect_writes, doorbell
from fpgaccl.proto import programs as P
from fpgaccl.proto.reduce import DType, ReduceOp
from fpgaccl.proto.regmap import ENGINE_ID, default_map
from fpgaccl.sim import bench_params
from fpgaccl.sim.hdl.switch import node_ip, node_mac
from fpgaccl.sim.models.sequencer import SequencerModel


class TB:
    def __init__(self, dut, p):
        self.dut, self.p = dut, p
        self.nodes, self.width = p["nodes"], p["width"]
        self.nb = self.width // 8
        self.rmap = default_map(qps=p["qps"], imem_words=p["imem_words"])
        Clock(dut.clk, 4, unit="ns").start()

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


async def run(tb, name, gen, world, xs, dtype, op, coll_id, psn_seed):
    rmap = tb.rmap
    n = len(xs[0])
    bufs = tb.layout(xs[0].nbytes)
    peers = [Peer(node_mac(k), node_ip(k), 0x1000 + k, bufs) for k in range(world)]
    rng = random.Random(psn_seed)
    psns = {(a, b): rng.randrange(1 << 24) for a in range(world) for b in range(world)}
    for k in range(world):
        await tb.csr_write(k, connect_writes(rmap, k, peers, psn=lambda a, b: psns[(a, b)],
                                             mem_base=0, mem_len=4 * bufs[1], mtu_log2=10))
        await tb.mem_write(k, bufs[0], xs[k].tobytes())
        await tb.csr_write(k, collective_writes(rmap, gen(k), buffers=bufs, count=n,
                                                dtype=dtype, op=op))
    start = int(tb.dut.cycles.value)
    wall = time.perf_counter()
    for k in range(world):
        await tb.csr_write(k, [doorbell(rmap, coll_id)])
    seen = 0
    limit = tb.p.get("max_cycles", 2_000_000)
    while seen != (1 << world) - 1:
        await ClockCycles(tb.dut.clk, 64)
        # `done` pulses; `busy` low after a start means the program ended.
        busy = int(tb.dut.busy.value)
        for k in range(world):
            if not busy >> k & 1:
                seen |= 1 << k
        assert int(tb.dut.cycles.value) - start < limit, f"{name}: no completion"
    cycles = int(tb.dut.cycles.value) - start
    tb.last_wall = time.perf_counter() - wall
    status = rmap.address("ctrl.status")
    outs = []
    for k in range(world):
        st = rmap["ctrl"]["status"].decode(await tb.csr_read(k, status))
        assert not st["error"], f"{name}: node {k} reports an error"
        raw = await tb.mem_read(k, bufs[1], xs[k].nbytes)
        outs.append(np.frombuffer(raw, dtype=xs[k].dtype))
    return outs, cycles


@cocotb.test()
async def collectives_on_the_cluster(dut):
    p = bench_params()
    tb = TB(dut, p)
    await tb.reset()
    assert await tb.csr_read(0, tb.rmap.address("ctrl.id")) == ENGINE_ID
    world = p["nodes"]
    dut.loss.value = p.get("loss", 0)
    log = []
    report = []
    cases = [
        ("ring_allreduce", lambda r: P.ring_allreduce(r, world), DType.INT32, np.int32),
        ("rhd_allreduce", lambda r: P.rhd_allreduce(r, world), DType.FLOAT32, np.float32),
        ("chain_broadcast", lambda r: P.chain_broadcast(r, world, 1 % world), DType.INT32,
         np.int32),
        ("alltoall", lambda r: P.alltoall(r, world), DType.INT32, np.int32),
    ]
    selected = p.get("cases")
    for i, (name, gen, dtype, npt) in enumerate(cases):
        if selected and name not in selected:
            continue
        if p.get("float_only"):
            dtype, npt = DType.FLOAT32, np.float32
        rng = np.random.default_rng(i)
        n = p.get("count", 300) // world * world
        xs = [(rng.standard_normal(n) * 100).astype(npt) for _ in range(world)]
        outs, cycles = await run(tb, name, gen, world, xs, dtype, ReduceOp.SUM, i + 1, i)
        want = SequencerModel([gen(r) for r in range(world)], xs, dtype, ReduceOp.SUM).run()
        for k in range(world):
            assert outs[k].tobytes() == want[k].tobytes(), \
                f"{name} node {k}:\n got {outs[k][:16]}\nwant {want[k][:16]}"
        log.append(f"{name} {world} nodes {n} x {dtype.name}: {cycles} cycles, "
                   f"{int(dut.dropped.value)} frames dropped so far")
        report.append({"collective": name, "nodes": world, "count": n,
                       "dtype": dtype.name.lower(), "bytes": int(xs[0].nbytes),
                       "cycles": cycles, "wall_s": tb.last_wall,
                       "dropped": int(dut.dropped.value)})
    if p.get("expect_drops"):
        assert int(dut.dropped.value) > 0, "the lossy run dropped nothing: loss not applied"
    dut._log.info("\n".join(log))
    if p.get("report"):
        with open(p["report"], "w") as f:
            json.dump(report, f)
