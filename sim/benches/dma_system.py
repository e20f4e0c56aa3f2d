"""cocotb bench of the DMA subsystem: submit -> DMA -> complete through rings in memory,
copies through scattered GPU pages, a GPU-initiated start (doorbell through the peer
window, completion flag polled in GPU memory), unmapped and forbidden accesses, and a
queue fault that stops the engine. Buffers carry guard bytes; every bus write is
checked to land inside a buffer the test meant to write."""

from __future__ import annotations

import random

import cocotb

from fpgaccl.hw.dma.layouts import Opcode, Space, Status
from fpgaccl.sim import bench_params
from fpgaccl.sim.models.gpu import GPU_PAGE
from fpgaccl.sim.tb.dma_harness import TB, Driver

HOST_BUF = 0x0100_0000
GUARD = 64


def _width() -> int:
    return bench_params()["width"]


def _writes_inside(model, ranges) -> None:
    for acc in model.writes():
        assert any(lo <= acc.addr and acc.addr + acc.length <= hi for lo, hi in ranges), \
            f"{model.name}: write at {acc.addr:#x}+{acc.length} outside {ranges}"


@cocotb.test()
@cocotb.parametrize(stall=[0.0, 0.3])
async def copy_host_to_host(dut, stall: float) -> None:
    tb = TB(dut, width=_width(), stall=stall, seed=int(stall * 10))
    await tb.reset()
    drv = Driver(tb)
    await drv.setup()
    rng = random.Random(1)
    jobs, ranges = [], [(drv.CQ, drv.CQ + 4096)]
    src, dst = HOST_BUF, HOST_BUF + 0x10_0000
    for _ in range(12):
        n = rng.choice([1, 7, 64, 100, 4096, rng.randint(1, 9000)])
        s = src + rng.randint(0, 63)
        d = dst + rng.randint(0, 63)
        payload = rng.randbytes(n)
        tb.host.alloc_guarded(s, payload, GUARD)
        tb.host.alloc_guarded(d, bytes(n), GUARD, guard_byte=0x5A)
        wr_id = drv.put_wqe(opcode=Opcode.COPY, src_space=Space.HOST, dst_space=Space.HOST,
                            src_addr=s, dst_addr=d, len=n)
        jobs.append((wr_id, s, d, payload))
        ranges.append((d, d + n))
        src, dst = s + n + 2 * GUARD, d + n + 2 * GUARD
    await drv.doorbell()
    cqes = await drv.reap(len(jobs))
    for (wr_id, _s, d, payload), cqe in zip(jobs, cqes, strict=True):
        assert cqe["wr_id"] == wr_id and cqe["status"] == Status.OK, cqe
        assert cqe["len"] == len(payload)
        assert tb.host.mem.read(d, len(payload)) == payload, f"wr_id {wr_id}"
        assert tb.host.guards_intact(d, len(payload), GUARD, guard_byte=0x5A)
    _writes_inside(tb.host, ranges)
    await drv.idle()
    assert await tb.csr_read_reg("dma.completed") == len(jobs)
    assert await tb.csr_read_reg("dma.sq_head") == len(jobs)


@cocotb.test()
async def copy_through_gpu_pages(dut) -> None:
    """Host -> GPU across three scattered 64 KiB pages, then back to the host."""
    tb = TB(dut, width=_width(), seed=5)
    await tb.reset()
    drv = Driver(tb)
    await drv.setup()
    n = 2 * GPU_PAGE + 777
    va = tb.gpu.alloc(3 * GPU_PAGE) + 5000       # starts mid-page, ends in the third
    await drv.register_gpu(va, n)
    pages = {tb.gpu.bus_of(va + i * GPU_PAGE) & ~(GPU_PAGE - 1) for i in range(3)}
    assert len(pages) == 3
    payload = random.Random(2).randbytes(n)
    tb.host.alloc_guarded(HOST_BUF, payload, GUARD)
    back = HOST_BUF + 0x40_0000 + 3
    tb.host.alloc_guarded(back, bytes(n), GUARD)
    drv.put_wqe(opcode=Opcode.COPY, src_space=Space.HOST, dst_space=Space.GPU,
                src_addr=HOST_BUF, dst_addr=va, len=n)
    drv.put_wqe(opcode=Opcode.COPY, src_space=Space.GPU, dst_space=Space.HOST,
                src_addr=va, dst_addr=back, len=n)
    await drv.doorbell()
    cqes = await drv.reap(2)
    assert [c["status"] for c in cqes] == [Status.OK, Status.OK]
    assert tb.gpu.read_va(va, n) == payload
    assert tb.host.mem.read(back, n) == payload
    assert tb.host.guards_intact(back, n, GUARD)
    lo, hi = tb.gpu.bus_of(va), tb.gpu.bus_of(va + n - 1)
    _writes_inside(tb.gpu, [(p, p + GPU_PAGE) for p in pages])
    assert lo in range(min(pages), max(pages) + GPU_PAGE) and hi > 0


@cocotb.test()
async def gpu_initiated_start(dut) -> None:
    """The SQ lives in GPU memory; a GPU kernel writes the entries, rings the doorbell
    with a store through the peer window and spins on the completion flag."""
    tb = TB(dut, width=_width(), seed=9)
    await tb.reset()
    sq_va = tb.gpu.alloc(GPU_PAGE)
    data_va = tb.gpu.alloc(GPU_PAGE)
    flag_va = data_va + 0x8000
    drv = Driver(tb, sq_space=Space.GPU, sq_va=sq_va)
    await drv.register_gpu(sq_va, GPU_PAGE, write=False)
    await drv.register_gpu(data_va, GPU_PAGE)
    await drv.setup(flag_va=flag_va)

    async def ring():
        return await drv.doorbell(who="gpu")

    from fpgaccl.sim.models.gpu import GpuKernel
    kernel = GpuKernel(tb.gpu, flag_va, ring)
    tb.kernels.append(kernel)
    # A collective start for the node, then a GPU -> GPU copy of its "result".
    tb.gpu.write_va(data_va, bytes(range(256)) * 4)
    drv.put_wqe(opcode=Opcode.WORK, imm=3 | (77 << 16))
    drv.put_wqe(opcode=Opcode.COPY, src_space=Space.GPU, dst_space=Space.GPU,
                src_addr=data_va, dst_addr=data_va + 0x4000 + 1, len=1024)
    op = await kernel.doorbell()
    while kernel.reached(2) is None:
        await tb.wait_cycles(16)
        assert tb.cycle - op.cycle < 50_000, "flag never reached 2"
    assert tb.work_log and tb.work_log[0][1]["imm"] == 3 | (77 << 16)
    assert tb.gpu.read_va(data_va + 0x4000 + 1, 1024) == bytes(range(256)) * 4
    cqes = await drv.reap(2)
    assert [c["opcode"] for c in cqes] == [Opcode.WORK, Opcode.COPY]
    assert all(c["status"] == Status.OK for c in cqes)
    first_read = tb.gpu.first_ar_cycle
    flag_cycle = kernel.reached(2)
    cocotb.log.info("doorbell at %d, first SQ read at %d (+%d), flag seen at %d",
                    op.cycle, first_read, first_read - op.cycle, flag_cycle)
    assert 0 < first_read - op.cycle < 16
    # The flag is written only after the CQE's write completed.
    cqe_write = max(a.cycle for a in tb.host.writes() if a.addr >= drv.CQ)
    flag_write = max(a.cycle for a in tb.gpu.writes() if a.addr == tb.gpu.bus_of(flag_va))
    assert flag_write > cqe_write


@cocotb.test()
async def unmapped_and_forbidden(dut) -> None:
    tb = TB(dut, width=_width(), seed=13)
    await tb.reset()
    drv = Driver(tb)
    # Window 0: readable+writable scratch; window 1: read-only source data.
    ro = HOST_BUF + 0x20_0000
    await drv.setup(host_windows=((drv.SQ, 0x2_0000, True, True),
                                  (HOST_BUF, 0x10_0000, True, True),
                                  (ro, 0x1000, True, False)))
    va = tb.gpu.alloc(2 * GPU_PAGE)
    await drv.register_gpu(va, GPU_PAGE, write=False)
    await drv.unregister_gpu(va + GPU_PAGE, GPU_PAGE)      # earlier tests' entry cleared
    dst = HOST_BUF + 0x100
    tb.host.alloc_guarded(dst, bytes(256), GUARD, guard_byte=0x3C)
    tb.host.alloc_guarded(ro, b"\x11" * 256, GUARD)
    cases = [
        # (src space, src, dst space, dst, len, expected status)
        (Space.HOST, 0x7000_0000, Space.HOST, dst, 64, Status.UNMAPPED),     # no window
        (Space.HOST, HOST_BUF + 0x10_0000 - 8, Space.HOST, dst, 64, Status.UNMAPPED),
        (Space.HOST, dst, Space.HOST, ro, 64, Status.FORBIDDEN),           # read-only
        (Space.HOST, dst, Space.GPU, va, 64, Status.FORBIDDEN),            # page RO
        (Space.GPU, va + GPU_PAGE - 32, Space.HOST, dst, 64, Status.UNMAPPED),  # 2nd page
        (Space.GPU, va - 64, Space.HOST, dst, 64, Status.UNMAPPED),        # below window
        (Space.HOST, ro, Space.HOST, dst, 64, Status.OK),
    ]
    for ss, s, ds, d, n, _ in cases:
        drv.put_wqe(opcode=Opcode.COPY, src_space=ss, dst_space=ds, src_addr=s, dst_addr=d,
                    len=n)
    drv.put_wqe(opcode=0x7F)
    await drv.doorbell()
    cqes = await drv.reap(len(cases) + 1)
    assert [c["status"] for c in cqes[:-1]] == [c[-1] for c in cases]
    assert cqes[-1]["status"] == 4        # unknown opcode
    # Only the last copy wrote anything: the refused ones left dst's guard-marked bytes
    # untouched, and nothing at all went to the GPU or to the read-only window.
    assert tb.host.mem.read(dst, 64) == b"\x11" * 64
    assert tb.host.mem.read(dst + 64, 192) == bytes(192)
    assert tb.host.guards_intact(dst, 256, GUARD, guard_byte=0x3C)
    assert not tb.gpu.writes()
    _writes_inside(tb.host, [(dst, dst + 64), (drv.CQ, drv.CQ + 4096)])
    # A refused copy fails both halves when both are bad; count per descriptor refused.
    assert await tb.csr_read_reg("dma.unmapped") == 4
    assert await tb.csr_read_reg("dma.forbidden") == 2
    await tb.csr_write("dma.unmapped")
    await tb.wait_cycles(2)           # the clear strobe lands a cycle after the write
    assert await tb.csr_read_reg("dma.unmapped") == 0
    assert await tb.csr_read_reg("dma.bus_errors") == 0


@cocotb.test()
async def queue_fault_stops_engine(dut) -> None:
    """An SQ placed outside every window: the fetch is refused, the engine stops with
    status.error, and a disable/enable after fixing the window restarts it."""
    tb = TB(dut, width=_width(), seed=17)
    await tb.reset()
    drv = Driver(tb)
    await drv.setup(host_windows=((HOST_BUF, 0x1000, True, True),))
    drv.put_wqe(opcode=Opcode.NOP)
    await drv.doorbell()
    await tb.wait_cycles(200)
    status = tb.rmap["dma"]["status"].decode(await tb.csr_read_reg("dma.status"))
    assert status == {"busy": 0, "error": 1}
    assert await tb.csr_read_reg("dma.sq_head") == 0
    assert not tb.host.writes()
    await tb.csr_write("dma_host.length", 0x2_0000, 1)
    await tb.csr_write("dma_host.base_lo", drv.SQ, 1)
    await tb.csr_write("dma_host.access", copy=1, read=1, write=1)
    await tb.csr_write("dma.control", enable=0)
    await tb.csr_write("dma.control", enable=1, max_rd=16, max_wr=16)
    cqes = await drv.reap(1)
    assert cqes[0]["status"] == Status.OK and cqes[0]["opcode"] == Opcode.NOP
