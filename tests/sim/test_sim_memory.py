"""The simulation memory model on Amaranth's simulator: unaligned writes and reads
against a bytearray."""

import random

import pytest
from amaranth.sim import Simulator

from fpgaccl.sim.hdl.memory import SimMemory


@pytest.mark.parametrize("width", [64, 128])
def test_unaligned_reads_and_writes(width):
    size = 4096
    nb = width // 8
    dut = SimMemory(width, size, latency=2)
    rng = random.Random(width)
    ref = bytearray(size)

    async def bench(ctx):
        # Fill through the backdoor.
        for i in range(size // nb):
            word = bytes(rng.getrandbits(8) for _ in range(nb))
            ref[i * nb:(i + 1) * nb] = word
            ctx.set(dut.bd_addr, i)
            ctx.set(dut.bd_wdata, int.from_bytes(word, "little"))
            ctx.set(dut.bd_we, 1)
            await ctx.tick()
        ctx.set(dut.bd_we, 0)
        # Unaligned write beats with partial masks.
        for _ in range(40):
            addr = rng.randrange(0, size - 2 * nb)
            n = rng.randint(1, nb)
            data = bytes(rng.getrandbits(8) for _ in range(nb))
            ref[addr:addr + n] = data[:n]
            ctx.set(dut.wr.payload.addr, addr)
            ctx.set(dut.wr.payload.data, int.from_bytes(data, "little"))
            ctx.set(dut.wr.payload.keep, (1 << n) - 1)
            ctx.set(dut.wr.valid, 1)
            await ctx.tick()
        ctx.set(dut.wr.valid, 0)
        # Unaligned reads of random lengths, with random back-pressure.
        for _ in range(30):
            addr = rng.randrange(0, size - 200)
            n = rng.randint(1, 150)
            ctx.set(dut.rd_req.payload.addr, addr)
            ctx.set(dut.rd_req.payload.len, n)
            ctx.set(dut.rd_req.valid, 1)
            await ctx.tick().until(dut.rd_req.ready)
            ctx.set(dut.rd_req.valid, 0)
            got = bytearray()
            while True:
                ready = rng.random() < 0.7
                ctx.set(dut.rd_resp.ready, ready)
                _, _, valid, payload = await ctx.tick().sample(dut.rd_resp.valid,
                                                               dut.rd_resp.payload)
                if valid and ready:
                    keep = payload.keep
                    got += payload.data.to_bytes(nb, "little")[:keep.bit_length()]
                    if payload.last:
                        break
            ctx.set(dut.rd_resp.ready, 0)
            assert bytes(got) == bytes(ref[addr:addr + n]), (addr, n)

    sim = Simulator(dut)
    sim.add_clock(1e-8)
    sim.add_testbench(bench)
    sim.run()
