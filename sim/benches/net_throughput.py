"""cocotb side of ``bench/net_throughput.py``: the traffic generators and counters are in
the HDL top, so Python only starts a GPI clock, raises ``go``, waits one long timer and
reads the counters (no per-cycle Python)."""

from __future__ import annotations

import json
from pathlib import Path

import cocotb
from cocotb.clock import Clock
from cocotb.triggers import ClockCycles, Timer

from fpgaccl.sim import bench_params

COUNTERS = ("cycles", "p_in", "p_pay", "p_hdr", "p_first_in", "p_first_hdr", "p_first_out",
            "p_bad", "b_out", "b_frames", "b_pay_in", "b_first_in", "b_first_out", "b_bad")


@cocotb.test()
async def measure(dut) -> None:
    params = bench_params()
    Clock(dut.clk, 2, unit="ns", impl="gpi").start()
    dut.go.value = 0
    dut.rst.value = 1
    await ClockCycles(dut.clk, 3)
    dut.rst.value = 0
    await ClockCycles(dut.clk, 2)
    dut.go.value = 1
    await Timer(2 * params["cycles"], unit="ns")
    dut.go.value = 0
    await ClockCycles(dut.clk, 1)
    out = {name: int(getattr(dut, name).value) for name in COUNTERS}
    Path(params["out"]).write_text(json.dumps(out))
