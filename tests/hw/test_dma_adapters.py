"""The node's memory side on Amaranth's simulator: simple read/write ports -> adapters ->
translators -> movers -> AXI memory models of the host and the GPU window; and the
queue formats of proto/queues against the HDL layouts."""

import random

import pytest
from amaranth.sim import Simulator

from fpgaccl.hw.dma.adapters import AxiArbiter, NodeMemory
from fpgaccl.hw.dma.layouts import CQE, PTE, WQE
from fpgaccl.proto.queues import (
    CQE_BYTES,
    WQE_BYTES,
    Opcode,
    Space,
    Status,
    node_addr,
    pack_cqe,
    pack_wqe,
    split_node_addr,
    unpack_cqe,
    unpack_wqe,
    work_imm,
)
from fpgaccl.sim.models.gpu import GPU_PAGE, VA_BASE, GpuMemory
from fpgaccl.sim.models.host_memory import HostMemory
from fpgaccl.sim.models.stream import pack, unpack
from fpgaccl.sim.tb.dma_agents import AxiAgent, Sink, Source, run_agents

HOST = 0x1000_0000
RO = 0x2000_0000


def test_queue_entries_match_the_hdl_layouts():
    wqe = {"opcode": Opcode.WORK, "flags": 3, "src_space": 1, "dst_space": 0, "wr_id": 77,
           "len": 4096, "src_addr": 0x7F00_0001_0000, "dst_addr": 0x1234_5678_9ABC,
           "imm": work_imm(5, 0xBEEF)}
    raw = pack_wqe(**wqe)
    assert len(raw) == WQE_BYTES == WQE.size // 8
    assert int.from_bytes(raw, "little") == pack(WQE, wqe)
    assert unpack_wqe(raw) == {**wqe, **{k: v for k, v in unpack(WQE, pack(WQE, wqe)).items()
                                         if not k.startswith("_")}}
    cqe = {"wr_id": 9, "len": 100, "opcode": Opcode.COPY, "status": Status.UNMAPPED,
           "phase": 1}
    raw = pack_cqe(**cqe)
    assert len(raw) == CQE_BYTES == CQE.size // 8
    assert int.from_bytes(raw, "little") == pack(CQE, cqe)
    assert unpack_cqe(raw) == cqe
    with pytest.raises(KeyError):
        pack_wqe(bogus=1)


def test_node_addresses():
    a = node_addr(Space.GPU, VA_BASE + 5)
    assert a >> 63 == 1 and split_node_addr(a) == (Space.GPU, VA_BASE + 5)
    assert node_addr(Space.HOST, 0x1000) == 0x1000
    with pytest.raises(ValueError):
        node_addr(Space.GPU, 1 << 63)


class Config:
    """The registers the DMA bank would drive, and its page-table read port."""

    def __init__(self, dut, windows, table):
        self.dut, self.windows, self.table, self.data = dut, windows, table, 0

    def drive(self, ctx):
        ctx.set(self.dut.gpu_va, VA_BASE)
        for i, (base, length, r, w) in enumerate(self.windows):
            win = self.dut.host_win[i]
            ctx.set(win.base_lo.value, base & 0xFFFF_FFFF)
            ctx.set(win.base_hi.value, base >> 32)
            ctx.set(win.length.value, length)
            ctx.set(win.access.read, r)
            ctx.set(win.access.write, w)
        ctx.set(self.dut.pte_data, self.data)

    def sample(self, ctx):
        self.addr = ctx.get(self.dut.pte_addr)
        self.fault = ctx.get(self.dut.fault), ctx.get(self.dut.fault_status)
        self.counts = [ctx.get(getattr(self.dut, n)) for n in ("unmapped", "forbidden")]

    def commit(self):
        self.data = self.table.get(self.addr, 0)
        if self.fault[0]:
            self.faults.append(self.fault[1])
        self.refused = [a + b for a, b in zip(self.refused, self.counts, strict=True)]

    faults: list
    refused: list


class Gated(Source):
    """A source that starts once ``gate()`` holds (reads after the writes were issued)."""

    def __init__(self, port, items, gate):
        super().__init__(port, items)
        self.gate = gate

    def drive(self, ctx):
        if self.gate() or self.valid:
            super().drive(ctx)
        else:
            ctx.set(self.port.valid, 0)


def _beats(addr, payload, nb, *, split_at=None):
    """A producer's write burst: packed beats, each with its own address."""
    out = []
    for i in range(0, len(payload), nb):
        chunk = payload[i:i + nb]
        out.append({"addr": addr + i, "data": int.from_bytes(chunk, "little"),
                    "keep": (1 << len(chunk)) - 1, "last": int(i + nb >= len(payload))})
    if split_at is not None:   # a gap in the middle of one burst (a new run, same burst)
        for b in out[split_at:]:
            b["addr"] += 0x100
    return out


@pytest.mark.parametrize("width", [64, 128])
def test_node_memory_spaces_faults_and_ordering(width):
    nb = width // 8
    dut = NodeMemory(width, host_windows=2, gpu_pages=8, max_bytes=256)
    host = HostMemory(width, stall=0.2, seed=1)
    gpu = GpuMemory(width, pages=8, stall=0.2, seed=2)
    va = gpu.alloc(3 * GPU_PAGE)
    table = {p.index: pack(PTE, {"valid": 1, "read": 1, "write": int(p.write),
                                 "page": p.bus >> 16})
             for p in gpu.register(va, 2 * GPU_PAGE) + gpu.register(va + 2 * GPU_PAGE,
                                                                   GPU_PAGE, write=False)}
    windows = [(HOST, 0x10_0000, 1, 1), (RO, 0x1000, 1, 0)]
    cfg = Config(dut, windows, table)
    cfg.faults, cfg.refused = [], [0, 0]
    rng = random.Random(width)
    host.mem.write(RO, b"\x77" * 64)
    gva = node_addr(Space.GPU, va + GPU_PAGE - 100)          # crosses into page 1
    cases = [  # (node address, payload, expected status)
        (HOST + 3, rng.randbytes(300), Status.OK),            # unaligned, > max_bytes
        (gva, rng.randbytes(1000), Status.OK),
        (HOST + 0x1000, rng.randbytes(5 * nb), Status.OK),      # with a gap (two runs)
        (0x7000_0000, rng.randbytes(40), Status.UNMAPPED),     # no window
        (RO, rng.randbytes(16), Status.FORBIDDEN),             # read-only window
        (node_addr(Space.GPU, va + 2 * GPU_PAGE), b"\x55" * 32, Status.FORBIDDEN),
        (node_addr(Space.GPU, va + 3 * GPU_PAGE), b"\x66" * 32, Status.UNMAPPED),
    ]
    wbeats = []
    for i, (a, payload, _) in enumerate(cases):
        wbeats += _beats(a, payload, nb, split_at=2 if i == 2 else None)
    reads = [{"addr": a, "len": len(p)} for a, p, _ in cases[:2]]
    reads += [{"addr": 0x7000_0000, "len": 24}, {"addr": RO, "len": 64},
              {"addr": HOST + 0x1000 + 2 * nb + 0x100, "len": 3 * nb}]
    ws = Source(dut.wr, wbeats, idle=0.2, seed=3)
    rs = Gated(dut.rd_req, reads, lambda: ws.sent == len(wbeats))
    sink = Sink(dut.rd_resp, stall=0.2, seed=4)
    agents = [cfg, AxiAgent(dut.host, host), AxiAgent(dut.gpu, gpu), ws, rs, sink]

    sim = Simulator(dut)
    sim.add_clock(1e-8)

    async def tb(ctx):
        await run_agents(ctx, agents, lambda: sum(b["last"] for b in sink.items) == len(reads)
                         and host.idle() and gpu.idle() and len(cfg.faults) >= 5, 40_000)

    sim.add_testbench(tb)
    sim.run()

    # Data landed where each good burst said, in the right space, and nowhere else.
    assert host.mem.read(HOST + 3, 300) == cases[0][1]
    assert gpu.read_va(va + GPU_PAGE - 100, 1000) == cases[1][1]
    gap = cases[2][1]
    assert host.mem.read(HOST + 0x1000, 2 * nb) == gap[:2 * nb]
    assert host.mem.read(HOST + 0x1000 + 2 * nb + 0x100, 3 * nb) == gap[2 * nb:]
    assert host.mem.read(RO, 64) == b"\x77" * 64
    for acc in host.writes():
        assert HOST <= acc.addr < HOST + 0x2000, acc
    pages = (gpu.bus_of(va), gpu.bus_of(va + GPU_PAGE))
    for acc in gpu.writes():
        assert any(p <= acc.addr < p + GPU_PAGE for p in pages), acc
    # Answers in request order, each framed as asked; the refused one reads as zeros.
    packets, cur = [], b""
    for b in sink.items:
        cur += int(b["data"]).to_bytes(nb, "little")[:bin(b["keep"]).count("1")]
        if b["last"]:
            packets.append(cur)
            cur = b""
    assert packets == [cases[0][1], cases[1][1], bytes(24), b"\x77" * 64, gap[2 * nb:]]
    # Faults: 2 unmapped + 2 forbidden writes, 1 unmapped read, each refused up front.
    assert sorted(cfg.faults) == sorted([Status.UNMAPPED, Status.FORBIDDEN, Status.FORBIDDEN,
                                         Status.UNMAPPED, Status.UNMAPPED])
    assert cfg.refused == [3, 2]


def test_axi_arbiter_routes_bursts_and_responses():
    """Two managers reading and writing at once through one port: each gets its own R
    beats and B responses back, in order, and W data follows its own AW."""
    width, nb = 64, 8
    dut = AxiArbiter(width, depth=4)
    mem = HostMemory(width, rd_latency=7, wr_latency=5, stall=0.3, seed=5)
    rng = random.Random(6)
    srcs = [0x1000, 0x2000]
    for s in srcs:
        mem.mem.write(s, rng.randbytes(16 * 4 * nb))
    agents, r_sinks, b_sinks, wdata = [], [], [], []
    for i, mgr in enumerate((dut.m0, dut.m1)):
        ars = [{"addr": srcs[i] + k * 4 * nb, "len": 3, "size": 3, "burst": 1}
               for k in range(16)]
        dst = 0x8000 + 0x1000 * i
        aws = [{"addr": dst + k * 2 * nb, "len": 1, "size": 3, "burst": 1} for k in range(8)]
        payload = rng.randbytes(16 * nb)
        wdata.append((dst, payload))
        ws = [{"data": int.from_bytes(payload[k * nb:(k + 1) * nb], "little"),
               "strb": 0xFF, "last": k % 2} for k in range(16)]
        r_sinks.append(Sink(mgr.r, stall=0.3, seed=10 + i))
        b_sinks.append(Sink(mgr.b, stall=0.3, seed=20 + i))
        agents += [Source(mgr.ar, ars, idle=0.3, seed=30 + i),
                   Source(mgr.aw, aws, idle=0.3, seed=40 + i),
                   Source(mgr.w, ws, idle=0.3, seed=50 + i), r_sinks[i], b_sinks[i]]
    agents.append(AxiAgent(dut.s, mem))
    sim = Simulator(dut)
    sim.add_clock(1e-8)

    async def tb(ctx):
        await run_agents(ctx, agents, lambda: all(len(s.items) == 64 for s in r_sinks)
                         and all(len(s.items) == 8 for s in b_sinks), 20_000)

    sim.add_testbench(tb)
    sim.run()
    for i, sink in enumerate(r_sinks):
        got = b"".join(int(b["data"]).to_bytes(nb, "little") for b in sink.items)
        assert got == mem.mem.read(srcs[i], 64 * nb), f"manager {i} read someone else's data"
        assert [b["last"] for b in sink.items] == [0, 0, 0, 1] * 16
    for dst, payload in wdata:
        assert mem.mem.read(dst, len(payload)) == payload
