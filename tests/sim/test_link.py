"""The link impairment pipe on Amaranth's simulator: each impairment on its own, against
what the frames sent and the link's own counters say."""

import random

import pytest
from amaranth.sim import Simulator

from fpgaccl.sim.hdl.link import LINK_COUNTERS, LINK_REGS, ONE, Link

W = 64
NB = W // 8


def frames_of(n, seed=0, lo=62, hi=200):
    rng = random.Random(seed)
    # Byte 0 numbers the frame, so order and identity can be told apart.
    return [bytes([i]) + rng.randbytes(rng.randint(lo, hi) - 1) for i in range(n)]


def simulate(frames, regs=None, *, cycles=4000, gap=0, ready=1.0, seed=1, depth=256,
             hold=64):
    """Send ``frames`` back to back (``gap`` idle cycles between them) and collect what
    comes out: ``(out_frames, first_in_cycles, first_out_cycles, counters, out_beats)``."""
    dut = Link(W, depth=depth, seed=seed, hold=hold)
    rng = random.Random(99)
    out, starts_in, starts_out = [], [], []
    counters = {}
    state = {"beats_out": 0}

    async def writer(ctx):
        for name, value in (regs or {}).items():
            ctx.set(dut.cfg.addr, LINK_REGS[name])
            ctx.set(dut.cfg.w_data, value)
            ctx.set(dut.cfg.w_stb, 1)
            await ctx.tick()
        ctx.set(dut.cfg.w_stb, 0)
        cycle = len(regs or {})
        for f in frames:
            beats = [f[i:i + NB] for i in range(0, len(f), NB)]
            for j, b in enumerate(beats):
                ctx.set(dut.i.payload.data, int.from_bytes(b.ljust(NB, b"\0"), "little"))
                ctx.set(dut.i.payload.keep, (1 << len(b)) - 1)
                ctx.set(dut.i.payload.first, j == 0)
                ctx.set(dut.i.payload.last, j == len(beats) - 1)
                ctx.set(dut.i.valid, 1)
                while True:
                    _, _, rdy = await ctx.tick().sample(dut.i.ready)
                    cycle += 1
                    if rdy:
                        break
                if j == 0:
                    starts_in.append(cycle)
            ctx.set(dut.i.valid, 0)
            for _ in range(gap):
                await ctx.tick()
                cycle += 1

    async def reader(ctx):
        cur = bytearray()
        for cycle in range(cycles):
            r = rng.random() < ready
            ctx.set(dut.o.ready, r)
            _, _, valid, p = await ctx.tick().sample(dut.o.valid, dut.o.payload)
            if valid and r:
                state["beats_out"] += 1
                if p.first:
                    starts_out.append(cycle)
                    cur = bytearray()
                cur += p.data.to_bytes(NB, "little")[:p.keep.bit_length()]
                if p.last:
                    out.append(bytes(cur))
        for name, addr in LINK_COUNTERS.items():
            ctx.set(dut.cfg.addr, addr)
            counters[name] = ctx.get(dut.cfg.r_data)

    sim = Simulator(dut)
    sim.add_clock(1e-8)
    sim.add_testbench(writer)
    sim.add_testbench(reader)
    sim.run()
    return out, starts_in, starts_out, counters, state["beats_out"]


def test_clean_link_forwards_everything_in_order_without_throttling():
    frames = frames_of(20)
    out, _, _, c, _ = simulate(frames, ready=0.8)
    assert out == frames
    assert c["frames"] == 20 and c["dropped"] == c["duplicated"] == c["corrupted"] == 0
    _, sin, sout, _, _ = simulate(frames)
    # Back to back in, back to back out: cut-through, a few cycles behind.
    assert all(0 < o - i < 8 for i, o in zip(sin, sout, strict=True))


def test_latency_delays_every_frame_by_the_register():
    frames = frames_of(8)
    out, sin, sout, _, _ = simulate(frames, {"latency": 300}, gap=50)
    assert out == frames
    delays = [o - i for i, o in zip(sin, sout, strict=True)]
    assert all(300 <= d <= 306 for d in delays), delays


def test_rate_paces_the_output():
    frames = frames_of(10, lo=400, hi=400)
    _, _, sout, _, beats = simulate(frames, {"rate": ONE // 4}, cycles=6000)
    beats_per_frame = -(-400 // NB)
    span = sout[-1] - sout[0]
    per_frame = span / (len(sout) - 1)
    assert beats == 10 * beats_per_frame
    assert 3.9 * beats_per_frame <= per_frame <= 4.1 * beats_per_frame, per_frame


def test_loss_is_seeded_and_reproducible():
    frames = frames_of(60, lo=62, hi=80)
    out1, *_, c1, _ = simulate(frames, {"loss": ONE // 3}, cycles=3000)
    out2, *_, c2, _ = simulate(frames, {"loss": ONE // 3}, cycles=3000)
    out3, *_ = simulate(frames, {"loss": ONE // 3, "seed": 7}, cycles=3000)
    assert out1 == out2 and c1 == c2
    assert out1 != out3
    assert 8 <= c1["dropped"] <= 35 and len(out1) == 60 - c1["dropped"]
    assert all(f in frames for f in out1)
    assert [f[0] for f in out1] == sorted(f[0] for f in out1)   # the rest keep order


def test_duplication_sends_frames_twice():
    frames = frames_of(10)
    out, *_, c, _ = simulate(frames, {"dup": ONE - 1})
    assert out == [f for f in frames for _ in range(2)]
    assert c["duplicated"] == 10


def test_reordering_lets_the_next_frame_overtake():
    frames = frames_of(10)
    out, *_, c, _ = simulate(frames, {"reorder": ONE - 1}, cycles=6000)
    assert sorted(out) == sorted(frames)
    # Held, overtaken, held, ...: pairs swap.
    assert [f[0] for f in out] == [1, 0, 3, 2, 5, 4, 7, 6, 9, 8]
    assert c["reordered"] == 5


def test_held_frame_leaves_alone_when_nothing_follows():
    frames = frames_of(1)
    out, sin, sout, c, _ = simulate(frames, {"reorder": ONE - 1}, hold=64)
    assert out == frames and c["reordered"] == 1
    assert 64 <= sout[0] - sin[0] <= 72


def test_corruption_flips_one_byte_of_the_last_beat():
    frames = frames_of(12)
    out, *_, c, _ = simulate(frames, {"corrupt": ONE - 1})
    assert c["corrupted"] == 12 and len(out) == 12
    for f, g in zip(frames, out, strict=True):
        diff = [i for i in range(len(f)) if f[i] != g[i]]
        assert diff == [(len(f) - 1) // NB * NB], diff


@pytest.mark.parametrize("seed", [3, 4])
def test_everything_at_once_stays_consistent(seed):
    """Loss, reordering, duplication, corruption and a slow reader together: every frame
    that comes out is one that went in (or its corrupted copy), and the counters add up."""
    frames = frames_of(40, seed=seed)
    regs = {"loss": ONE // 8, "reorder": ONE // 6, "dup": ONE // 6, "corrupt": ONE // 8,
            "latency": 20, "seed": seed}
    out, *_, c, _ = simulate(frames, regs, cycles=8000, ready=0.6, seed=seed)
    assert c["frames"] == 40
    assert len(out) == 40 - c["dropped"] + c["duplicated"]
    clean = sum(g in frames for g in out)
    assert len(out) - clean <= c["corrupted"]
    ids = {g[0] for g in out}
    assert len(ids) == 40 - c["dropped"]
