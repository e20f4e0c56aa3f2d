"""The stream skid buffer on Amaranth's simulator: every beat comes out once, in order,
under random valid/ready on both sides; full throughput when both sides always go."""

import random

import pytest
from amaranth.sim import Simulator

from fpgaccl.hw.stream.skid import SkidBuffer


def _run(dut, bench):
    sim = Simulator(dut)
    sim.add_clock(1e-8)
    sim.add_testbench(bench)
    sim.run()


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_beats_pass_once_in_order_under_random_stalls(seed):
    rng = random.Random(seed)
    dut = SkidBuffer(16)
    beats = [rng.getrandbits(16) for _ in range(200)]
    got = []

    async def bench(ctx):
        sent = 0
        for _ in range(2000):
            if sent == len(beats) and len(got) == len(beats):
                break
            offer = sent < len(beats) and rng.random() < 0.7
            ctx.set(dut.i.valid, offer)
            if offer:
                ctx.set(dut.i.payload, beats[sent])
            ctx.set(dut.o.ready, rng.random() < 0.6)
            # Sample both handshakes before the edge that completes them.
            took_in = offer and ctx.get(dut.i.ready)
            if ctx.get(dut.o.valid) and ctx.get(dut.o.ready):
                got.append(ctx.get(dut.o.payload))
            await ctx.tick()
            sent += took_in

    _run(dut, bench)
    assert got == beats


def test_one_beat_per_cycle_when_nothing_stalls():
    dut = SkidBuffer(8)
    got = []

    async def bench(ctx):
        ctx.set(dut.o.ready, 1)
        for n in range(20):
            ctx.set(dut.i.valid, 1)
            ctx.set(dut.i.payload, n)
            assert ctx.get(dut.i.ready)
            if ctx.get(dut.o.valid):
                got.append(ctx.get(dut.o.payload))
            await ctx.tick()

    _run(dut, bench)
    # One cycle of latency, then a beat every cycle.
    assert got == list(range(19))
