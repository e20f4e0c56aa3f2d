"""Read and write movers on Amaranth's simulator against the AXI memory model: unaligned
starts and ends, 4 KiB boundaries, zero-length and refused descriptors, bus errors,
outstanding limits and random back-pressure on every channel."""

import random

import pytest
from amaranth.sim import Simulator

from fpgaccl.hw.dma.layouts import Space, Status
from fpgaccl.hw.dma.read import ReadMover
from fpgaccl.hw.dma.write import WriteMover
from fpgaccl.sim.models.host_memory import AxiMemory
from fpgaccl.sim.models.memory import Memory
from fpgaccl.sim.tb.dma_agents import AxiAgent, Sink, Source, run_agents

BASE = 0x10_0000


def _seg(addr, length, tag, status=Status.OK):
    return {"addr": addr, "len": length if status == Status.OK else 0, "space": Space.HOST,
            "first": 1, "last": 1, "dlen": length, "tag": tag, "status": status}


def _cases(rng, n, nb):
    out = []
    for _ in range(n):
        length = rng.choice([0, 1, 3, nb - 1, nb, nb + 1, rng.randint(1, 2500)])
        out.append((BASE + rng.randint(0, 8192), length))
    out.append((BASE + 4096 - 5, 10))   # straddles a 4 KiB boundary
    out.append((BASE + 4096 - nb, 3 * nb))
    return out


def _run(dut, agents, done, cycles=20_000):
    sim = Simulator(dut)
    sim.add_clock(1e-8)
    result = {}

    async def tb(ctx):
        result["cycles"] = await run_agents(ctx, agents, done, cycles)

    sim.add_testbench(tb)
    sim.run()
    return result["cycles"]


def _frames(beats):
    frames, cur = [], bytearray()
    for b in beats:
        nb = b["keep"].bit_length()
        cur += b["data"].to_bytes(64, "little")[:nb]
        if b["last"]:
            frames.append((bytes(cur), b["err"]))
            cur = bytearray()
    return frames


@pytest.mark.parametrize("width,stall", [(64, 0.0), (64, 0.3), (256, 0.2)])
def test_read_mover_bytes_and_framing(width, stall):
    rng = random.Random(width + int(stall * 10))
    nb = width // 8
    mem = Memory()
    mem.write(BASE, rng.randbytes(16384))
    model = AxiMemory(width, mem, base=BASE, size=16384, rd_latency=7, stall=stall, seed=3)
    cases = _cases(rng, 12, nb)
    segs = [_seg(a, n, i) for i, (a, n) in enumerate(cases)]
    # A refused descriptor still yields its beats (zeros, err), and one past the end of
    # memory gets SLVERR: both complete with an error status, in order.
    segs.append(_seg(BASE, 20, 100, Status.UNMAPPED))
    segs.append(_seg(BASE + 16384 - 8, 40, 101))
    dut = ReadMover(width, outstanding=4)
    src = Source(dut.seg, segs, idle=stall, seed=5)
    data = Sink(dut.data, stall=stall, seed=6)
    cpl = Sink(dut.cpl, stall=stall, seed=7)
    _run(dut, [src, data, cpl, AxiAgent(dut.bus, model)], lambda: len(cpl.items) == len(segs))
    assert [c["tag"] for c in cpl.items] == [s["tag"] for s in segs]
    frames = _frames(data.items)
    nonzero = [s for s in segs if s["dlen"]]
    assert len(frames) == len(nonzero)
    for s, (got, err), c in zip(nonzero, frames, [c for c in cpl.items if c["len"]],
                                strict=True):
        if s["tag"] < 100:
            assert c["status"] == Status.OK and not err
            assert got == mem.read(s["addr"], s["dlen"]), f"tag {s['tag']}"
        else:
            assert len(got) == s["dlen"] and err
    assert cpl.items[-2]["status"] == Status.UNMAPPED
    assert cpl.items[-1]["status"] == Status.BUS_ERROR
    # Bursts never cross 4 KiB and never exceed 256 beats.
    for acc in model.log:
        assert acc.addr // 4096 == (acc.addr + acc.length - 1) // 4096
        assert acc.length <= 256 * nb


def _beats(payload, nb, err=0):
    out = []
    for off in range(0, len(payload), nb):
        chunk = payload[off:off + nb]
        out.append({"data": int.from_bytes(chunk, "little"), "keep": (1 << len(chunk)) - 1,
                    "first": int(off == 0), "last": int(off + nb >= len(payload)),
                    "err": err})
    return out


@pytest.mark.parametrize("width,stall", [(64, 0.0), (64, 0.3), (256, 0.2)])
def test_write_mover_strobes_guards_and_errors(width, stall):
    rng = random.Random(width * 3 + int(stall * 10))
    nb = width // 8
    mem = Memory(fill=0xA5)     # untouched bytes read as guard bytes
    model = AxiMemory(width, mem, base=BASE, size=1 << 20, wr_latency=9, stall=stall,
                      seed=4)
    segs, beats, want = [], [], []
    addr = BASE + 64
    for i, (_, n) in enumerate(_cases(rng, 12, nb)):
        addr += rng.randint(1, 200)       # gaps between buffers are guard bytes
        payload = rng.randbytes(n)
        segs.append(_seg(addr, n, i))
        beats += _beats(payload, nb)
        want.append((addr, payload))
        addr += n
    # Refused: beats swallowed, nothing written. Poisoned (a faulted read's beats):
    # strobes off, nothing written. Out of range: B error.
    segs.append(_seg(addr + 100, 30, 100, Status.FORBIDDEN))
    beats += _beats(bytes(30), nb)
    segs.append(_seg(addr + 300, 50, 101))
    beats += _beats(bytes(range(50)), nb, err=1)
    segs.append(_seg(BASE + (1 << 20) - 8, 16, 102))
    beats += _beats(bytes(16), nb)
    dut = WriteMover(width, outstanding=3)
    src = Source(dut.seg, segs, idle=stall, seed=5)
    dsrc = Source(dut.data, beats, idle=stall, seed=8)
    cpl = Sink(dut.cpl, stall=stall, seed=7)
    _run(dut, [src, dsrc, cpl, AxiAgent(dut.bus, model)],
         lambda: len(cpl.items) == len(segs))
    assert [c["tag"] for c in cpl.items] == [s["tag"] for s in segs]
    assert [c["status"] for c in cpl.items[-3:]] == [
        Status.FORBIDDEN, Status.BUS_ERROR, Status.BUS_ERROR]
    assert all(c["status"] == Status.OK for c in cpl.items[:-3])
    for a, payload in want:
        assert mem.read(a, len(payload)) == payload
    # Every byte outside the buffers is still a guard byte: no stray strobe anywhere.
    written = set()
    for a, payload in want:
        written.update(range(a, a + len(payload)))
    region = mem.read(BASE, addr + 400 - BASE)
    stray = [i for i, v in enumerate(region) if BASE + i not in written and v != 0xA5]
    assert not stray, f"stray writes at {[hex(BASE + i) for i in stray[:8]]}"
    assert max(len(model.aw_q), len(model.b_q)) == 0


def test_outstanding_limit_bounds_reads_in_flight():
    width, nb = 64, 8
    mem = Memory()
    model = AxiMemory(width, mem, rd_latency=30)
    segs = [_seg(BASE, 16 * 1024, 0)]
    peak = {"n": 0}

    class Probe:
        def drive(self, ctx):
            peak["n"] = max(peak["n"], model.reads)

        def sample(self, ctx):
            pass

        def commit(self):
            pass

    cycles = {}
    for limit in (1, 3):
        peak["n"] = 0
        dut = ReadMover(width, outstanding=8)
        model.__post_init__()
        src, data, cpl = Source(dut.seg, segs), Sink(dut.data), Sink(dut.cpl)

        def setlimit(limit=limit, dut=dut):
            class Lim(Probe):
                def drive(self, ctx):
                    ctx.set(dut.max_outstanding, limit)
                    super().drive(ctx)
            return Lim()

        cycles[limit] = _run(dut, [setlimit(), src, data, cpl, AxiAgent(dut.bus, model)],
                             lambda cpl=cpl: len(cpl.items) == 1)
        assert peak["n"] == limit
    beats = 16 * 1024 // nb
    # One burst in flight pays the latency per 2 KiB burst; three hide most of it.
    assert cycles[1] > beats + 7 * 30
    assert cycles[3] < beats * 1.2
