"""Ethernet receive framing, one byte per cycle: find the SFD, check and strip the
FCS, and give each frame a verdict."""

from __future__ import annotations

from amaranth.hdl import Cat, Module, Signal
from amaranth.lib import stream, wiring
from amaranth.lib.wiring import In, Out

from ..net.crc import MASK32, RESIDUE, crc_update
from .mac_tx import MIN_FRAME, PREAMBLE, SFD
from .symbols import RX_BYTE, RxDrop

FCS_BYTES = 4
MAX_FRAME = 1518
"""Longest untagged frame with its FCS (IEEE 802.3)."""


class MacRx(wiring.Component):
    """GMII-shaped ``rxd``/``rx_dv``/``rx_er`` in (sampled every cycle); the frame's
    bytes without preamble, SFD and FCS out, ``last`` on the final one carrying the
    verdict (:class:`RxDrop`). No back-pressure: a PHY cannot wait.

    Bytes leave five behind the wire: when ``rx_dv`` falls the last four were the
    FCS and the fifth is the last data byte, which is sent then with the verdict. A
    frame still too short to have a data byte (a runt) ends with one placeholder byte
    so its verdict is counted. An oversize frame is ended at ``max_frame`` bytes and
    the rest of it ignored, so what follows never needs more buffering than that. A
    carrier that starts with anything but preamble bytes and the SFD is ignored."""

    def __init__(self, *, max_frame: int = MAX_FRAME) -> None:
        if max_frame < MIN_FRAME + FCS_BYTES:
            raise ValueError(f"max_frame {max_frame} is below the minimum frame")
        self.max_frame = max_frame
        super().__init__({
            "rxd": In(8),
            "rx_dv": In(1),
            "rx_er": In(1),
            "o": Out(stream.Signature(RX_BYTE, always_ready=True)),
        })

    def elaborate(self, platform) -> Module:
        m = Module()
        delay = Signal(8 * (FCS_BYTES + 1))  # oldest byte in the low bits
        count = Signal(range(self.max_frame + 1))
        crc = Signal(32)
        phy_error = Signal()
        out = self.o.payload

        m.d.sync += self.o.valid.eq(0)
        with m.FSM():
            with m.State("HUNT"), m.If(self.rx_dv):
                with m.If(self.rxd == SFD):
                    m.d.sync += [count.eq(0), crc.eq(MASK32), phy_error.eq(self.rx_er)]
                    m.next = "DATA"
                with m.Elif((self.rxd != PREAMBLE) | self.rx_er):
                    m.next = "SKIP"
            with m.State("DATA"):
                with m.If(self.rx_dv):
                    m.d.sync += [delay.eq(Cat(delay[8:], self.rxd)), count.eq(count + 1),
                                 crc.eq(crc_update(crc, self.rxd))]
                    with m.If(self.rx_er):
                        m.d.sync += phy_error.eq(1)
                    with m.If(count >= FCS_BYTES + 1):
                        m.d.sync += [self.o.valid.eq(1), out.data.eq(delay[:8]),
                                     out.last.eq(0), out.drop.eq(RxDrop.NONE)]
                    with m.If(count == self.max_frame):
                        m.d.sync += [out.last.eq(1), out.drop.eq(RxDrop.OVERSIZE)]
                        m.next = "SKIP"
                with m.Else():
                    m.d.sync += [self.o.valid.eq(1), out.data.eq(delay[:8]), out.last.eq(1)]
                    with m.If(phy_error):
                        m.d.sync += out.drop.eq(RxDrop.PHY_ERROR)
                    with m.Elif(count < MIN_FRAME + FCS_BYTES):
                        m.d.sync += out.drop.eq(RxDrop.RUNT)
                    with m.Elif(crc != RESIDUE):
                        m.d.sync += out.drop.eq(RxDrop.BAD_FCS)
                    with m.Else():
                        m.d.sync += out.drop.eq(RxDrop.NONE)
                    m.next = "HUNT"
            with m.State("SKIP"), m.If(~self.rx_dv):
                m.next = "HUNT"
        return m
