"""The node tells the host what it is: ``ctrl.features`` (DMA blocks served, reduction
dtypes x ops built) and ``ctrl.config`` read back over the node's own CSR bus, and the
DMA blocks it does not implement read as zero, and why the sequencer stopped
(``ctrl.status.cause``), on Amaranth's simulator."""

from __future__ import annotations

import gc
import warnings

import pytest
from amaranth.hdl import UnusedElaboratable
from amaranth.sim import Simulator

from fpgaccl.hw.node import Node
from fpgaccl.proto.reduce import DType, ReduceOp
from fpgaccl.proto.regmap import ENGINE_ID, REGMAP_VERSION, default_map


def test_features_config_and_absent_dma_blocks():
    node = Node(64, qps=2, regions=2, imem_words=16, dtypes=(DType.INT32, DType.FLOAT32),
                ops=(ReduceOp.SUM, ReduceOp.MAX), mtu=2048)
    full = default_map(qps=2, regions=2, imem_words=16)
    ctrl = full["ctrl"]
    seen = {}

    async def bench(ctx):
        bus = node.csr
        for path in ("ctrl.id", "ctrl.version", "ctrl.features", "ctrl.config",
                     "ctrl.status", "dma.control", "dma_host.length"):
            ctx.set(bus.addr, full.address(path))
            ctx.set(bus.r_stb, 1)
            await ctx.tick()
            ctx.set(bus.r_stb, 0)
            seen[path] = ctx.get(bus.r_data)
        # A doorbell past the end of program memory: the sequencer stops with RUNAWAY.
        for path, word in (("ctrl.control", ctrl["control"].encode(enable=1)),
                           ("ctrl.doorbell", ctrl["doorbell"].encode(entry=100))):
            ctx.set(bus.addr, full.address(path))
            ctx.set(bus.w_data, word)
            ctx.set(bus.w_stb, 1)
            await ctx.tick()
            ctx.set(bus.w_stb, 0)
        await ctx.tick().repeat(8)
        ctx.set(bus.addr, full.address("ctrl.status"))
        ctx.set(bus.r_stb, 1)
        await ctx.tick()
        ctx.set(bus.r_stb, 0)
        seen["after"] = ctx.get(bus.r_data)

    sim = Simulator(node)
    sim.add_clock(1e-8)
    sim.add_testbench(bench)
    sim.run()
    assert seen["ctrl.id"] == ENGINE_ID and seen["ctrl.version"] == REGMAP_VERSION
    assert ctrl["features"].decode(seen["ctrl.features"]) == {
        "dma": 0, "dtypes": (1 << DType.INT32) | (1 << DType.FLOAT32),
        "ops": (1 << ReduceOp.SUM) | (1 << ReduceOp.MAX)}
    assert ctrl["config"].decode(seen["ctrl.config"]) == {
        "qps": 2, "regions": 2, "imem_log2": 4, "beat_log2": 3, "mtu_log2": 11}
    assert ctrl["status"].decode(seen["ctrl.status"]) == {
        "busy": 0, "error": 0, "cause": 0, "datapath": 0}
    assert ctrl["status"].decode(seen["after"]) == {
        "busy": 0, "error": 1, "cause": 5, "datapath": 0}   # 5: RUNAWAY
    # The plain node has no DMA engine: those addresses are not in its bank.
    assert seen["dma.control"] == 0 and seen["dma_host.length"] == 0


def test_one_queue_pair_is_refused_by_name():
    # The refused Node was constructed (Elaboratable.__new__ ran), so Amaranth warns when
    # it is collected; collect it here, inside the filter.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnusedElaboratable)
        with pytest.raises(ValueError, match="qps") as excinfo:
            Node(64, qps=1)
        del excinfo
        gc.collect()
