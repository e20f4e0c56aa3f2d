"""RGMII at 1000 Mb/s: the MAC on a gigabit PHY's reduced interface, four data lines and
one control line per direction, each carrying two symbols a clock (DDR).

On the wire (RGMII v2.0): the rising edge of the 125 MHz clock carries bits 3:0 of a
byte, the falling edge bits 7:4; the control line carries TX_EN (RX_DV) on the rising
edge and TX_EN xor TX_ER (RX_DV xor RX_ER) on the falling edge. Between frames a PHY
puts its link status on RXD (in-band status: bit 0 link up, bits 2:1 speed, bit 3
duplex) with RX_DV and RX_ER both low.

:class:`Rgmii` is the logic on DDR pairs -- per clock the rising-edge and the
falling-edge value of each line, exactly what an :class:`amaranth.lib.io.DDRBuffer`
takes and gives (``o[0]``/``i[0]`` rising, ``o[1]``/``i[1]`` falling) -- around the
GMII MAC (:class:`~fpgaccl.hw.eth.gmii.Gmii`, its two domains renamed ``rgmii_tx`` and
``rgmii_rx``), so it runs in Amaranth's simulator. :class:`RgmiiPads` puts those pairs
on pins through DDRBuffers (IDDRX1F/ODDRX1F on an ECP5) and makes the ``rgmii_rx``
domain from the PHY's receive clock; DDR buffers do not simulate, so it is checked by
elaborating for the ECP5 (``tests/hw/test_eth_rgmii.py``).

Clocks. Receive: the PHY's RX_CLK clocks ``rgmii_rx``; the data is sampled on its
edges as they arrive, so the PHY must delay its clock by ~2 ns (RGMII-ID's internal RX
delay, a strap on the PHY). Transmit: ``rgmii_tx`` launches the data, and TX_CLK is a
DDR output (1 on the rising edge, 0 on the falling edge) clocked by ``rgmii_tx_clk``,
which the board's PLL makes as ``rgmii_tx`` shifted by 90 degrees (2 ns): the clock
then reaches the PHY centred in the data eye whatever the PHY's TX delay strap reads
over MDIO, which the node has no driver for. A PHY strapped to delay TX_CLK itself gets
a 0-degree ``rgmii_tx_clk`` instead (the board's ``tx_clock_phase``). A DDR output,
not a plain pin driven from a clock net: the ECP5 routes global clocks to fabric, not
to output pads, and the ODDRX1F keeps TX_CLK's edges as aligned to the data as the
data lines are to each other.

Only 1000 Mb/s: at 10/100 an RGMII PHY sends nibbles at 2.5/25 MHz on one edge, which
the MAC's byte path does not take; ``link`` is set only for a gigabit link up.
"""

from __future__ import annotations

from amaranth.hdl import Cat, ClockDomain, ClockSignal, DomainRenamer, Module, Signal
from amaranth.lib import data, io, wiring
from amaranth.lib.cdc import FFSynchronizer, ResetSynchronizer
from amaranth.lib.wiring import In, Out

from fpgaccl.proto.drops import DROP_COUNTER_BITS

from ..stream.beat import beat_stream
from .gmii import Gmii
from .mac_rx import MAX_FRAME
from .symbols import RxDrop

NIBBLE = 4
SPEED_1000 = 0b10
"""In-band status speed field (RXD[2:1]) of a gigabit link."""


def ddr_pairs() -> dict:
    """The DDR side, as seen from the MAC: ``[0]`` the rising edge, ``[1]`` the falling."""
    return {
        "tx_data": Out(data.ArrayLayout(NIBBLE, 2)),
        "tx_ctl": Out(data.ArrayLayout(1, 2)),
        "rx_data": In(data.ArrayLayout(NIBBLE, 2)),
        "rx_ctl": In(data.ArrayLayout(1, 2)),
    }


class Rgmii(wiring.Component):
    """``tx``/``rx`` beats and ``rx_frames`` (by :class:`RxDrop`) in ``sync``, the DDR
    pairs in ``rgmii_tx``/``rgmii_rx``; ``link`` (in ``sync``): the PHY's in-band status
    says a gigabit link is up. The clock crossings are the MAC's AsyncFIFOs on beats:
    ``sync`` must run at least ``125 MHz * 8 / width``."""

    def __init__(self, width: int, *, max_frame: int = MAX_FRAME) -> None:
        self.width = width
        self.max_frame = max_frame
        super().__init__({
            "tx": In(beat_stream(width)),
            "rx": Out(beat_stream(width)),
            "rx_frames": Out(data.ArrayLayout(DROP_COUNTER_BITS, len(RxDrop))),
            "link": Out(1),
            **ddr_pairs(),
        })

    def elaborate(self, platform) -> Module:
        m = Module()
        m.submodules.gmii = gmii = DomainRenamer({"gmii_tx": "rgmii_tx", "gmii_rx": "rgmii_rx"})(
            Gmii(self.width, max_frame=self.max_frame))
        wiring.connect(m, wiring.flipped(self.tx), gmii.tx)
        wiring.connect(m, gmii.rx, wiring.flipped(self.rx))
        m.d.comb += self.rx_frames.eq(gmii.rx_frames)

        # Gmii's transmit outputs are registers in rgmii_tx; the DDR buffer registers
        # them once more at the pad.
        m.d.comb += [self.tx_data[0].eq(gmii.txd[:NIBBLE]), self.tx_data[1].eq(gmii.txd[NIBBLE:]),
                     self.tx_ctl[0].eq(gmii.tx_en), self.tx_ctl[1].eq(gmii.tx_en ^ gmii.tx_er)]

        # Gmii registers its receive inputs in rgmii_rx before looking at them.
        dv = self.rx_ctl[0]
        er = self.rx_ctl[0] ^ self.rx_ctl[1]
        m.d.comb += [gmii.rxd.eq(Cat(self.rx_data[0], self.rx_data[1])), gmii.rx_dv.eq(dv),
                     gmii.rx_er.eq(er)]

        # In-band status: only between frames with both control bits low.
        status = Signal(NIBBLE)
        with m.If(~self.rx_ctl[0] & ~self.rx_ctl[1]):
            m.d.rgmii_rx += status.eq(self.rx_data[0])
        up = Signal()
        m.d.rgmii_rx += up.eq(status[0] & (status[1:3] == SPEED_1000))
        m.submodules.link_sync = FFSynchronizer(up, self.link)
        return m


class RgmiiPads(wiring.Component):
    """The DDR pairs on an RGMII resource's pins (``rx_clk``, ``rx_ctrl``, ``rx_data``,
    ``tx_clk``, ``tx_ctrl``, ``tx_data``, as amaranth-boards names them) and RX_CLK
    buffered on ``rx_clk`` (its pin constrained to 125 MHz). The parent defines the domains:
    ``rgmii_rx`` on ``rx_clk`` (:func:`rx_domain`), ``rgmii_tx`` and ``rgmii_tx_clk``
    (the 90-degree one) from its PLL."""

    def __init__(self, pins) -> None:
        self.pins = pins
        super().__init__(wiring.Signature({**ddr_pairs(), "rx_clk": In(1)}).flip())

    def elaborate(self, platform) -> Module:
        m = Module()
        p = self.pins
        m.submodules.rx_clk = rx_clk = io.Buffer("i", p.rx_clk)
        m.d.comb += self.rx_clk.eq(rx_clk.i)
        if platform is not None:
            # On the pin, not the buffer's output: synthesis renames that net, and
            # nextpnr then drops a constraint by net name.
            platform.add_clock_constraint(p.rx_clk.io, 125e6)

        m.submodules.rx_data = rxd = io.DDRBuffer("i", p.rx_data, i_domain="rgmii_rx")
        m.submodules.rx_ctrl = rxc = io.DDRBuffer("i", p.rx_ctrl, i_domain="rgmii_rx")
        m.submodules.tx_data = txd = io.DDRBuffer("o", p.tx_data, o_domain="rgmii_tx")
        m.submodules.tx_ctrl = txc = io.DDRBuffer("o", p.tx_ctrl, o_domain="rgmii_tx")
        m.submodules.tx_clk = txk = io.DDRBuffer("o", p.tx_clk, o_domain="rgmii_tx_clk")
        m.d.comb += [self.rx_data.eq(rxd.i), self.rx_ctl.eq(rxc.i),
                     txd.o.eq(self.tx_data), txc.o.eq(self.tx_ctl),
                     txk.o[0].eq(1), txk.o[1].eq(0)]
        return m


def rx_domain(m: Module, pads: RgmiiPads, rst) -> None:
    """``rgmii_rx`` on the PHY's receive clock, in reset while ``rst`` is high (released
    synchronously to it)."""
    m.domains.rgmii_rx = ClockDomain("rgmii_rx")
    m.d.comb += ClockSignal("rgmii_rx").eq(pads.rx_clk)
    m.submodules.rgmii_rx_rst = ResetSynchronizer(rst, domain="rgmii_rx")
