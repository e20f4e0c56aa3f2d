"""cocotb bench of :class:`fpgaccl.hw.stream.fifo.BeatFIFO`: random frames in, with
random idle cycles on the input and random back-pressure on the output; every frame must
come out whole, in order, byte for byte."""

from __future__ import annotations

import random

import cocotb
from cocotb.clock import Clock
from cocotb.triggers import ClockCycles

from fpgaccl.sim import bench_params
from fpgaccl.sim.models.stream import StreamSink, StreamSource


class TB:
    def __init__(self, dut, *, idle: float, stall: float, seed: int) -> None:
        self.dut = dut
        self.width = bench_params()["width"]
        rng = random.Random(seed)
        self.rng = rng
        Clock(dut.clk, 4, unit="ns").start()
        self.source = StreamSource(dut, "i", dut.clk, self.width, idle_prob=idle,
                                   rng=random.Random(rng.random()))
        self.sink = StreamSink(dut, "o", dut.clk, self.width, stall_prob=stall,
                               rng=random.Random(rng.random()))

    async def reset(self) -> None:
        self.dut.rst.value = 1
        await ClockCycles(self.dut.clk, 3)
        self.dut.rst.value = 0
        await ClockCycles(self.dut.clk, 1)


@cocotb.test()
@cocotb.parametrize(idle=[0.0, 0.3], stall=[0.0, 0.5])
async def frames_pass_in_order(dut, idle: float, stall: float) -> None:
    tb = TB(dut, idle=idle, stall=stall, seed=int(idle * 10 + stall * 100))
    await tb.reset()
    frames = [bytes(tb.rng.getrandbits(8) for _ in range(tb.rng.randint(1, 200)))
              for _ in range(40)]

    async def produce():
        for f in frames:
            await tb.source.send(f)

    cocotb.start_soon(produce())
    for i, want in enumerate(frames):
        got = await tb.sink.recv()
        assert got == want, f"frame {i}: got {got.hex()} want {want.hex()}"


@cocotb.test()
async def full_rate_when_unstalled(dut) -> None:
    """With no idles and no stalls the FIFO passes one beat per cycle."""
    tb = TB(dut, idle=0.0, stall=0.0, seed=7)
    await tb.reset()
    frame = bytes(range(256)) * 8
    beats = -(-len(frame) // (tb.width // 8))
    cocotb.start_soon(tb.source.send(frame))
    start = cocotb.utils.get_sim_time("ns")
    got = await tb.sink.recv()
    cycles = (cocotb.utils.get_sim_time("ns") - start) / 4
    assert got == frame
    # The buffered FIFO adds a fixed latency of a couple of cycles, never per beat.
    assert cycles <= beats + 4, f"{beats} beats took {cycles} cycles"
