"""Ethernet transmit framing, one byte per cycle: preamble and SFD, padding to the
minimum frame, the FCS, and the inter-frame gap."""

from __future__ import annotations

from amaranth.hdl import Const, Module, Mux, Signal
from amaranth.lib import stream, wiring
from amaranth.lib.wiring import In, Out

from ..net.crc import MASK32, crc_update
from .symbols import BYTE

PREAMBLE = 0x55
SFD = 0xD5
PREAMBLE_BYTES = 7
MIN_FRAME = 60
"""Bytes before the FCS of the shortest frame (64 on the wire with the FCS)."""
IFG = 12


class MacTx(wiring.Component):
    """Frame bytes (``last`` on the final one) in; GMII-shaped ``txd``/``tx_en``/
    ``tx_er`` out, registered, one byte per cycle.

    A PHY cannot wait, so a frame must be offered without gaps once started (the
    MAC puts a store-and-forward buffer in front): a byte missing mid-frame is an
    underrun, sent as one ``tx_er`` cycle (the receiver then discards the frame), and
    the rest of that frame is taken and thrown away. ``underrun`` pulses per frame."""

    def __init__(self, *, ifg: int = IFG) -> None:
        if ifg < IFG:
            raise ValueError(f"an inter-frame gap of {ifg} bytes is below Ethernet's {IFG}")
        self.ifg = ifg
        super().__init__({
            "i": In(stream.Signature(BYTE)),
            "txd": Out(8),
            "tx_en": Out(1),
            "tx_er": Out(1),
            "underrun": Out(1),
        })

    def elaborate(self, platform) -> Module:
        m = Module()
        n = Signal(range(max(MIN_FRAME, self.ifg) + 1))
        crc = Signal(32)
        byte = self.i.payload

        def send(value, er=0):
            m.d.sync += [self.txd.eq(value), self.tx_en.eq(1), self.tx_er.eq(er)]

        m.d.sync += [self.tx_en.eq(0), self.tx_er.eq(0), self.txd.eq(0),
                     self.underrun.eq(0)]
        with m.FSM():
            with m.State("IDLE"), m.If(self.i.valid):
                m.d.sync += n.eq(0)
                m.next = "PREAMBLE"
            with m.State("PREAMBLE"):
                send(PREAMBLE)
                m.d.sync += n.eq(n + 1)
                with m.If(n == PREAMBLE_BYTES):
                    send(SFD)
                    m.d.sync += [n.eq(0), crc.eq(MASK32)]
                    m.next = "DATA"
            with m.State("DATA"):
                m.d.comb += self.i.ready.eq(1)
                with m.If(self.i.valid):
                    send(byte.data)
                    # n saturates: past the minimum frame only "long enough" matters.
                    m.d.sync += [crc.eq(crc_update(crc, byte.data)),
                                 n.eq(Mux(n == MIN_FRAME, n, n + 1))]
                    with m.If(byte.last):
                        m.next = "FCS"
                        with m.If(n < MIN_FRAME - 1):
                            m.next = "PAD"
                        with m.Else():
                            m.d.sync += n.eq(0)
                with m.Else():
                    send(0, er=1)
                    m.d.sync += self.underrun.eq(1)
                    m.next = "DRAIN"
            with m.State("PAD"):
                send(0)
                m.d.sync += [crc.eq(crc_update(crc, Const(0, 8))), n.eq(n + 1)]
                with m.If(n == MIN_FRAME - 1):
                    m.d.sync += n.eq(0)
                    m.next = "FCS"
            with m.State("FCS"):
                # Ethernet sends the inverted register low byte first.
                send(~crc[:8])
                m.d.sync += [crc.eq(crc >> 8), n.eq(n + 1)]
                with m.If(n == 3):
                    m.d.sync += n.eq(0)
                    m.next = "IFG"
            with m.State("DRAIN"):
                m.d.comb += self.i.ready.eq(1)
                with m.If(self.i.valid & byte.last):
                    m.d.sync += n.eq(0)
                    m.next = "IFG"
            with m.State("IFG"):
                # IDLE adds one more idle cycle: back to back, the gap is exactly ifg.
                m.d.sync += n.eq(n + 1)
                with m.If(n == self.ifg - 2):
                    m.next = "IDLE"
        return m
