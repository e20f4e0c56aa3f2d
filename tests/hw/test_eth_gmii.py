"""The GMII MAC with the node at 100 MHz and the PHY's two clocks at 125 MHz and a
little off it, on Amaranth's simulator: bytes and gaps are counted in PHY cycles, and
frames cross both ways through the AsyncFIFOs unchanged."""

import random

import pytest
from amaranth.sim import Simulator

from fpgaccl.hw.eth.gmii import Gmii
from fpgaccl.hw.eth.symbols import RxDrop
from tests.hw.eth_wire import collect_frames, on_wire, send_frames, split_bursts, symbols
from tests.hw.test_eth_mac import frames_mix, udp_frame

NODE, TX, RX = 10e-9, 8e-9, 8.04e-9  # the receive clock is the far end's, not ours


@pytest.mark.parametrize("width", [32, 64])
def test_gmii_two_clock_domains(width):
    dut = Gmii(width, max_frame=300)
    tx_frames = frames_mix()
    rx_frames = [udp_frame(n, n) for n in (20, 61, 150)]
    bad = bytearray(on_wire(udp_frame(30, 1)))
    bad[-1] ^= 1
    bursts = [on_wire(rx_frames[0]), bytes(bad), on_wire(rx_frames[1]), on_wire(rx_frames[2])]
    wire = symbols(bursts)
    tx_cycles = sum(len(on_wire(f)) + 12 for f in tx_frames) + 120
    samples, got, counts = [], [], {}

    async def source(ctx):
        await send_frames(ctx, dut.tx, tx_frames, width)

    async def tx_phy(ctx):
        for _ in range(tx_cycles):
            await ctx.tick("gmii_tx")
            samples.append((ctx.get(dut.txd), ctx.get(dut.tx_en), ctx.get(dut.tx_er)))

    async def rx_phy(ctx):
        for d, dv, er in wire:
            ctx.set(dut.rxd, d)
            ctx.set(dut.rx_dv, dv)
            ctx.set(dut.rx_er, er)
            await ctx.tick("gmii_rx")

    async def sink(ctx):
        cycles = int(len(wire) * RX / NODE) + 200
        await collect_frames(ctx, dut.rx, width, got, cycles, random.Random(width))
        counts.update({v: ctx.get(dut.rx_frames[v.value]) for v in RxDrop})

    sim = Simulator(dut)
    sim.add_clock(NODE)
    sim.add_clock(TX, domain="gmii_tx")
    sim.add_clock(RX, domain="gmii_rx")
    for p in (source, tx_phy, rx_phy, sink):
        sim.add_testbench(p)
    sim.run()

    bursts_out, gaps, errors = split_bursts(samples)
    assert errors == 0
    assert bursts_out == [on_wire(f) for f in tx_frames]
    # The node (4 or 8 bytes per 10 ns) outruns the PHY (1 byte per 8 ns): back to
    # back at exactly the minimum gap.
    assert gaps == [12] * (len(tx_frames) - 1)
    assert got == rx_frames
    assert counts[RxDrop.NONE] == 3 and counts[RxDrop.BAD_FCS] == 1
