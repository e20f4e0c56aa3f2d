"""The sequencer's iterative ceil-divider on Amaranth's simulator."""

import random

from amaranth.sim import Simulator

from fpgaccl.hw.sequencer.divider import CeilDivider


def test_ceil_division():
    dut = CeilDivider(32, 16)
    rng = random.Random(3)
    cases = [(0, 1), (1, 1), (10, 4), (8, 4), (1, 8), (2**32 - 1, 1), (2**32 - 1, 65535),
             (5, 7)] + [(rng.getrandbits(32), rng.randint(1, 65535)) for _ in range(30)]

    async def bench(ctx):
        for n, d in cases:
            ctx.set(dut.dividend, n)
            ctx.set(dut.divisor, d)
            ctx.set(dut.start, 1)
            await ctx.tick()
            ctx.set(dut.start, 0)
            cycles = 0
            while ctx.get(dut.busy):
                await ctx.tick()
                cycles += 1
            assert ctx.get(dut.quotient) == -(-n // d), (n, d)
            assert cycles == 33

    sim = Simulator(dut)
    sim.add_clock(1e-8)
    sim.add_testbench(bench)
    sim.run()
