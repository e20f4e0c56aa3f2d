"""The control port (:mod:`fpgaccl.proto.control`): requests to our IP on UDP 4792
read and write registers over a CSR bus master and memory over a memory port, and are
answered in place in the buffer they arrived in."""

from __future__ import annotations

from amaranth.hdl import Cat, Const, Module, Mux, Signal
from amaranth.lib import data, memory, stream, wiring
from amaranth.lib.wiring import In, Out
from amaranth.utils import exact_log2

from fpgaccl.hw.csr.bus import CSRBusSignature
from fpgaccl.hw.datapath.memport import memory_ports
from fpgaccl.hw.net.layouts import from_wire, header_layout, to_wire
from fpgaccl.hw.net.parser import sat_inc
from fpgaccl.proto import control as ctl
from fpgaccl.proto.drops import DROP_COUNTER_BITS
from fpgaccl.proto.headers import ETH, IPV4, UDP
from fpgaccl.proto.opcodes import ETHERTYPE_IPV4, IP_PROTO_UDP

from ..stream.beat import beat_layout, beat_stream
from ..stream.skid import SkidBuffer
from .header import admit, capture, overlay
from .mac_rx import FCS_BYTES, MAX_FRAME

HDR_BITS = 8 * ctl.BODY_OFFSET
_IP_AT, _UDP_AT = 8 * ETH.size, 8 * (ETH.size + IPV4.size)
_CTL_AT = 8 * ctl.ETH_IP_UDP_BYTES
_MIN_IP_LEN = IPV4.size + UDP.size + ctl.HEADER_BYTES


class ControlEndpoint(wiring.Component):
    """Control requests in (the demux sends only IPv4/UDP to our address and the
    control port; never back-pressured), responses out. One request is held at a time:
    a frame arriving meanwhile is ignored and counted on ``busy`` (the host retries).

    Bytes are handled one per cycle: this is the slow path, and it keeps the body's
    alignment (70 bytes of headers) out of the datapath. ``key`` is the build-time key
    (0: the first HELLO with a non-zero key sets it); ``mem_log2`` bounds memory
    addresses; ``info`` overrides :data:`~fpgaccl.proto.control.INFO` fields HELLO
    reports (``mac``, ``ip``, ``width``, ``max_body`` and ``mem_log2`` are filled in)."""

    def __init__(self, width: int, *, max_frame: int = MAX_FRAME, key: int = 0,
                 mem_log2: int = 32, **info: int) -> None:
        self.width = width
        self.max_frame = max_frame
        # ``max_frame`` counts the FCS, as the MAC does; the frames here are without it.
        self.body_max = ctl.max_body(max_frame - FCS_BYTES)
        self.key_init = key
        self.mem_log2 = mem_log2
        self.info = {**info, "width": width, "max_body": self.body_max, "mem_log2": mem_log2}
        super().__init__({
            "i": In(stream.Signature(beat_layout(width), always_ready=True)),
            "o": Out(beat_stream(width)),
            "mac": In(48),
            "ip": In(32),
            "csr": Out(CSRBusSignature(ctl.CSR_ADDR_BITS)),
            **memory_ports(width, 1, 1),
            "key_drops": Out(DROP_COUNTER_BITS),
            "malformed": Out(DROP_COUNTER_BITS),
            "busy": Out(DROP_COUNTER_BITS),
        })

    def elaborate(self, platform) -> Module:
        m = Module()
        nb = self.width // 8
        lg = exact_log2(nb)
        depth = -(-self.max_frame // nb)
        m.submodules.buf = buf = memory.Memory(shape=self.width, depth=depth, init=[])
        wp = buf.write_port(granularity=8)
        # A registered read: the buffer is block RAM (as a LUT RAM read asynchronously its
        # output mux was the deepest path of the board's build). A body byte takes two
        # cycles, its address and then its data (``fetched``); SEND asks a word ahead.
        rp = buf.read_port()
        # Responses leave through a register slice: the buffer's read and the header
        # overlay stay out of the frame mux and the MAC behind it.
        m.submodules.out = out = SkidBuffer(beat_layout(self.width))
        wiring.connect(m, out.o, wiring.flipped(self.o))

        beat = self.i.payload
        idx = Signal(16)
        hdr = Signal(HDR_BITS)
        flen = Signal(16)        # received frame bytes
        overflow = Signal()
        idle = Signal()
        mine, refused = admit(m, self.i.valid, beat.last, idle)
        with m.If(self.i.valid):
            m.d.sync += idx.eq(Mux(beat.last, 0, idx + 1))
        capture(m, hdr, mine, beat.data, idx)
        with m.If(refused):
            sat_inc(m, self.busy)
        with m.If(mine):
            m.d.comb += [wp.addr.eq(idx), wp.data.eq(beat.data),
                         wp.en.eq(Mux(idx < depth, (1 << nb) - 1, 0))]
            m.d.sync += flen.eq(idx * nb + sum(beat.keep[k] for k in range(nb)))
            with m.If(idx >= depth):
                m.d.sync += overflow.eq(1)

        eth = from_wire(ETH, hdr)
        ip = from_wire(IPV4, hdr[_IP_AT:])
        udp = from_wire(UDP, hdr[_UDP_AT:])
        req = from_wire(ctl.CONTROL, hdr[_CTL_AT:])

        # One byte of the buffer read and one written per cycle, at frame offsets.
        rd_idx = Signal(range(depth * nb))
        rd_byte = Signal(8)
        wb_en = Signal()
        wb_idx = Signal(range(depth * nb))
        wb_data = Signal(8)
        out_idx = Signal(range(depth))
        sending = Signal()
        out_addr = Signal(range(depth))  # the word SEND shows next cycle
        fetched = Signal()
        m.d.comb += [
            rp.addr.eq(Mux(sending, out_addr, rd_idx[lg:])),
            rd_byte.eq(rp.data.word_select(rd_idx[:lg], 8)),
        ]
        with m.If(wb_en):
            m.d.comb += [wp.addr.eq(wb_idx[lg:]), wp.data.eq(wb_data.replicate(nb)),
                         wp.en.eq(Const(1, nb) << wb_idx[:lg])]

        key = Signal(64, init=self.key_init)
        status = Signal(16)
        resp_len = Signal(16)    # response body bytes
        k = Signal(16)           # item (pair, register, byte) of the body
        b = Signal(range(max(nb, 8)))  # byte of the item or lane of the beat
        gather = Signal(64)
        verify = Signal()        # CSR_WRITE's first pass: every address checked first
        slot_valid = Signal()
        slot_ip = Signal(32)
        slot_port = Signal(16)
        slot_seq = Signal(32)
        waddr = Signal(64)
        wbeat = Signal(self.width)
        wkeep = Signal(nb)
        wlast = Signal()

        body_len = Signal(16)
        want_body = Signal(17)
        out_len = Signal(18)
        m.d.comb += [
            body_len.eq(ip.len - _MIN_IP_LEN),
            want_body.eq(Mux(req.op == ctl.Op.CSR_WRITE, req.count * ctl.PAIR_BYTES,
                             Mux(req.op == ctl.Op.MEM_WRITE, req.count, 0))),
            out_len.eq(Mux(req.op == ctl.Op.CSR_READ, req.count * 4,
                           Mux(req.op == ctl.Op.MEM_READ, req.count, 0))),
        ]
        malformed = (overflow | (flen < ctl.BODY_OFFSET) | (ip.len < _MIN_IP_LEN)
                     | (udp.len != ip.len - IPV4.size) | (ip.len + ETH.size > flen)
                     | (req.magic != ctl.MAGIC) | (req.version != ctl.VERSION)
                     | (req.flags != 0) | (body_len != want_body))
        is_hello = req.op == ctl.Op.HELLO
        is_write = (req.op == ctl.Op.CSR_WRITE) | (req.op == ctl.Op.MEM_WRITE)
        same_client = slot_valid & (slot_ip == ip.src) & (slot_port == udp.sport)
        seq_diff = Signal(32)
        m.d.comb += seq_diff.eq(req.seq - slot_seq)

        judged = Signal(data.StructLayout({name: 1 for name in (
            "malformed", "first_key", "key", "op", "length", "csr_range", "mem_range",
            "retry", "stale")}))
        # The bus address is a register of its own (set a cycle ahead): an adder or a
        # state's pick in front of the CSR bank's read decode made the node's worst path.
        csr_a = Signal(ctl.CSR_ADDR_BITS)
        m.d.comb += self.csr.addr.eq(csr_a)
        info = Signal(header_layout(ctl.INFO))
        m.d.comb += [info.eq(ctl.INFO.to_int(**self.info)), info.mac.eq(self.mac),
                     info.ip.eq(self.ip)]

        def respond(code, length=0, then="HEADER"):
            m.d.sync += [status.eq(code), resp_len.eq(length)]
            m.next = then

        def put(offset, byte):
            m.d.comb += [wb_en.eq(1), wb_idx.eq(ctl.BODY_OFFSET + offset), wb_data.eq(byte)]

        reply = Signal(HDR_BITS)
        total = Signal(16)
        ip_sum = Signal(20)
        headers = self._headers(m, eth, ip, udp, req, status, resp_len)
        with m.FSM():
            with m.State("IDLE"):
                m.d.comb += idle.eq(1)
                with m.If(mine & beat.last):
                    m.next = "CHECK"
            # CHECK registers every test of the request; DECIDE acts on them the next
            # cycle, so that the compares and the priority between them do not share one.
            with m.State("CHECK"):
                m.d.sync += [k.eq(0), b.eq(0), overflow.eq(0), gather.eq(0), wkeep.eq(0),
                             csr_a.eq(req.addr), waddr.eq(req.addr),
                             judged.malformed.eq(malformed),
                             judged.first_key.eq(is_hello & (key == 0) & (req.key != 0)),
                             judged.key.eq((key == 0) | (req.key != key)),
                             judged.op.eq(req.op > max(ctl.Op)),
                             judged.length.eq((req.count == 0) | (want_body > self.body_max)
                                           | (out_len > self.body_max)),
                             judged.csr_range.eq(
                                 (req.addr[:2] != 0)
                                 | (req.addr + (req.count << 2) > 1 << ctl.CSR_ADDR_BITS)),
                             judged.mem_range.eq(req.addr + req.count > 1 << self.mem_log2),
                             judged.retry.eq(same_client & (seq_diff == 0)),
                             judged.stale.eq(same_client & seq_diff[31])]
                m.next = "DECIDE"
            with m.State("DECIDE"):
                with m.If(judged.malformed):
                    sat_inc(m, self.malformed)
                    m.next = "IDLE"
                with m.Elif(judged.first_key):
                    m.d.sync += key.eq(req.key)
                    respond(ctl.Status.OK, ctl.INFO.size, "INFO")
                with m.Elif(judged.key):
                    sat_inc(m, self.key_drops)
                    m.next = "IDLE"
                    with m.If(is_hello):
                        respond(ctl.Status.BAD_KEY)
                with m.Elif(judged.op):
                    respond(ctl.Status.BAD_OP)
                with m.Elif(is_hello):
                    respond(ctl.Status.OK, ctl.INFO.size, "INFO")
                with m.Elif(judged.length):
                    respond(ctl.Status.BAD_LENGTH)
                with m.Elif((req.op == ctl.Op.CSR_READ) & judged.csr_range):
                    respond(ctl.Status.OUT_OF_RANGE)
                with m.Elif(((req.op == ctl.Op.MEM_READ) | (req.op == ctl.Op.MEM_WRITE))
                            & judged.mem_range):
                    respond(ctl.Status.OUT_OF_RANGE)
                with m.Elif(is_write & judged.retry):
                    respond(ctl.Status.OK)   # a retry: answered again, not executed
                with m.Elif(is_write & judged.stale):
                    respond(ctl.Status.STALE)
                with m.Else():
                    m.d.sync += [status.eq(ctl.Status.OK), resp_len.eq(out_len), verify.eq(1)]
                    with m.Switch(req.op):
                        with m.Case(ctl.Op.CSR_WRITE):
                            m.next = "PAIR"
                        with m.Case(ctl.Op.CSR_READ):
                            m.next = "RD_STB"
                        with m.Case(ctl.Op.MEM_READ):
                            m.next = "MR_REQ"
                        with m.Case(ctl.Op.MEM_WRITE):
                            m.d.sync += [slot_valid.eq(1), slot_ip.eq(ip.src),
                                         slot_port.eq(udp.sport), slot_seq.eq(req.seq)]
                            m.next = "MW_GATHER"
            with m.State("INFO"):
                put(k, to_wire(info).word_select(k[:5], 8))
                m.d.sync += k.eq(k + 1)
                with m.If(k == ctl.INFO.size - 1):
                    m.next = "HEADER"

            # CSR_WRITE: every pair read twice, first to check its address, then to write.
            with m.State("PAIR"):
                m.d.comb += rd_idx.eq(ctl.BODY_OFFSET + (k << 3) + b)
                m.d.sync += fetched.eq(~fetched)
                with m.If(fetched):
                    shifted = Cat(rd_byte, gather[:56])
                    m.d.sync += [gather.eq(shifted), b.eq(b + 1)]
                    with m.If(b == 7):
                        m.d.sync += [b.eq(0), csr_a.eq(shifted[32:])]
                        m.next = "PAIR_DO"
            with m.State("PAIR_DO"):
                m.d.sync += k.eq(k + 1)
                m.next = "PAIR"
                pair_addr = gather[32:]
                with m.If(verify):
                    with m.If((pair_addr[:2] != 0) | (pair_addr >> ctl.CSR_ADDR_BITS != 0)):
                        respond(ctl.Status.OUT_OF_RANGE)
                    with m.Elif(k == req.count - 1):
                        m.d.sync += [k.eq(0), verify.eq(0), slot_valid.eq(1),
                                     slot_ip.eq(ip.src), slot_port.eq(udp.sport),
                                     slot_seq.eq(req.seq)]
                with m.Else():
                    m.d.comb += [self.csr.w_data.eq(gather[:32]), self.csr.w_stb.eq(1)]
                    with m.If(k == req.count - 1):
                        m.next = "HEADER"

            # CSR_READ: strobe, take the data the next cycle, store it big-endian.
            with m.State("RD_STB"):
                m.d.comb += self.csr.r_stb.eq(1)
                m.next = "RD_DATA"
            with m.State("RD_DATA"):
                m.d.sync += gather.eq(self.csr.r_data)
                m.next = "RD_PUT"
            with m.State("RD_PUT"):
                put((k << 2) + b, gather[24:32])
                m.d.sync += [gather.eq(gather << 8), b.eq(b + 1)]
                with m.If(b == 3):
                    m.d.sync += [b.eq(0), k.eq(k + 1), csr_a.eq(csr_a + 4)]
                    m.next = "RD_STB"
                    with m.If(k == req.count - 1):
                        m.next = "HEADER"

            # MEM_READ: one request; the answer's bytes stored one per cycle.
            with m.State("MR_REQ"):
                m.d.comb += [self.rd_req.valid.eq(1), self.rd_req.payload.addr.eq(req.addr),
                             self.rd_req.payload.len.eq(req.count)]
                with m.If(self.rd_req.ready):
                    m.next = "MR_DATA"
            with m.State("MR_DATA"), m.If(self.rd_resp.valid):
                with m.If(k < req.count):
                    put(k, self.rd_resp.payload.data.word_select(b[:lg], 8))
                m.d.sync += [k.eq(k + 1), b.eq(b + 1)]
                with m.If(b == nb - 1):
                    m.d.comb += self.rd_resp.ready.eq(1)
                    m.d.sync += b.eq(0)
                    with m.If(self.rd_resp.payload.last):
                        m.next = "HEADER"

            # MEM_WRITE: the body's bytes gathered into beats at addr, addr + nb, ...
            with m.State("MW_GATHER"):
                m.d.comb += rd_idx.eq(ctl.BODY_OFFSET + k)
                m.d.sync += fetched.eq(~fetched)
                with m.If(fetched):
                    for lane in range(nb):
                        with m.If(b[:lg] == lane):
                            m.d.sync += [wbeat.word_select(lane, 8).eq(rd_byte),
                                         wkeep[lane].eq(1)]
                    m.d.sync += [k.eq(k + 1), b.eq(b + 1), wlast.eq(k == req.count - 1)]
                    with m.If((b == nb - 1) | (k == req.count - 1)):
                        m.d.sync += b.eq(0)
                        m.next = "MW_PUT"
            with m.State("MW_PUT"):
                m.d.comb += [self.wr.valid.eq(1), self.wr.payload.addr.eq(waddr),
                             self.wr.payload.data.eq(wbeat), self.wr.payload.keep.eq(wkeep),
                             self.wr.payload.last.eq(wlast)]
                with m.If(self.wr.ready):
                    m.d.sync += [waddr.eq(waddr + nb), wkeep.eq(0)]
                    m.next = "MW_GATHER"
                    with m.If(wlast):
                        m.next = "HEADER"

            # The IPv4 checksum's sum is registered in HEADER and folded into the reply
            # in REPLY: one adder tree per cycle.
            with m.State("HEADER"):
                m.d.sync += [ip_sum.eq(self._ip_sum(headers[1])),
                             total.eq(ctl.BODY_OFFSET + resp_len), out_idx.eq(0)]
                m.next = "REPLY"
            with m.State("REPLY"):
                m.d.sync += reply.eq(self._reply(m, headers, ip_sum))
                m.d.comb += [sending.eq(1), out_addr.eq(0)]
                m.next = "SEND"
            with m.State("SEND"):
                m.d.comb += [sending.eq(1),
                             out_addr.eq(Mux(out.i.ready, out_idx + 1, out_idx))]
                last_idx = (total - 1)[lg:]
                tail = total[:lg]        # bytes in the last beat, 0 meaning all
                is_last = out_idx == last_idx
                m.d.comb += [
                    out.i.valid.eq(1),
                    out.i.payload.data.eq(overlay(rp.data, reply, out_idx)),
                    out.i.payload.keep.eq(Mux(is_last & (tail != 0),
                                               (Const(1, nb + 1) << tail) - 1, (1 << nb) - 1)),
                    out.i.payload.first.eq(out_idx == 0),
                    out.i.payload.last.eq(is_last),
                ]
                with m.If(out.i.ready):
                    m.d.sync += out_idx.eq(out_idx + 1)
                    with m.If(is_last):
                        m.next = "IDLE"
        return m

    def _headers(self, m, eth, ip, udp, req, status, resp_len):
        """The response's headers but the IPv4 checksum: addresses and ports swapped,
        lengths for a body of ``resp_len`` bytes, UDP checksum 0, the request's op, seq,
        addr and count with RESPONSE (and ERROR) set."""
        eth_o = Signal(header_layout(ETH))
        ip_o = Signal(header_layout(IPV4))
        udp_o = Signal(header_layout(UDP))
        ctl_o = Signal(header_layout(ctl.CONTROL))
        ip_len = _MIN_IP_LEN + resp_len
        m.d.comb += [
            eth_o.dst.eq(eth.src), eth_o.src.eq(self.mac), eth_o.type.eq(ETHERTYPE_IPV4),
            ip_o.eq(IPV4.to_int(proto=IP_PROTO_UDP)), ip_o.len.eq(ip_len),
            ip_o.src.eq(self.ip), ip_o.dst.eq(ip.src),
            udp_o.sport.eq(ctl.CONTROL_PORT), udp_o.dport.eq(udp.sport),
            udp_o.len.eq(ip_len - IPV4.size),
            ctl_o.eq(req), ctl_o.key.eq(0), ctl_o.status.eq(status),
            ctl_o.flags.eq(Mux(status == ctl.Status.OK, ctl.Flags.RESPONSE,
                               ctl.Flags.RESPONSE | ctl.Flags.ERROR)),
        ]
        return eth_o, ip_o, udp_o, ctl_o

    @staticmethod
    def _ip_sum(ip_o):
        """RFC 1071's sum of the header's 16-bit words, its checksum field zero."""
        raw = ip_o.as_value()
        return sum(raw[i:i + 16] for i in range(0, IPV4.bits, 16))

    @staticmethod
    def _reply(m, headers, ip_sum):
        """The response's header bytes: ``headers`` with the IPv4 checksum of
        ``ip_sum`` folded twice."""
        eth_o, ip_o, udp_o, ctl_o = headers
        c1, c2 = Signal(17), Signal(17)
        m.d.comb += [c1.eq(ip_sum[:16] + ip_sum[16:]), c2.eq(c1[:16] + c1[16:])]
        ip_f = Signal(header_layout(IPV4))
        m.d.comb += [ip_f.eq(ip_o), ip_f.chksum.eq(~c2[:16])]
        return Cat(to_wire(eth_o), to_wire(ip_f), to_wire(udp_o), to_wire(ctl_o))
