"""Copy engine and memory-port multiplexers against the simulation memory, on
Amaranth's simulator: unaligned sources and destinations, lengths across segments."""

import random

import pytest
from amaranth.hdl import Module
from amaranth.lib import wiring
from amaranth.sim import Simulator

from fpgaccl.hw.datapath.engines import CopyEngine
from fpgaccl.hw.datapath.memport import ReadMux, WriteMux
from fpgaccl.sim.hdl.memory import SimMemory

WIDTH = 64
NB = WIDTH // 8
SIZE = 8192


class Rig(wiring.Component):
    """Two copy engines sharing one memory through the multiplexers."""

    def __init__(self):
        self.copies = [CopyEngine(WIDTH, seg_bytes=64) for _ in range(2)]
        self.mem = SimMemory(WIDTH, SIZE, latency=3)
        super().__init__({})

    def elaborate(self, platform):
        m = Module()
        m.submodules.mem = mem = self.mem
        m.submodules.rmux = rmux = ReadMux(WIDTH, 2)
        m.submodules.wmux = wmux = WriteMux(WIDTH, 2)
        for i, c in enumerate(self.copies):
            m.submodules[f"copy{i}"] = c
            wiring.connect(m, c.rd_req, getattr(rmux, f"req{i}"))
            wiring.connect(m, getattr(rmux, f"resp{i}"), c.rd_resp)
            wiring.connect(m, c.wr, getattr(wmux, f"wr{i}"))
        wiring.connect(m, rmux.req, mem.rd_req)
        wiring.connect(m, mem.rd_resp, rmux.resp)
        wiring.connect(m, wmux.wr, mem.wr)
        return m


@pytest.mark.parametrize("seed", [1, 2])
def test_two_copy_engines_share_memory(seed):
    rig = Rig()
    rng = random.Random(seed)
    ref = bytearray(rng.getrandbits(8) for _ in range(SIZE))
    # Disjoint jobs, so their order does not matter: engine i copies within half i.
    jobs = []
    for i in range(2):
        lo = i * SIZE // 2
        n = rng.randint(1, 900)
        src = lo + rng.randrange(0, 1000)
        dst = lo + 2000 + rng.randrange(0, 1000)
        jobs.append((src, dst, n))

    async def bench(ctx):
        mem = rig.mem
        for i in range(SIZE // NB):
            ctx.set(mem.bd_addr, i)
            ctx.set(mem.bd_wdata, int.from_bytes(ref[i * NB:(i + 1) * NB], "little"))
            ctx.set(mem.bd_we, 1)
            await ctx.tick()
        ctx.set(mem.bd_we, 0)
        for c, (src, dst, n) in zip(rig.copies, jobs, strict=True):
            ctx.set(c.job.payload, {"src": src, "dst": dst, "len": n})
            ctx.set(c.job.valid, 1)
        await ctx.tick()
        for c in rig.copies:
            ctx.set(c.job.valid, 0)
        done = [False, False]
        for _ in range(5000):
            await ctx.tick()
            for i, c in enumerate(rig.copies):
                done[i] |= bool(ctx.get(c.done))
            if all(done):
                break
        assert all(done)
        for src, dst, n in jobs:
            ref[dst:dst + n] = ref[src:src + n]
        for i in range(SIZE // NB):
            ctx.set(mem.bd_addr, i)
            await ctx.tick()
            await ctx.delay(1e-9)
            got = ctx.get(mem.bd_rdata).to_bytes(NB, "little")
            assert got == bytes(ref[i * NB:(i + 1) * NB]), f"word {i}"

    sim = Simulator(rig)
    sim.add_clock(1e-8)
    sim.add_testbench(bench)
    sim.run()
