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


def test_channels_run_side_by_side():
    """Two read and two write channels over one storage: all four move a beat every
    cycle at once, and each sees the others' data."""
    width, size, nb = 64, 4096, 8
    dut = SimMemory(width, size, latency=2, reads=2, writes=2)
    rng = random.Random(7)
    ref = bytearray(rng.getrandbits(8) for _ in range(size))
    beats = 32

    async def bench(ctx):
        for i in range(size // nb):
            ctx.set(dut.bd_addr, i)
            ctx.set(dut.bd_wdata, int.from_bytes(ref[i * nb:(i + 1) * nb], "little"))
            ctx.set(dut.bd_we, 1)
            await ctx.tick()
        ctx.set(dut.bd_we, 0)
        # Unaligned reads of two regions on the two read channels, while the two write
        # channels fill two other regions, one beat per cycle each.
        reads = [(3, beats * nb), (1001, beats * nb)]
        for name, (addr, n) in zip(("rd_req", "rd_req1"), reads, strict=True):
            req = getattr(dut, name)
            ctx.set(req.payload.addr, addr)
            ctx.set(req.payload.len, n)
            ctx.set(req.valid, 1)
        for resp in (dut.rd_resp, dut.rd_resp1):
            ctx.set(resp.ready, 1)
        got = [bytearray(), bytearray()]
        writes = [(2053, bytearray()), (3077, bytearray())]
        cycles = 0
        while any(len(g) < n for g, (_, n) in zip(got, reads, strict=True)):
            for wr, (base, sent) in zip((dut.wr, dut.wr1), writes, strict=True):
                if len(sent) < beats * nb:
                    data = bytes(rng.getrandbits(8) for _ in range(nb))
                    ctx.set(wr.payload.addr, base + len(sent))
                    ctx.set(wr.payload.data, int.from_bytes(data, "little"))
                    ctx.set(wr.payload.keep, (1 << nb) - 1)
                    ctx.set(wr.valid, 1)
                    sent += data
                else:
                    ctx.set(wr.valid, 0)
            await ctx.tick()
            cycles += 1
            for req in (dut.rd_req, dut.rd_req1):
                ctx.set(req.valid, 0)
            for g, resp in zip(got, (dut.rd_resp, dut.rd_resp1), strict=True):
                if ctx.get(resp.valid):
                    g += ctx.get(resp.payload.data).to_bytes(nb, "little")
        # Every channel at a beat per cycle: the reads end after their beats plus the
        # pipeline, not after twice that.
        assert cycles <= beats + 6, cycles
        for g, (addr, n) in zip(got, reads, strict=True):
            assert bytes(g[:n]) == bytes(ref[addr:addr + n])
        for base, sent in writes:
            ref[base:base + len(sent)] = sent
        for wr in (dut.wr, dut.wr1):
            ctx.set(wr.valid, 0)
        await ctx.tick()
        # Read the written regions back through the second channel.
        for base, sent in writes:
            ctx.set(dut.rd_req1.payload.addr, base)
            ctx.set(dut.rd_req1.payload.len, len(sent))
            ctx.set(dut.rd_req1.valid, 1)
            await ctx.tick().until(dut.rd_req1.ready)
            ctx.set(dut.rd_req1.valid, 0)
            back = bytearray()
            while len(back) < len(sent):
                await ctx.tick()
                if ctx.get(dut.rd_resp1.valid):
                    back += ctx.get(dut.rd_resp1.payload.data).to_bytes(nb, "little")
            assert bytes(back[:len(sent)]) == bytes(sent)

    sim = Simulator(dut)
    sim.add_clock(1e-8)
    sim.add_testbench(bench)
    sim.run()
