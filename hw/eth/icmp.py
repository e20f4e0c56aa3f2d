"""ICMP echo: a request to our address goes back as the reply, payload unchanged."""

from __future__ import annotations

from amaranth.hdl import Cat, Const, Module, Mux, Signal
from amaranth.lib import stream, wiring
from amaranth.lib.wiring import In, Out

from fpgaccl.hw.net.layouts import from_wire, header_layout, to_wire
from fpgaccl.hw.net.parser import sat_inc
from fpgaccl.proto.drops import DROP_COUNTER_BITS
from fpgaccl.proto.headers import ETH, ICMP, ICMP_ECHO_REPLY, ICMP_ECHO_REQUEST, IPV4

from ..stream.beat import beat_layout, beat_stream
from ..stream.commit_fifo import CommitFIFO
from .gate import frame_depth
from .header import admit, capture, overlay
from .mac_rx import MAX_FRAME

HDR_BITS = 8 * (ETH.size + IPV4.size + ICMP.size // 2)  # up to the ICMP checksum


def echo_checksum(chksum):
    """The request's checksum turned into the reply's: only the type word changes, from
    ``type 8, code 0`` to zero (RFC 1624 eqn. 3: ``HC' = ~(~HC + ~m + m')``)."""
    total = (~chksum)[:16] + (~(ICMP_ECHO_REQUEST << 8) & 0xFFFF)
    return ~(total[:16] + total[16])[:16]


class IcmpEcho(wiring.Component):
    """ICMP echo requests to us in (the demux sends no others; never back-pressured),
    the replies out: Ethernet and IP addresses swapped (the IP checksum is unchanged by
    a swap), type 0, the ICMP checksum fixed incrementally, the rest as received. One
    frame is buffered; one arriving while a reply is still going out is ignored and
    counted on ``busy``."""

    def __init__(self, width: int, *, max_frame: int = MAX_FRAME) -> None:
        self.width = width
        self.max_frame = max_frame
        super().__init__({
            "i": In(stream.Signature(beat_layout(width), always_ready=True)),
            "o": Out(beat_stream(width)),
            "mac": In(48),
            "busy": Out(DROP_COUNTER_BITS),
        })

    def elaborate(self, platform) -> Module:
        m = Module()
        m.submodules.buf = buf = CommitFIFO(self.width, frame_depth(self.width, self.max_frame))
        beat = self.i.payload
        idx = Signal(16)
        hdr = Signal(HDR_BITS)
        held = Signal()      # a frame is in the buffer or going out
        mine, refused = admit(m, self.i.valid, beat.last, ~held)
        with m.If(self.i.valid):
            m.d.sync += idx.eq(Mux(beat.last, 0, idx + 1))
        capture(m, hdr, mine, beat.data, idx)
        with m.If(refused):
            sat_inc(m, self.busy)
        m.d.comb += [buf.w_en.eq(mine), buf.w_data.eq(beat), buf.commit.eq(mine & beat.last)]
        with m.If(mine & beat.last):
            m.d.sync += held.eq(1)

        eth = from_wire(ETH, hdr)
        ip = from_wire(IPV4, hdr[8 * ETH.size:])
        icmp = hdr[8 * (ETH.size + IPV4.size):]  # type, code, checksum
        eth_out = Signal(header_layout(ETH))
        ip_out = Signal(header_layout(IPV4))
        chk = Signal(16)
        m.d.comb += [
            eth_out.dst.eq(eth.src), eth_out.src.eq(self.mac), eth_out.type.eq(eth.type),
            ip_out.eq(ip), ip_out.src.eq(ip.dst), ip_out.dst.eq(ip.src),
            chk.eq(echo_checksum(Cat(icmp[24:32], icmp[16:24]))),
        ]
        reply = Cat(to_wire(eth_out), to_wire(ip_out), Const(ICMP_ECHO_REPLY, 8), icmp[8:16],
                    chk[8:16], chk[:8])

        out_idx = Signal(16)
        m.d.comb += [
            self.o.valid.eq(buf.o.valid),
            buf.o.ready.eq(self.o.ready),
            self.o.payload.eq(buf.o.payload),
            self.o.payload.data.eq(overlay(buf.o.payload.data, reply, out_idx)),
        ]
        with m.If(self.o.valid & self.o.ready):
            m.d.sync += out_idx.eq(Mux(self.o.payload.last, 0, out_idx + 1))
            with m.If(self.o.payload.last):
                m.d.sync += held.eq(0)
        return m
