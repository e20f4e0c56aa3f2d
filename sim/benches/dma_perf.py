"""cocotb throughput/latency bench of the DMA subsystem (run by bench/dma_throughput.py).

Read: COPY host -> GPU with the host memory at ``latency`` cycles and the GPU side fast
and unthrottled, so the read mover's outstanding limit (``dma.control.max_rd``) is what
is measured. Write: COPY GPU -> host with the host's write responses ``latency`` cycles
after the data, limited by ``max_wr``. Beats/cycle is counted on the bus from the first
to the last data beat (steady state; the first burst's latency is reported apart).
Doorbell latency: the cycle the doorbell register takes the write to the SQ entry's AR.
"""

from __future__ import annotations

import json
from pathlib import Path

import cocotb

from fpgaccl.hw.dma.layouts import Opcode, Space, Status
from fpgaccl.sim import bench_params
from fpgaccl.sim.models.gpu import GPU_PAGE
from fpgaccl.sim.tb.dma_harness import TB, Driver


async def _copy(tb, drv, **wqe) -> tuple[dict, int]:
    await drv.idle()       # the previous CQE's write response must not be in the numbers
    for model in (tb.host, tb.gpu):
        model.reset_stats(tracing=True)
    op = await drv.doorbell_after(drv.put_wqe(opcode=Opcode.COPY, **wqe))
    (cqe,) = await drv.reap(1)
    assert cqe["status"] == Status.OK, cqe
    return cqe, op.cycle + 1


def _rate(model, ch: str, lo: int, size: int, nb: int) -> dict:
    """Beats/cycle of the copy's own beats (not the SQ fetch's nor the CQE's)."""
    beats, first, last = model.beat_span(ch, lo & ~(nb - 1), lo + size)
    assert beats == -(-(lo % nb + size) // nb)
    return {"beats": beats, "cycles": last - first + 1, "first_cycle": first,
            "beats_per_cycle": round(beats / (last - first + 1), 4)}


@cocotb.test()
async def throughput(dut) -> None:
    p = bench_params()
    width, latency, size = p["width"], p["latency"], p["bytes"]
    nb = width // 8
    tb = TB(dut, width=width, gpu_pages=64,
            host_kw={"rd_latency": latency, "wr_latency": latency},
            gpu_kw={"rd_latency": 8, "wr_latency": 8})
    await tb.reset()
    drv = Driver(tb)
    await drv.setup()
    va = tb.gpu.alloc(size)
    await drv.register_gpu(va, size)
    host_buf = 0x1000_0000
    tb.host.mem.write(host_buf, bytes(range(256)) * (size // 256))
    rows = []
    for n in p["outstanding"]:
        await tb.csr_write("dma.control", enable=1, max_rd=n, max_wr=16)
        _, t0 = await _copy(tb, drv, src_space=Space.HOST, dst_space=Space.GPU,
                            src_addr=host_buf, dst_addr=va, len=size)
        rd = _rate(tb.host, "r", host_buf, size, nb)
        rd["first_beat_after_doorbell"] = rd.pop("first_cycle") - t0
        assert tb.gpu.read_va(va, size) == tb.host.mem.read(host_buf, size)
        await tb.csr_write("dma.control", enable=1, max_rd=16, max_wr=n)
        _, _ = await _copy(tb, drv, src_space=Space.GPU, dst_space=Space.HOST,
                           src_addr=va, dst_addr=host_buf + 2 * size, len=size)
        wr = _rate(tb.host, "w", host_buf + 2 * size, size, nb)
        wr.pop("first_cycle")
        rows.append({"outstanding": n, "read": rd, "write": wr})
        cocotb.log.info("outstanding %2d: read %.3f, write %.3f beats/cycle", n,
                        rd["beats_per_cycle"], wr["beats_per_cycle"])

    # Doorbell -> first read of the SQ entry, host-resident and GPU-resident SQ.
    lat = {}
    await tb.csr_write("dma.control", enable=1, max_rd=16, max_wr=16)
    await drv.idle()
    for model in (tb.host, tb.gpu):
        model.reset_stats()
    op = await drv.doorbell_after(drv.put_wqe(opcode=Opcode.NOP))
    await drv.reap(1)
    lat["host_sq"] = tb.host.first_ar_cycle - (op.cycle + 1)
    _merge(p["out"], {"rows": rows, "doorbell_to_first_read": lat})


def _merge(path: str, new: dict) -> None:
    f = Path(path)
    old = json.loads(f.read_text()) if f.exists() else {}
    for k, v in new.items():
        if isinstance(v, dict):
            old.setdefault(k, {}).update(v)
        else:
            old[k] = v
    f.write_text(json.dumps(old, indent=1))


@cocotb.test()
async def gpu_doorbell_latency(dut) -> None:
    """SQ in GPU memory, doorbell written by the GPU through the peer window."""
    p = bench_params()
    tb = TB(dut, width=p["width"], host_kw={"rd_latency": p["latency"]})
    await tb.reset()
    sq_va = tb.gpu.alloc(GPU_PAGE)
    drv = Driver(tb, sq_space=Space.GPU, sq_va=sq_va)
    await drv.register_gpu(sq_va, GPU_PAGE)
    await drv.setup()
    op = await drv.doorbell_after(drv.put_wqe(opcode=Opcode.NOP), who="gpu")
    await drv.reap(1)
    _merge(p["out"], {"doorbell_to_first_read": {
        "gpu_sq": tb.gpu.first_ar_cycle - (op.cycle + 1)}})
