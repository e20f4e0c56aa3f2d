"""The Ethernet MAC on Amaranth's simulator, at two beat widths: transmit wire bytes
(preamble, SFD, padding, FCS, gap) exactly as the standard says, receive good frames
unchanged, every bad one dropped and counted, and nothing bad ever let through."""

import random

import pytest
from amaranth.sim import Simulator
from scapy.layers.inet import IP, UDP
from scapy.layers.l2 import ARP, Ether

from fpgaccl.hw.eth.mac import Mac
from fpgaccl.hw.eth.mac_tx import MacTx
from fpgaccl.hw.eth.symbols import RxDrop
from tests.hw.eth_wire import (
    PREAMBLE,
    collect_frames,
    fcs,
    on_wire,
    send_frames,
    split_bursts,
    symbols,
)

MAX_FRAME = 300
MAC_A, MAC_B = "02:00:00:00:00:01", "02:00:00:00:00:02"


def udp_frame(n: int, seed: int = 0) -> bytes:
    rng = random.Random(seed)
    payload = bytes(rng.getrandbits(8) for _ in range(n))
    return bytes(Ether(dst=MAC_A, src=MAC_B) / IP(src="10.0.0.2", dst="10.0.0.1")
                 / UDP(sport=1234, dport=4791) / payload)


def frames_mix() -> list[bytes]:
    arp = bytes(Ether(dst="ff:ff:ff:ff:ff:ff", src=MAC_B)
                / ARP(op="who-has", psrc="10.0.0.2", pdst="10.0.0.1"))
    assert len(arp) == 42  # short: the MAC must pad it
    return [arp, udp_frame(18, 1), udp_frame(19, 2), udp_frame(97, 3), udp_frame(200, 4)]


def run(dut, *procs, period=1e-8):
    sim = Simulator(dut)
    sim.add_clock(period)
    for p in procs:
        sim.add_testbench(p)
    sim.run()


@pytest.mark.parametrize("width", [32, 64])
def test_tx_wire_bytes_and_gap(width):
    dut = Mac(width, max_frame=MAX_FRAME)
    frames = frames_mix()
    samples = []

    async def source(ctx):
        await send_frames(ctx, dut.tx, frames, width)

    async def monitor(ctx):
        for _ in range(sum(len(on_wire(f)) + 12 for f in frames) + 80):
            samples.append((ctx.get(dut.txd), ctx.get(dut.tx_en), ctx.get(dut.tx_er)))
            await ctx.tick()

    run(dut, source, monitor)
    bursts, gaps, errors = split_bursts(samples)
    assert errors == 0
    assert bursts == [on_wire(f) for f in frames]
    assert bursts[0][:8] == PREAMBLE and len(bursts[0]) == 8 + 64
    # Back to back: the store-and-forward gate has the next frame ready, so exactly
    # the minimum gap.
    assert gaps == [12] * (len(frames) - 1)


def test_tx_underrun_sends_an_error_and_drops_the_rest():
    dut = MacTx()
    frame = udp_frame(30)
    samples = []

    async def source(ctx):
        for i, b in enumerate(frame):
            if i == 20:  # the source falls behind mid-frame
                ctx.set(dut.i.valid, 0)
                await ctx.tick().repeat(3)
            ctx.set(dut.i.payload.data, b)
            ctx.set(dut.i.payload.last, i == len(frame) - 1)
            ctx.set(dut.i.valid, 1)
            while not ctx.get(dut.i.ready):
                await ctx.tick()
            await ctx.tick()
        ctx.set(dut.i.valid, 0)

    async def monitor(ctx):
        for _ in range(200):
            samples.append((ctx.get(dut.txd), ctx.get(dut.tx_en), ctx.get(dut.tx_er)))
            await ctx.tick()

    run(dut, source, monitor)
    bursts, _, errors = split_bursts(samples)
    assert errors == 1
    assert len(bursts) == 1 and bursts[0] == PREAMBLE + frame[:20] + b"\x00"


def rx_bench(width, bursts, cycles, stall=None, ready_after=0):
    dut = Mac(width, max_frame=MAX_FRAME)
    got = []

    async def phy(ctx):
        for d, dv, er in symbols(bursts):
            ctx.set(dut.rxd, d)
            ctx.set(dut.rx_dv, dv)
            ctx.set(dut.rx_er, er)
            await ctx.tick()

    async def sink(ctx):
        await ctx.tick().repeat(ready_after + 1)
        await collect_frames(ctx, dut.rx, width, got, cycles, stall)

    counts = {}

    async def counters(ctx):
        await ctx.tick().repeat(cycles + ready_after + 2)
        counts.update({v: ctx.get(dut.rx_frames[v.value]) for v in RxDrop})

    run(dut, phy, sink, counters)
    return got, counts


@pytest.mark.parametrize("width", [32, 64])
def test_rx_good_frames_back_to_back_under_backpressure(width):
    frames = [f + bytes(max(0, 60 - len(f))) for f in frames_mix()]  # as sent: padded
    got, counts = rx_bench(width, [on_wire(f) for f in frames],
                           cycles=sum(len(on_wire(f)) + 12 for f in frames) + 300,
                           stall=random.Random(width))
    assert got == frames
    assert counts[RxDrop.NONE] == len(frames)
    assert sum(counts.values()) == len(frames)


@pytest.mark.parametrize("width", [32, 64])
def test_rx_bad_frames_dropped_and_counted(width):
    good = [udp_frame(n, n) for n in (18, 40, 77)]
    corrupt = bytearray(on_wire(udp_frame(50, 9)))
    corrupt[30] ^= 0x10
    runt = udp_frame(5)[:40]
    runt_wire = PREAMBLE + runt + fcs(runt)          # good FCS, 44 bytes: a runt
    long = udp_frame(MAX_FRAME, 7)                    # over MAX_FRAME with its FCS
    exactly_max = udp_frame(MAX_FRAME - 4 - 42, 8)    # MAX_FRAME with its FCS: fine
    assert len(exactly_max) + 4 == MAX_FRAME
    bad_start = b"\x55\x55\x13" + on_wire(good[0])[3:]  # no SFD: ignored, not counted
    bursts = [on_wire(good[0]), bytes(corrupt), on_wire(good[1]), runt_wire,
              on_wire(long), (on_wire(udp_frame(60, 5)), 40), bad_start,
              on_wire(exactly_max), PREAMBLE[:3], on_wire(good[2])]
    cycles = sum(len(b if isinstance(b, bytes) else b[0]) + 12 for b in bursts) + 200
    got, counts = rx_bench(width, bursts, cycles)
    assert got == [good[0], good[1], exactly_max, good[2]]
    assert counts == {RxDrop.NONE: 4, RxDrop.BAD_FCS: 1, RxDrop.RUNT: 1,
                      RxDrop.OVERSIZE: 1, RxDrop.PHY_ERROR: 1, RxDrop.OVERFLOW: 0}


@pytest.mark.parametrize("width", [64])
def test_rx_consumer_stalled_overflows_whole_frames(width):
    # The consumer sleeps while frames arrive: the gate fills, the PHY side has to
    # lose beats, and whatever is lost costs whole frames, never a corrupt one.
    frames = [udp_frame(200, s) for s in range(8)]
    wire = [on_wire(f) for f in frames]
    got, counts = rx_bench(width, wire, cycles=2000,
                           ready_after=sum(len(w) + 12 for w in wire))
    assert got, "the frames that fitted must come out"
    it = iter(frames)
    assert all(g in it for g in got), "out of order, duplicated or corrupted"
    assert counts[RxDrop.NONE] == len(got)
    assert counts[RxDrop.OVERFLOW] >= 1
    assert counts[RxDrop.NONE] + counts[RxDrop.OVERFLOW] <= len(frames)
