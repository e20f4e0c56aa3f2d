"""The translator on Amaranth's simulator: host windows (bounds, rights, 64-bit wrap),
the GPU page table (per-page segments, scattered pages, unmapped and read-only pages,
below/above the window), zero-length descriptors, and read/write arbitration."""

import pytest
from amaranth.sim import Simulator

from fpgaccl.hw.dma.layouts import PTE, Space, Status
from fpgaccl.hw.dma.translate import Translator
from fpgaccl.sim.models.stream import pack
from fpgaccl.sim.tb.dma_agents import Sink, Source, run_agents

VA = 0x7F00_0000_0000
PAGE = 1 << 16


class PteRam:
    """The bank's memory-block read port: data for the address of the previous cycle.
    ``shared``: granted every other cycle; otherwise the port shows another user's word."""

    def __init__(self, dut, table, shared=False):
        self.dut, self.table, self.data, self.shared = dut, table, 0, shared
        self.cycle = 0

    def drive(self, ctx):
        self.grant = not self.shared or self.cycle % 2 == 0
        ctx.set(self.dut.pte_grant, self.grant)
        ctx.set(self.dut.pte_data, self.data)

    def sample(self, ctx):
        self.addr = ctx.get(self.dut.pte_addr)

    def commit(self):
        self.data = self.table.get(self.addr, 0) if self.grant else 0xDEAD_BEEF
        self.cycle += 1


class Config:
    def __init__(self, dut, windows):
        self.dut, self.windows = dut, windows

    def drive(self, ctx):
        ctx.set(self.dut.gpu_va, VA)
        for i, (base, length, r, w) in enumerate(self.windows):
            win = self.dut.host[i]
            ctx.set(win.base_lo.value, base & 0xFFFF_FFFF)
            ctx.set(win.base_hi.value, base >> 32)
            ctx.set(win.length.value, length)
            ctx.set(win.access.read, r)
            ctx.set(win.access.write, w)

    def sample(self, ctx):
        pass

    def commit(self):
        pass


def _pte(bus, read=1, write=1):
    return pack(PTE, {"valid": 1, "read": read, "write": write, "page": bus >> 16})


@pytest.mark.parametrize("shared", [False, True])
def test_translation(shared):
    dut = Translator(host_windows=2, gpu_pages=8)
    windows = [(0x1000_0000, 0x10_0000, 1, 1), (0xFFFF_FFFF_FFFF_0000, 0x1_0000, 1, 0)]
    table = {0: _pte(0x38_0005_0000), 1: _pte(0x38_0002_0000), 2: _pte(0x38_0009_0000, 1, 0)}

    def d(space, addr, n, tag):
        return {"space": space, "addr": addr, "len": n, "tag": tag}

    reads = [
        d(Space.HOST, 0x1000_0010, 100, 1),                 # inside window 0
        d(Space.HOST, 0x1000_0000 + 0x10_0000 - 4, 8, 2),   # runs off its end
        d(Space.HOST, 0xFFFF_FFFF_FFFF_FFF0, 0x20, 3),      # wraps past 2**64
        d(Space.GPU, VA + PAGE - 16, PAGE + 32, 4),         # pages 0,1,2: three segments
        d(Space.GPU, VA + 3 * PAGE, 8, 5),                  # page 3 not mapped
        d(Space.GPU, VA - 1, 2, 6),                         # below the window
        d(Space.GPU, VA + 8 * PAGE - 4, 8, 7),              # past its end
        d(Space.HOST, 0x5, 0, 8),                           # zero length: an empty run
    ]
    writes = [
        d(Space.HOST, 0xFFFF_FFFF_FFFF_0100, 16, 20),       # read-only window
        d(Space.GPU, VA + 2 * PAGE + 8, 8, 21),             # read-only page
        d(Space.GPU, VA + 8, 8, 22),
    ]
    rs, ws = Source(dut.rd_req, reads), Source(dut.wr_req, writes)
    rseg, wseg = Sink(dut.rd_seg, stall=0.3), Sink(dut.wr_seg, stall=0.3, seed=4)
    counts = {"unmapped": 0, "forbidden": 0}

    class Count:
        def drive(self, ctx):
            pass

        def sample(self, ctx):
            self.u, self.f = ctx.get(dut.unmapped), ctx.get(dut.forbidden)

        def commit(self):
            counts["unmapped"] += self.u
            counts["forbidden"] += self.f

    sim = Simulator(dut)
    sim.add_clock(1e-8)

    async def tb(ctx):
        await run_agents(ctx, [Config(dut, windows), PteRam(dut, table, shared), rs, ws, rseg, wseg,
                               Count()],
                         lambda: rs.sent == len(reads) and ws.sent == len(writes)
                         and sum(s["last"] for s in rseg.items) == len(reads)
                         and sum(s["last"] for s in wseg.items) == len(writes), 2000)

    sim.add_testbench(tb)
    sim.run()
    by_tag: dict[int, list] = {}
    for s in rseg.items + wseg.items:
        by_tag.setdefault(s["tag"], []).append(s)
    st = {t: v[0]["status"] for t, v in by_tag.items()}
    assert st == {1: Status.OK, 2: Status.UNMAPPED, 3: Status.UNMAPPED, 4: Status.OK,
                  5: Status.UNMAPPED, 6: Status.UNMAPPED, 7: Status.UNMAPPED, 8: Status.OK,
                  20: Status.FORBIDDEN, 21: Status.FORBIDDEN, 22: Status.OK}
    assert [(s["addr"], s["len"]) for s in by_tag[1]] == [(0x1000_0010, 100)]
    assert [(s["addr"], s["len"], s["first"], s["last"]) for s in by_tag[4]] == [
        (0x38_0005_0000 + PAGE - 16, 16, 1, 0),
        (0x38_0002_0000, PAGE, 0, 0),
        (0x38_0009_0000, 16, 0, 1)]
    assert [(s["addr"], s["len"]) for s in by_tag[22]] == [(0x38_0005_0008, 8)]
    assert all(s["len"] == 0 for t in (2, 3, 5, 6, 7, 8, 20, 21) for s in by_tag[t])
    assert all(s["dlen"] == next(x["len"] for x in reads + writes if x["tag"] == t)
               for t, v in by_tag.items() for s in v)
    assert counts == {"unmapped": 5, "forbidden": 2}
