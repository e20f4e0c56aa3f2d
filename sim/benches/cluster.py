"""cocotb bench: collectives on N simulated nodes (the full HDL node: parser, transport,
sequencer, router, engines) joined by the hardware switch. Python only programs the
registers and fills/reads memories; the run itself is Verilator alone."""

import json
import random
import time

import cocotb
import numpy as np
from cocotb.triggers import ClockCycles

from fpgaccl.proto import programs as P
from fpgaccl.proto.plans import collective_writes, connect_writes, doorbell
from fpgaccl.proto.reduce import DType, ReduceOp
from fpgaccl.proto.regmap import ENGINE_ID
from fpgaccl.sim import bench_params
from fpgaccl.sim.models.sequencer import SequencerModel
from fpgaccl.sim.tb.cluster_tb import TB, format_summary


async def run(tb, name, gen, world, xs, dtype, op, coll_id, psn_seed):
    rmap = tb.rmap
    n = len(xs[0])
    bufs = tb.layout(xs[0].nbytes)
    peers = tb.peers(world, bufs)
    rng = random.Random(psn_seed)
    psns = {(a, b): rng.randrange(1 << 24) for a in range(world) for b in range(world)}
    for k in range(world):
        await tb.csr_write(k, connect_writes(rmap, k, peers, psn=lambda a, b: psns[(a, b)],
                                             mem_base=0, mem_len=4 * bufs[1]))
        await tb.mem_write(k, bufs[0], xs[k].tobytes())
        await tb.csr_write(k, collective_writes(rmap, gen(k), buffers=bufs, count=n,
                                                dtype=dtype, op=op))
    start = int(tb.dut.cycles.value)
    wall, cpu = time.perf_counter(), time.process_time()
    for k in range(world):
        await tb.csr_write(k, [doorbell(rmap, coll_id)])
    probe = None
    if tb.p.get("probe"):
        tb.timeline = []
        probe = cocotb.start_soon(sample_links(tb, world, tb.p["probe"], tb.timeline))
    # Only Verilator runs until the last node's `busy` falls.
    cycles = await tb.wait_idle((1 << world) - 1, start, tb.p.get("max_cycles", 2_000_000))
    if probe is not None:
        probe.cancel()
    # Wall time and this process's CPU time (the simulator and cocotb are this process):
    # on a shared machine the CPU time is the simulation's own cost.
    tb.last_wall = time.perf_counter() - wall
    tb.last_cpu = time.process_time() - cpu
    status = rmap.address("ctrl.status")
    outs = []
    for k in range(world):
        st = rmap["ctrl"]["status"].decode(await tb.csr_read(k, status))
        assert not st["error"], f"{name}: node {k} reports an error"
        raw = await tb.mem_read(k, bufs[1], xs[k].nbytes)
        outs.append(np.frombuffer(raw, dtype=xs[k].dtype))
    return outs, cycles


async def sample_links(tb, world, every, out):
    """Every ``every`` cycles, the beats each node has put on its link so far: the
    link's utilisation over time (where the collective idles, and which node)."""
    while True:
        row = [int(tb.dut.cycles.value)]
        for k in range(world):
            row.append(await tb.link_read(k, "beats"))
        out.append(row)
        await ClockCycles(tb.dut.clk, every)


@cocotb.test()
async def collectives_on_the_cluster(dut):
    p = bench_params()
    tb = TB(dut, p)
    await tb.reset()
    assert await tb.csr_read(0, tb.rmap.address("ctrl.id")) == ENGINE_ID
    world = p["nodes"]
    dut.loss.value = p.get("loss", 0)
    if p.get("impair"):
        await tb.impair(p.get("seed", 1), **p["impair"])
    log = []
    report = []
    pieces = p.get("pieces", 4)   # messages per ring step: sends overlap reductions
    cases = [
        ("ring_allreduce", lambda r: P.ring_allreduce(r, world, pieces), DType.INT32,
         np.int32),
        ("rhd_allreduce", lambda r: P.rhd_allreduce(r, world), DType.FLOAT32, np.float32),
        ("rd_allreduce", lambda r: P.rd_allreduce(r, world), DType.FLOAT32, np.float32),
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
                       "cycles": cycles, "wall_s": tb.last_wall, "cpu_s": tb.last_cpu,
                       "dropped": int(dut.dropped.value),
                       **({"link_beats": tb.timeline} if p.get("probe") else {})})
    summary = await tb.summary(world)
    log.append(format_summary(summary))
    dut._log.info("\n".join(log))
    if p.get("expect_drops"):
        assert int(dut.dropped.value) > 0, "the lossy run dropped nothing: loss not applied"
    for reason in p.get("expect_reasons", ()):
        assert summary["drops"].get(reason), f"no {reason} drops counted: {summary['drops']}"
    for what in p.get("expect_link", ()):
        assert summary["link"][what], f"the links did no {what}: {summary['link']}"
    if p.get("expect_retransmits"):
        assert summary["retransmits"] > 0, "impaired run without a retransmission"
    if p.get("report"):
        with open(p["report"], "w") as f:
            json.dump({"rows": report, "summary": summary}, f)
