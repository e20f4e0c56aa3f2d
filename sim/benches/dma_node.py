"""cocotb bench of :class:`fpgaccl.hw.dma_node.DmaNode` (two of them back to back,
:class:`~fpgaccl.sim.tb.dma_node_top.DmaNodePair`): host and GPU memory models on
every AXI port (:mod:`fpgaccl.sim.tb.dma_node_tb`), the host runtime's queue driver
(:class:`~fpgaccl.sim.tb.dma_harness.Driver`) and the GPU-kernel model.

* ``copy_program_host_to_gpu``: a WORK entry starts a one-node program whose COPY moves
  a host buffer into the GPU window through the node's copy engine.
* ``unmapped_buffer_error``: the same program with OUT on an unmapped GPU page: an
  error completion, no byte written, counted and shown in ``ctrl.status.error``.
* ``gpu_kernel_starts_program``: SQ and flag in GPU memory; the GPU kernel rings the
  doorbell through the peer window and polls the flag, which moves only once the
  program's data is in memory.
* ``gpu_initiated_allreduce``: a 2-rank ring allreduce of GPU buffers, each rank
  started by its GPU kernel; bit-exact against numpy; records the doorbell -> first
  frame latency (``out`` param: where the numbers go, for bench/dma_node_latency.py).
"""

from __future__ import annotations

import json
import random

import cocotb
import numpy as np

from fpgaccl.proto import programs as P
from fpgaccl.proto.plans import Peer, collective_writes, connect_writes
from fpgaccl.proto.queues import Opcode, Space, Status, node_addr, work_imm
from fpgaccl.proto.reduce import DType, ReduceOp
from fpgaccl.sim import bench_params
from fpgaccl.sim.hdl.switch import node_ip, node_mac
from fpgaccl.sim.models.gpu import GPU_PAGE, VA_BASE, GpuKernel
from fpgaccl.sim.tb.dma_harness import Driver
from fpgaccl.sim.tb.dma_node_tb import TB, NodeView

HOST_BUF = 0x1000_0000
GUARD = 64


def _copy_program():
    return [*P._setup(1), P.DONE]     # OUT = IN through the copy engine, then DONE


async def _one_node(tb: TB, *, out_addr: int, n: int, sq_space=Space.HOST, sq_va=None,
                    flag_va=None, gpu_regs=()) -> tuple[NodeView, Driver, bytes, int]:
    """Node 0 set up for the copy program: IN in host memory, OUT at ``out_addr``."""
    v = tb.view(0)
    drv = Driver(v, sq_space=sq_space, sq_va=sq_va)
    for va, nbytes, write in gpu_regs:
        await drv.register_gpu(va, nbytes, write=write)
    await drv.setup(flag_va=flag_va)
    payload = random.Random(n).randbytes(4 * n)
    v.host.alloc_guarded(HOST_BUF, payload, GUARD)
    bufs = [HOST_BUF, out_addr, HOST_BUF + 0x10_0000, HOST_BUF + 0x20_0000]
    writes = [(v.rmap.address("ctrl.control"),
               v.rmap["ctrl"]["control"].encode(enable=1)),
              *collective_writes(v.rmap, _copy_program(), buffers=bufs, count=n,
                                 dtype=DType.INT32, op=ReduceOp.SUM)]
    for addr, value in writes:
        await v.write_raw(addr, value)
    return v, drv, payload, 4 * n


@cocotb.test()
async def copy_program_host_to_gpu(dut) -> None:
    tb = TB(dut, seed=1)
    await tb.reset()
    gpu = tb.gpus[0]
    va = gpu.alloc(2 * GPU_PAGE)
    dst = va + GPU_PAGE - 1000 + 3        # unaligned, across two scattered pages
    gpu.write_va(dst - GUARD, b"\x5a" * (2000 + 2 * GUARD))
    v, drv, payload, nbytes = await _one_node(
        tb, out_addr=node_addr(Space.GPU, dst), n=500, gpu_regs=[(va, 2 * GPU_PAGE, True)])
    wr_id = drv.put_wqe(opcode=Opcode.WORK, imm=work_imm(0, 7))
    await drv.doorbell()
    cqes = await drv.reap(1)
    assert cqes[0]["wr_id"] == wr_id and cqes[0]["status"] == Status.OK, cqes
    assert gpu.read_va(dst, nbytes) == payload
    assert gpu.read_va(dst - GUARD, GUARD) == b"\x5a" * GUARD
    assert gpu.read_va(dst + nbytes, GUARD) == b"\x5a" * GUARD
    lo, hi = gpu.bus_of(va), gpu.bus_of(va + GPU_PAGE)
    for acc in gpu.writes():
        assert lo <= acc.addr < lo + GPU_PAGE or hi <= acc.addr < hi + GPU_PAGE, acc
    assert await v.csr_read_reg("ctrl.completions") == 1
    st = v.rmap["ctrl"]["status"].decode(await v.csr_read_reg("ctrl.status"))
    assert st == {"busy": 0, "error": 0, "cause": 0, "datapath": 0}
    assert await v.csr_read_reg("dma.unmapped") == 0


@cocotb.test()
async def unmapped_buffer_error(dut) -> None:
    tb = TB(dut, seed=2)
    await tb.reset()
    gpu = tb.gpus[0]
    va = gpu.alloc(GPU_PAGE)
    hole = VA_BASE + 40 * GPU_PAGE        # never registered by any test
    v, drv, _payload, _ = await _one_node(
        tb, out_addr=node_addr(Space.GPU, hole + 64), n=256,
        gpu_regs=[(va, GPU_PAGE, True)])
    drv.put_wqe(opcode=Opcode.WORK, imm=work_imm(0, 8))
    await drv.doorbell()
    cqes = await drv.reap(1)
    assert cqes[0]["status"] == Status.UNMAPPED, cqes
    assert not gpu.writes(), gpu.writes()
    host_writes = [a for a in v.host.writes() if not drv.CQ <= a.addr < drv.CQ + 4096]
    assert not host_writes, host_writes
    assert await v.csr_read_reg("dma.unmapped") >= 1
    st = v.rmap["ctrl"]["status"].decode(await v.csr_read_reg("ctrl.status"))
    assert st["error"] == 1


@cocotb.test()
async def gpu_kernel_starts_program(dut) -> None:
    tb = TB(dut, seed=3)
    await tb.reset()
    gpu = tb.gpus[0]
    sq_va = gpu.alloc(GPU_PAGE)
    data_va = gpu.alloc(GPU_PAGE)
    flag_va = data_va + 0x8000
    _, drv, payload, nbytes = await _one_node(
        tb, out_addr=node_addr(Space.GPU, data_va + 0x100), n=1000, sq_space=Space.GPU,
        sq_va=sq_va, flag_va=flag_va,
        gpu_regs=[(sq_va, GPU_PAGE, False), (data_va, GPU_PAGE, True)])

    async def ring():
        return await drv.doorbell(who="gpu")

    kernel = GpuKernel(gpu, flag_va, ring)
    tb.kernels.append(kernel)
    drv.put_wqe(opcode=Opcode.WORK, imm=work_imm(0, 9))
    op = await kernel.doorbell()
    while kernel.reached(1) is None:
        await tb.wait_cycles(16)
        assert tb.cycle - op.cycle < 50_000, "flag never moved"
    seen = kernel.reached(1)
    assert gpu.read_va(data_va + 0x100, nbytes) == payload
    flag_bus = gpu.bus_of(flag_va)
    flag_write = min(a.cycle for a in gpu.writes() if a.addr == flag_bus)
    data_writes = [a.cycle for a in gpu.writes() if a.addr != flag_bus]
    assert max(data_writes) < flag_write <= seen
    cqes = await drv.reap(1)
    assert cqes[0]["status"] == Status.OK and cqes[0]["opcode"] == Opcode.WORK
    cocotb.log.info("GPU doorbell at %d, flag written at %d, seen by the kernel at %d",
                    op.cycle, flag_write, seen)


@cocotb.test()
async def gpu_initiated_allreduce(dut) -> None:
    p = bench_params()
    tb = TB(dut, seed=4)
    await tb.reset()
    world, n = 2, p.get("count", 512)
    rng = np.random.default_rng(0)
    xs = [(rng.standard_normal(n) * 100).astype(np.int32) for _ in range(world)]
    span = -(-(xs[0].nbytes + 4096) // 4096) * 4096
    views, drivers, kernels, bufs_va, flags, sq_vas = [], [], [], [], [], []
    for k in range(world):
        gpu = tb.gpus[k]
        sq_vas.append(gpu.alloc(GPU_PAGE))
        data_va = gpu.alloc(4 * span + 0x1000)
        bufs_va.append([data_va + i * span for i in range(4)])
        flags.append(data_va + 4 * span)
    peers = [Peer(node_mac(k), node_ip(k), 0x1000 + k,
                  [node_addr(Space.GPU, a) for a in bufs_va[k]]) for k in range(world)]
    psn = lambda a, b: 0x100 * (a + 1) + b       # noqa: E731
    for k in range(world):
        v = tb.view(k)
        drv = Driver(v, sq_space=Space.GPU, sq_va=sq_vas[k])
        await drv.register_gpu(drv.sq_addr, GPU_PAGE, write=False)
        await drv.register_gpu(bufs_va[k][0], 4 * span + 0x1000)
        await drv.setup(flag_va=flags[k])
        base = node_addr(Space.GPU, bufs_va[k][0])
        for addr, value in connect_writes(v.rmap, k, peers, psn=psn, mem_base=base,
                                          mem_len=4 * span) + \
                collective_writes(v.rmap, P.ring_allreduce(k, world),
                                  buffers=peers[k].buffers, count=n, dtype=DType.INT32,
                                  op=ReduceOp.SUM):
            await v.write_raw(addr, value)
        tb.gpus[k].write_va(bufs_va[k][0], xs[k].tobytes())
        drv.put_wqe(opcode=Opcode.WORK, imm=work_imm(0, 11))

        async def ring(drv=drv):
            return await drv.doorbell(who="gpu")

        kern = GpuKernel(tb.gpus[k], flags[k], ring, poll_interval=1)
        tb.kernels.append(kern)
        views.append(v)
        drivers.append(drv)
        kernels.append(kern)
    for g in tb.gpus:
        g.log.clear()
    tb.tx_sops = [[], []]
    ops = [await kern.doorbell() for kern in kernels]
    while any(kern.reached(1) is None for kern in kernels):
        await tb.wait_cycles(32)
        assert tb.cycle - ops[0].cycle < 200_000, "allreduce did not complete"
    want = (xs[0].astype(np.int64) + xs[1]).astype(np.int32)
    rows = []
    for k in range(world):
        got = np.frombuffer(tb.gpus[k].read_va(bufs_va[k][1], xs[k].nbytes), dtype=np.int32)
        assert got.tobytes() == want.tobytes(), f"rank {k}: {got[:8]} != {want[:8]}"
        gpu = tb.gpus[k]
        sq_bus = gpu.bus_of(drivers[k].sq_addr)
        reads = [a for a in gpu.log if a.kind == "r"]
        sq_fetch = min(a.cycle for a in reads if sq_bus <= a.addr < sq_bus + GPU_PAGE)
        in_lo = gpu.bus_of(bufs_va[k][0])
        data_rd = min(a.cycle for a in reads if in_lo <= a.addr < in_lo + 4 * span)
        # OUT is read only by SENDs (the set-up COPY writes it): the first SEND's read.
        out_lo = gpu.bus_of(bufs_va[k][1])
        send_rd = min(a.cycle for a in reads if out_lo <= a.addr < out_lo + span)
        db = ops[k].cycle
        rows.append({
            "rank": k, "doorbell_cycle": db,
            "to_sq_fetch": sq_fetch - db,
            "to_first_data_read": data_rd - db,
            # The program's first frame is its GRANT (a zero-length WRITE with ImmDt).
            "to_first_frame": tb.tx_sops[k][0] - db,
            "to_first_send_read": send_rd - db,
            "to_next_frame_after_send_read": min(c for c in tb.tx_sops[k] if c > send_rd) - db,
            "to_flag_seen": kernels[k].reached(1) - db,
            "frames_sent": len(tb.tx_sops[k]),
        })
        cqes = await drivers[k].reap(1)
        assert cqes[0]["status"] == Status.OK, cqes
    for r in rows:
        cocotb.log.info("%s", r)
    if p.get("out"):
        with open(p["out"], "w") as f:
            json.dump({"count": n, "dtype": "int32", "bytes": int(xs[0].nbytes),
                       "world": world, "rows": rows}, f)
