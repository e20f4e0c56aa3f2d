"""cocotb bench of the link impairment pipe (:class:`fpgaccl.sim.hdl.link.Link`) on
Verilator: frames through with latency, duplication and back-pressure; every frame must
come out twice, whole and in order, no sooner than the latency register says."""

from __future__ import annotations

import random

import cocotb
from cocotb.clock import Clock
from cocotb.triggers import ClockCycles, RisingEdge

from fpgaccl.sim import bench_params
from fpgaccl.sim.hdl.link import LINK_COUNTERS, LINK_REGS, ONE
from fpgaccl.sim.models.stream import StreamSink, StreamSource


@cocotb.test()
async def duplicated_frames_after_the_latency(dut) -> None:
    p = bench_params()
    width = p["width"]
    rng = random.Random(3)
    Clock(dut.clk, 4, unit="ns").start()
    src = StreamSource(dut, "i", dut.clk, width, idle_prob=0.2, rng=random.Random(1))
    sink = StreamSink(dut, "o", dut.clk, width, stall_prob=0.3, rng=random.Random(2))
    dut.cfg__w_stb.value = 0
    dut.rst.value = 1
    await ClockCycles(dut.clk, 3)
    dut.rst.value = 0
    for name, value in (("latency", 50), ("dup", ONE - 1)):
        dut.cfg__addr.value, dut.cfg__w_data.value, dut.cfg__w_stb.value = (
            LINK_REGS[name], value, 1)
        await RisingEdge(dut.clk)
    dut.cfg__w_stb.value = 0
    frames = [rng.randbytes(rng.randint(62, 300)) for _ in range(12)]

    async def produce():
        for f in frames:
            await src.send(f)

    start = cocotb.utils.get_sim_time("ns")
    cocotb.start_soon(produce())
    first = True
    for i, want in enumerate(frames):
        for copy in range(2):
            got = await sink.recv()
            if first:
                first = False
                assert (cocotb.utils.get_sim_time("ns") - start) / 4 >= 50
            assert got == want, f"frame {i} copy {copy}: {got.hex()} != {want.hex()}"
    dut.cfg__addr.value = LINK_COUNTERS["duplicated"]
    await RisingEdge(dut.clk)
    assert int(dut.cfg__r_data.value) == len(frames)
