"""What the node's port does with a received frame besides RoCE: the demux that sends
ARP, ICMP echo and control requests to their responders, the frame mux that merges
their replies with the RoCE transmit stream, and :class:`EthServices`, all wired
together."""

from __future__ import annotations

from amaranth.hdl import Module, Signal
from amaranth.lib import enum, fifo, wiring
from amaranth.lib.wiring import In, Out

from fpgaccl.hw.net.layouts import from_wire
from fpgaccl.hw.net.parser import sat_inc
from fpgaccl.proto.control import CONTROL_PORT
from fpgaccl.proto.drops import DROP_COUNTER_BITS
from fpgaccl.proto.headers import ARP, ETH, ICMP_ECHO_REQUEST, IPV4, UDP
from fpgaccl.proto.opcodes import ETHERTYPE_ARP, ETHERTYPE_IPV4, IP_PROTO_ICMP, IP_PROTO_UDP

from ..csr.bus import CSRBusSignature
from ..datapath.memport import memory_ports
from ..stream.beat import beat_layout, beat_stream
from ..stream.fifo import BeatFIFO
from ..stream.skid import SkidBuffer
from .arp import ArpResponder
from .control import ControlEndpoint
from .header import capture, header_beats
from .icmp import IcmpEcho
from .mac_rx import MAX_FRAME

BROADCAST = (1 << 48) - 1
CLASSIFY_BITS = 8 * (ETH.size + ARP.size)  # the longest header a decision reads
LOOKAHEAD = 16
"""Beats buffered while a frame's header arrives: at least its header, so the demux
decides without stopping its input."""


class Route(enum.Enum, shape=3):
    ROCE = 0
    ARP = 1
    ICMP = 2
    DROP = 3
    CONTROL = 4


class L2Demux(wiring.Component):
    """Frames in; each out whole, in order, on one of ``roce``, ``arp``, ``icmp``,
    ``control``, or dropped and counted on ``not_for_us`` (destination MAC neither
    ``mac`` nor broadcast; IPv4 or ARP target not ``ip``).

    ARP for us, IPv4 ICMP echo requests for us and IPv4 UDP to us on the control port
    (no options, not fragmented) go to their responders, which are always ready;
    everything else goes to ``roce``, whose parser owns the remaining drop reasons
    (ethertype, protocol, port ...), as before there was a MAC. Only ``roce`` can stall
    the demux, and only as much as it did the MAC: the demux adds latency (a header's
    worth of beats), never a wait."""

    def __init__(self, width: int) -> None:
        self.width = width
        assert header_beats(CLASSIFY_BITS, width) < LOOKAHEAD
        super().__init__({
            "i": In(beat_stream(width)),
            "roce": Out(beat_stream(width)),
            "arp": Out(beat_stream(width)),
            "icmp": Out(beat_stream(width)),
            "control": Out(beat_stream(width)),
            "mac": In(48),
            "ip": In(32),
            "not_for_us": Out(DROP_COUNTER_BITS),
        })

    def elaborate(self, platform) -> Module:
        m = Module()
        m.submodules.buf = buf = BeatFIFO(self.width, LOOKAHEAD)
        m.submodules.routes = routes = fifo.SyncFIFOBuffered(width=Route.as_shape().width,
                                                             depth=LOOKAHEAD)
        beat = self.i.payload
        take = Signal()
        m.d.comb += [
            buf.i.payload.eq(beat), buf.i.valid.eq(self.i.valid & routes.w_rdy),
            self.i.ready.eq(buf.i.ready & routes.w_rdy),
            take.eq(self.i.valid & self.i.ready),
        ]

        # Classify: capture the header, decide the cycle after it is complete.
        idx = Signal(16)
        hdr = Signal(CLASSIFY_BITS)
        decide = Signal()
        end = header_beats(CLASSIFY_BITS, self.width) - 1
        with m.If(take):
            m.d.sync += idx.eq(idx + 1)
            with m.If(beat.last):
                m.d.sync += idx.eq(0)
        capture(m, hdr, take, beat.data, idx)
        m.d.sync += decide.eq(take & ((idx == end) | (beat.last & (idx < end))))

        eth = from_wire(ETH, hdr)
        ip = from_wire(IPV4, hdr[8 * ETH.size:])
        arp = from_wire(ARP, hdr[8 * ETH.size:])
        icmp_type = hdr[8 * (ETH.size + IPV4.size):][:8]
        udp = from_wire(UDP, hdr[8 * (ETH.size + IPV4.size):])
        plain_ip = ((eth.type == ETHERTYPE_IPV4) & (ip.version == 4) & (ip.ihl == 5)
                    & (ip.frag == 0) & ~ip.flags[0])
        route = Signal(Route)
        with m.If((eth.dst != self.mac) & (eth.dst != BROADCAST)):
            m.d.comb += route.eq(Route.DROP)
        with m.Elif(eth.type == ETHERTYPE_ARP):
            m.d.comb += route.eq(Route.DROP)
            with m.If((arp.pdst == self.ip) & (arp.hwtype == ARP["hwtype"].default)
                      & (arp.ptype == ETHERTYPE_IPV4) & (arp.hwlen == 6) & (arp.plen == 4)):
                m.d.comb += route.eq(Route.ARP)
        with m.Elif((eth.type == ETHERTYPE_IPV4) & (ip.dst != self.ip)):
            m.d.comb += route.eq(Route.DROP)
        with m.Elif(plain_ip & (ip.proto == IP_PROTO_ICMP) & (icmp_type == ICMP_ECHO_REQUEST)):
            m.d.comb += route.eq(Route.ICMP)
        with m.Elif(plain_ip & (ip.proto == IP_PROTO_UDP) & (udp.dport == CONTROL_PORT)):
            m.d.comb += route.eq(Route.CONTROL)
        with m.Else():
            m.d.comb += route.eq(Route.ROCE)
        m.d.comb += [routes.w_en.eq(decide), routes.w_data.eq(route)]
        with m.If(decide & (route == Route.DROP)):
            sat_inc(m, self.not_for_us)

        # Forward: each frame to the output its route names.
        cur = Signal(Route)
        active = Signal()
        with m.If(~active & routes.r_rdy):
            m.d.comb += routes.r_en.eq(1)
            m.d.sync += [cur.eq(routes.r_data), active.eq(1)]
        outs = {Route.ROCE: self.roce, Route.ARP: self.arp, Route.ICMP: self.icmp,
                Route.CONTROL: self.control}
        for r, o in outs.items():
            m.d.comb += [o.payload.eq(buf.o.payload), o.valid.eq(active & (cur == r)
                                                                 & buf.o.valid)]
        with m.If(active):
            with m.Switch(cur):
                for r, o in outs.items():
                    with m.Case(r):
                        m.d.comb += buf.o.ready.eq(o.ready)
                with m.Case(Route.DROP):
                    m.d.comb += buf.o.ready.eq(1)
            with m.If(buf.o.valid & buf.o.ready & buf.o.payload.last):
                m.d.sync += active.eq(0)
        return m


class FrameMux(wiring.Component):
    """``n`` frame streams into one, a whole frame at a time, round robin so that a
    flood on one input (pings, say) cannot starve another."""

    def __init__(self, width: int, n: int) -> None:
        self.n = n
        super().__init__({f"i{k}": In(beat_stream(width)) for k in range(n)}
                         | {"o": Out(beat_stream(width))})

    def elaborate(self, platform) -> Module:
        m = Module()
        ins = [getattr(self, f"i{k}") for k in range(self.n)]
        cur = Signal(range(self.n))
        active = Signal()
        with m.If(~active):
            # Lowest valid input after the last one served.
            for shift in reversed(range(1, self.n + 1)):
                for k in range(self.n):
                    with m.If((cur == k) & ins[(k + shift) % self.n].valid):
                        m.d.sync += [cur.eq((k + shift) % self.n), active.eq(1)]
        with m.Else():
            for k, i in enumerate(ins):
                with m.If(cur == k):
                    m.d.comb += [self.o.payload.eq(i.payload), self.o.valid.eq(i.valid),
                                 i.ready.eq(self.o.ready)]
            with m.If(self.o.valid & self.o.ready & self.o.payload.last):
                m.d.sync += active.eq(0)
        return m


class EthServices(wiring.Component):
    """Between the MAC and the RoCE port: ``rx`` (from the MAC) -> ``roce_rx`` plus
    the ARP, ICMP and control responders; ``roce_tx`` plus their replies -> ``tx`` (to
    the MAC). ``lookup_ip`` -> ``lookup_hit``/``lookup_mac`` reads the learnt ARP table;
    ``ask`` broadcasts a who-has for ``ask_ip`` (``ask_taken``: it goes out).
    The control endpoint (:class:`~fpgaccl.hw.eth.control.ControlEndpoint`, built with
    ``control``'s keyword arguments) masters ``csr`` and the memory port
    (``rd_req``/``rd_resp``/``wr``) and counts ``control_key``/``control_malformed``;
    ``service_busy`` counts the frames any responder ignored while it answered one."""

    def __init__(self, width: int, *, max_frame: int = MAX_FRAME, arp_entries: int = 4,
                 control: dict | None = None):
        self.width = width
        self.max_frame = max_frame
        self.arp_entries = arp_entries
        self.control = control or {}
        super().__init__({
            "rx": In(beat_stream(width)),
            "roce_rx": Out(beat_stream(width)),
            "roce_tx": In(beat_stream(width)),
            "tx": Out(beat_stream(width)),
            "mac": In(48),
            "ip": In(32),
            "lookup_ip": In(32),
            "lookup_hit": Out(1),
            "lookup_mac": Out(48),
            "ask": In(1),
            "ask_ip": In(32),
            "ask_taken": Out(1),
            "csr": Out(CSRBusSignature(16)),
            **memory_ports(width, 1, 1),
            "not_for_us": Out(DROP_COUNTER_BITS),
            "service_busy": Out(DROP_COUNTER_BITS),
            "control_key": Out(DROP_COUNTER_BITS),
            "control_malformed": Out(DROP_COUNTER_BITS),
        })

    def elaborate(self, platform) -> Module:
        m = Module()
        w = self.width
        m.submodules.demux = demux = L2Demux(w)
        m.submodules.arp = arp = ArpResponder(w, entries=self.arp_entries)
        m.submodules.icmp = icmp = IcmpEcho(w, max_frame=self.max_frame)
        m.submodules.control = cp = ControlEndpoint(w, max_frame=self.max_frame,
                                                    **self.control)
        m.submodules.mux = mux = FrameMux(w, 4)
        # A register slice after the mux: its pick and the responders' buffer reads stay
        # out of the MAC's transmit path.
        m.submodules.tx_slice = tx_slice = SkidBuffer(beat_layout(w))
        wiring.connect(m, wiring.flipped(self.rx), demux.i)
        wiring.connect(m, demux.roce, wiring.flipped(self.roce_rx))
        for src, dst in ((demux.arp, arp.i), (demux.icmp, icmp.i), (demux.control, cp.i)):
            m.d.comb += [dst.payload.eq(src.payload), dst.valid.eq(src.valid),
                         src.ready.eq(1)]
        wiring.connect(m, wiring.flipped(self.roce_tx), mux.i0)
        wiring.connect(m, arp.o, mux.i1)
        wiring.connect(m, icmp.o, mux.i2)
        wiring.connect(m, cp.o, mux.i3)
        wiring.connect(m, cp.csr, wiring.flipped(self.csr))
        wiring.connect(m, cp.rd_req, wiring.flipped(self.rd_req))
        wiring.connect(m, wiring.flipped(self.rd_resp), cp.rd_resp)
        wiring.connect(m, cp.wr, wiring.flipped(self.wr))
        wiring.connect(m, mux.o, tx_slice.i)
        wiring.connect(m, tx_slice.o, wiring.flipped(self.tx))
        m.d.comb += [
            demux.mac.eq(self.mac), demux.ip.eq(self.ip), arp.mac.eq(self.mac),
            arp.ip.eq(self.ip), icmp.mac.eq(self.mac), cp.mac.eq(self.mac), cp.ip.eq(self.ip),
            arp.lookup_ip.eq(self.lookup_ip), arp.ask.eq(self.ask), arp.ask_ip.eq(self.ask_ip),
            self.ask_taken.eq(arp.ask_taken),
            self.lookup_hit.eq(arp.lookup_hit), self.lookup_mac.eq(arp.lookup_mac),
            self.not_for_us.eq(demux.not_for_us),
            self.control_key.eq(cp.key_drops), self.control_malformed.eq(cp.malformed),
        ]
        # Summed into a register: the two adders stay out of the CSR read path.
        m.d.sync += self.service_busy.eq(arp.busy + icmp.busy + cp.busy)
        return m
