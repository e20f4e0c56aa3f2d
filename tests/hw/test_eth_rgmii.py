"""RGMII against a line model written here from the RGMII v2.0 text (zlib computes the
FCS): DDR nibbles in and out, frames bit-exact both ways, at several node/tx/rx clock
ratios; and the pads elaborated for the ECP5 map to its DDR primitives."""

from __future__ import annotations

import random
import zlib

import pytest
from amaranth.hdl import ClockDomain, Module, ResetSignal
from amaranth.lib import wiring
from amaranth.sim import Simulator

from fpgaccl.hw.eth.rgmii import Rgmii, RgmiiPads, rx_domain
from fpgaccl.hw.eth.symbols import RxDrop
from tests.hw.eth_wire import collect_frames, send_frames
from tests.hw.test_eth_mac import frames_mix, udp_frame

SFD_RUN = b"\x55" * 7 + b"\xd5"
IDLE_STATUS = 0b1101   # in-band: link up, 1000 Mb/s, full duplex


def wire_bytes(frame: bytes) -> bytes:
    padded = frame + bytes(max(0, 60 - len(frame)))
    return SFD_RUN + padded + zlib.crc32(padded).to_bytes(4, "little")


def rgmii_rx_line(bursts, gap: int = 12, status: int = IDLE_STATUS):
    """Per RX_CLK cycle ((rising nibble, falling nibble), (rising ctl, falling ctl)).
    A burst given as (bytes, k) has RX_ER at byte k: RX_DV high, RX_DV^RX_ER low on
    the falling edge."""
    idle = ((status, status), (0, 0))
    out = [idle] * 4
    for b in bursts:
        raw, er_at = (b, -1) if isinstance(b, bytes) else b
        for i, x in enumerate(raw):
            out.append(((x & 0xF, x >> 4), (1, 0 if i == er_at else 1)))
        out += [idle] * gap
    return out


def rgmii_tx_decode(samples):
    """Bursts (bytes with TX_EN high), the idle runs between them, and TX_ER count."""
    bursts, gaps, errors, cur, idle = [], [], 0, bytearray(), None
    for (lo, hi), (c_rise, c_fall) in samples:
        en, er = c_rise, c_rise ^ c_fall
        errors += er
        if en:
            if not cur and idle is not None:
                gaps.append(idle)
            cur.append(lo | hi << 4)
            idle = None
        else:
            if cur:
                bursts.append(bytes(cur))
                cur, idle = bytearray(), 0
            if idle is not None:
                idle += 1
    assert not cur, "capture ended inside a frame"
    return bursts, gaps, errors


# (node, tx, rx) clock periods: node slower than the PHY, faster, and near its floor
# (64-bit beats need 15.6 MHz); the receive clock is the far end's, a little off ours.
RATIOS = {"node100": (10e-9, 8e-9, 8.04e-9), "node200": (5e-9, 8e-9, 7.96e-9),
          "node25": (40e-9, 8e-9, 8.02e-9)}


# 32-bit beats need a node clock of at least 31.25 MHz: not at 25 MHz.
CASES = [(w, r) for w in (32, 64) for r in sorted(RATIOS) if (w, r) != (32, "node25")]


@pytest.mark.parametrize("width,ratio", CASES)
def test_rgmii_frames_both_ways(width, ratio):
    node, tx_p, rx_p = RATIOS[ratio]
    dut = Rgmii(width, max_frame=300)
    tx_frames = frames_mix()
    rx_frames = [udp_frame(n, 10 + n) for n in (20, 61, 150, 7)]
    bad = bytearray(wire_bytes(udp_frame(30, 1)))
    bad[-2] ^= 0x10                                   # one FCS bit, in a falling nibble
    line = rgmii_rx_line([wire_bytes(rx_frames[0]), bytes(bad), wire_bytes(rx_frames[1]),
                          (wire_bytes(udp_frame(40, 2)), 30), wire_bytes(rx_frames[2]),
                          wire_bytes(rx_frames[3])])
    tx_cycles = sum(len(wire_bytes(f)) + 12 for f in tx_frames) + int(40 * node / tx_p) + 150
    samples, got, counts, link = [], [], {}, []

    async def source(ctx):
        await send_frames(ctx, dut.tx, tx_frames, width)

    async def tx_phy(ctx):
        for _ in range(tx_cycles):
            _, _, d, c = await ctx.tick("rgmii_tx").sample(dut.tx_data, dut.tx_ctl)
            samples.append(((d[0], d[1]), (c[0], c[1])))

    async def rx_phy(ctx):
        for (lo, hi), (c_rise, c_fall) in line:
            ctx.set(dut.rx_data[0], lo)
            ctx.set(dut.rx_data[1], hi)
            ctx.set(dut.rx_ctl[0], c_rise)
            ctx.set(dut.rx_ctl[1], c_fall)
            await ctx.tick("rgmii_rx")

    async def sink(ctx):
        cycles = int(len(line) * rx_p / node) + 300
        await collect_frames(ctx, dut.rx, width, got, cycles, random.Random(width))
        counts.update({v: ctx.get(dut.rx_frames[v.value]) for v in RxDrop})
        link.append(ctx.get(dut.link))

    sim = Simulator(dut)
    sim.add_clock(node)
    sim.add_clock(tx_p, domain="rgmii_tx")
    sim.add_clock(rx_p, domain="rgmii_rx")
    for p in (source, tx_phy, rx_phy, sink):
        sim.add_testbench(p)
    sim.run()

    bursts, gaps, errors = rgmii_tx_decode(samples)
    assert errors == 0
    assert bursts == [wire_bytes(f) for f in tx_frames]
    assert all(g >= 12 for g in gaps), gaps
    if node <= tx_p * 8 / (width // 8) / 2:      # a node well ahead of the PHY: back to back
        assert gaps == [12] * (len(tx_frames) - 1)
    # A short frame arrives with its padding: a MAC cannot tell padding from payload.
    assert got == [f + bytes(max(0, 60 - len(f))) for f in rx_frames]
    assert counts[RxDrop.NONE] == 4
    assert counts[RxDrop.BAD_FCS] == 1 and counts[RxDrop.PHY_ERROR] == 1
    assert link == [1]


@pytest.mark.parametrize("status,up", [(0b1101, 1), (0b1011, 0), (0b1100, 0)])
def test_rgmii_link_from_inband_status(status, up):
    """Link up at 1000 Mb/s only: 100 Mb/s (speed 01) or link down read as down."""
    dut = Rgmii(32)
    seen = []

    async def rx_phy(ctx):
        for _ in range(20):
            ctx.set(dut.rx_data[0], status)
            ctx.set(dut.rx_data[1], status)
            await ctx.tick("rgmii_rx")

    async def watch(ctx):
        await ctx.tick().repeat(30)
        seen.append(ctx.get(dut.link))

    sim = Simulator(dut)
    sim.add_clock(10e-9)
    sim.add_clock(8e-9, domain="rgmii_tx")
    sim.add_clock(8e-9, domain="rgmii_rx")
    sim.add_testbench(rx_phy)
    sim.add_testbench(watch)
    sim.run()
    assert seen == [up]


class _PadsTop(wiring.Component):
    def __init__(self):
        super().__init__({})

    def elaborate(self, platform):
        m = Module()
        m.domains.sync = ClockDomain()
        m.domains.rgmii_tx = ClockDomain()
        m.domains.rgmii_tx_clk = ClockDomain()
        m.submodules.mac = mac = Rgmii(64)
        m.submodules.pads = pads = RgmiiPads(platform.request("eth_rgmii", 0, dir="-"))
        for name in ("tx_data", "tx_ctl"):
            m.d.comb += getattr(pads, name).eq(getattr(mac, name))
        for name in ("rx_data", "rx_ctl"):
            m.d.comb += getattr(mac, name).eq(getattr(pads, name))
        rx_domain(m, pads, ResetSignal("sync"))
        return m


def test_rgmii_pads_map_to_ecp5_ddr_primitives():
    """On the ECPIX-5 the pairs become IDDRX1F (5 receive lines) and ODDRX1F (5 transmit
    lines and TX_CLK), clocked by RX_CLK and the transmit domains."""
    pytest.importorskip("amaranth_boards")
    from amaranth_boards.ecpix5 import ECPIX585Platform
    plat = ECPIX585Platform()
    plan = plat.prepare(_PadsTop())
    def text(ext):
        return "".join(v if isinstance(v, str) else v.decode()
                       for k, v in plan.files.items() if k.endswith(ext))
    il = text(".il")
    assert il.count("IDDRX1F") == 5
    assert il.count("ODDRX1F") == 6
    assert 'FREQUENCY PORT "eth_rgmii_0__rx_clk__io" 125000000.0 HZ' in text(".lpf")
