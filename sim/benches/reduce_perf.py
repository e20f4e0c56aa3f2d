"""cocotb measurement of the reduction unit's throughput and latency: for each supported
dtype x op, a long unstalled stream of beats; writes the numbers as JSON to the path in
the bench parameter ``out``."""

from __future__ import annotations

import json

import cocotb
from cocotb.triggers import RisingEdge

from fpgaccl.proto.reduce import SUPPORTED, reduce_bytes
from fpgaccl.sim import bench_params
from fpgaccl.sim.benches.reduce_unit import TB


@cocotb.test()
async def throughput(dut) -> None:
    params = bench_params()
    nbeats = params.get("beats", 256)
    tb = TB(dut, seed=5)
    await tb.reset()
    tb.sink.ready.value = 1
    rows = []
    for dtype, op in SUPPORTED:
        a, b = tb.frame(dtype, nbeats)
        want = reduce_bytes(dtype, op, a, b)
        sender = cocotb.start_soon(tb.send(dtype, op, a, b))
        cycle = 0
        first_in = first_out = last_out = None
        taken = 0
        out = []
        # Sample once per edge: a handshake happened at an edge iff valid and ready
        # were both high just before it.
        while len(out) < nbeats:
            await RisingEdge(dut.clk)
            if dut.a__valid.value and dut.a__ready.value:
                first_in = cycle if first_in is None else first_in
                taken += 1
            if dut.o__valid.value and dut.o__ready.value:
                first_out = cycle if first_out is None else first_out
                last_out = cycle
                out.append(int(dut.o__payload.value) & ((1 << tb.width) - 1))
            cycle += 1
        await sender
        got = b"".join(x.to_bytes(tb.width // 8, "little") for x in out)
        rows.append({
            "dtype": dtype.name.lower(), "op": op.name.lower(), "beats": nbeats,
            "width": tb.width, "latency_cycles": first_out - first_in,
            "output_cycles": last_out - first_out + 1,
            "beats_per_cycle": nbeats / (last_out - first_out + 1),
            "wrong": int(got != want),
        })
        await RisingEdge(dut.clk)
    with open(params["out"], "w") as f:
        json.dump(rows, f)
