"""ARP: answer who-has for our address, learn the sender of what is addressed to us, and
ask who has a peer's address."""

from __future__ import annotations

from amaranth.hdl import Cat, Module, Mux, Signal
from amaranth.lib import stream, wiring
from amaranth.lib.wiring import In, Out

from fpgaccl.hw.net.layouts import from_wire, header_layout, to_wire
from fpgaccl.hw.net.parser import sat_inc
from fpgaccl.proto.drops import DROP_COUNTER_BITS
from fpgaccl.proto.headers import ARP, ARP_REPLY, ARP_REQUEST, ETH
from fpgaccl.proto.opcodes import ETHERTYPE_ARP

from ..stream.beat import beat_layout, beat_stream
from .header import admit, capture, header_beats

FRAME_BITS = 8 * (ETH.size + ARP.size)


class ArpTable(wiring.Component):
    """``entries`` (IPv4 -> MAC) pairs, written by ``learn`` (an address already
    present is updated in place, a new one replaces the oldest), looked up
    combinationally by ``ip`` -> ``hit``/``mac``."""

    def __init__(self, entries: int = 4) -> None:
        self.entries = entries
        super().__init__({
            "learn": In(1), "learn_ip": In(32), "learn_mac": In(48),
            "ip": In(32), "hit": Out(1), "mac": Out(48),
        })

    def elaborate(self, platform) -> Module:
        m = Module()
        n = self.entries
        ips = [Signal(32, name=f"ip{k}") for k in range(n)]
        macs = [Signal(48, name=f"mac{k}") for k in range(n)]
        valid = Signal(n)
        oldest = Signal(range(n))
        hits = Cat(*(valid[k] & (ips[k] == self.ip) for k in range(n)))
        same = Cat(*(valid[k] & (ips[k] == self.learn_ip) for k in range(n)))
        m.d.comb += [self.hit.eq(hits.any()),
                     self.mac.eq(one_hot_select(macs, hits))]
        with m.If(self.learn):
            for k in range(n):
                with m.If(Mux(same.any(), same[k], oldest == k)):
                    m.d.sync += [ips[k].eq(self.learn_ip), macs[k].eq(self.learn_mac),
                                 valid[k].eq(1)]
            with m.If(~same.any()):
                m.d.sync += oldest.eq(Mux(oldest == n - 1, 0, oldest + 1))
        return m


def one_hot_select(values, select):
    """The value whose bit of ``select`` (one-hot) is set, as an AND-OR."""
    out = 0
    for k, v in enumerate(values):
        out = out | Mux(select[k], v, 0)
    return out


class ArpResponder(wiring.Component):
    """ARP frames addressed to ``ip`` in (the demux sends no others; never
    back-pressured); the sender is learnt into :class:`ArpTable` and a request is
    answered on ``o`` (42 bytes: the MAC pads). A frame arriving while a reply is
    still going out is ignored and counted on ``busy``. ``ask`` broadcasts a who-has for
    ``ask_ip`` once nothing else is in hand (``ask_taken``, that cycle); the answer,
    addressed to us, is learnt like any other."""

    def __init__(self, width: int, *, entries: int = 4) -> None:
        self.width = width
        self.entries = entries
        super().__init__({
            "i": In(stream.Signature(beat_layout(width), always_ready=True)),
            "o": Out(beat_stream(width)),
            "mac": In(48),
            "ip": In(32),
            "lookup_ip": In(32),
            "lookup_hit": Out(1),
            "lookup_mac": Out(48),
            "ask": In(1),
            "ask_ip": In(32),
            "ask_taken": Out(1),
            "busy": Out(DROP_COUNTER_BITS),
        })

    def elaborate(self, platform) -> Module:
        m = Module()
        nb = self.width // 8
        m.submodules.table = table = ArpTable(self.entries)
        m.d.comb += [table.ip.eq(self.lookup_ip), self.lookup_hit.eq(table.hit),
                     self.lookup_mac.eq(table.mac)]

        beat = self.i.payload
        idx = Signal(16)
        hdr = Signal(FRAME_BITS)
        sending = Signal()
        done = Signal()
        mine, refused = admit(m, self.i.valid, beat.last, ~sending & ~done)
        with m.If(self.i.valid):
            m.d.sync += idx.eq(Mux(beat.last, 0, idx + 1))
        capture(m, hdr, mine, beat.data, idx)
        with m.If(refused):
            sat_inc(m, self.busy)
        capturing = Signal()    # the next beats belong to a frame being taken
        with m.If(self.i.valid):
            m.d.sync += capturing.eq(mine & ~beat.last)

        # The cycle after the last beat the whole request is in hdr.
        m.d.sync += done.eq(mine & beat.last)
        req = from_wire(ARP, hdr[8 * ETH.size:])
        m.d.comb += [table.learn.eq(done), table.learn_ip.eq(req.psrc),
                     table.learn_mac.eq(req.hwsrc)]

        eth_out = Signal(header_layout(ETH))
        arp_out = Signal(header_layout(ARP))
        reply = Signal(FRAME_BITS)
        m.d.comb += [
            eth_out.dst.eq(req.hwsrc), eth_out.src.eq(self.mac), eth_out.type.eq(ETHERTYPE_ARP),
            arp_out.eq(req), arp_out.op.eq(ARP_REPLY),
            arp_out.hwsrc.eq(self.mac), arp_out.psrc.eq(self.ip),
            arp_out.hwdst.eq(req.hwsrc), arp_out.pdst.eq(req.psrc),
        ]
        eth_ask = Signal(header_layout(ETH))
        arp_ask = Signal(header_layout(ARP))
        m.d.comb += [
            eth_ask.dst.eq((1 << 48) - 1), eth_ask.src.eq(self.mac),
            eth_ask.type.eq(ETHERTYPE_ARP),
            *(getattr(arp_ask, f).eq(ARP[f].default) for f in ("hwtype", "ptype", "hwlen", "plen")),
            arp_ask.op.eq(ARP_REQUEST), arp_ask.hwsrc.eq(self.mac), arp_ask.psrc.eq(self.ip),
            arp_ask.hwdst.eq(0), arp_ask.pdst.eq(self.ask_ip),
        ]
        out_idx = Signal(range(header_beats(FRAME_BITS, self.width)))
        last_beat = header_beats(FRAME_BITS, self.width) - 1
        m.d.comb += self.ask_taken.eq(self.ask & ~sending & ~done & ~capturing &
                                      ~self.i.valid)
        with m.If(done & (req.op == ARP_REQUEST)):
            m.d.sync += [reply.eq(Cat(to_wire(eth_out), to_wire(arp_out))), sending.eq(1),
                         out_idx.eq(0)]
        with m.Elif(self.ask_taken):
            m.d.sync += [reply.eq(Cat(to_wire(eth_ask), to_wire(arp_ask))), sending.eq(1),
                         out_idx.eq(0)]
        padded = Cat(reply, Signal(8 * nb * (last_beat + 1) - FRAME_BITS))
        tail = FRAME_BITS // 8 - nb * last_beat
        m.d.comb += [
            self.o.valid.eq(sending),
            self.o.payload.data.eq(padded.word_select(out_idx, self.width)),
            self.o.payload.keep.eq(Mux(out_idx == last_beat, (1 << tail) - 1, (1 << nb) - 1)),
            self.o.payload.first.eq(out_idx == 0),
            self.o.payload.last.eq(out_idx == last_beat),
        ]
        with m.If(self.o.valid & self.o.ready):
            m.d.sync += out_idx.eq(out_idx + 1)
            with m.If(self.o.payload.last):
                m.d.sync += sending.eq(0)
        return m
