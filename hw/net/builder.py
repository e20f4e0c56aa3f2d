"""RoCEv2 transmit builder: header record + payload stream in, whole frame out.

In: ``hdr`` (one :data:`~fpgaccl.hw.net.record.RECORD` per frame) and, when
``payload_len`` is not zero, exactly ``ceil(payload_len / N)`` payload beats on ``i``
with payload byte 0 at beat byte 0 (``first``/``last``/``keep`` of those beats are not
needed: the length in the record rules). Out (``o``): the Ethernet II / IPv4 / UDP /
BTH (+RETH/AETH/ImmDt) frame, payload shifted behind the header, BTH pad bytes, ICRC.

The builder fills in what depends on the payload or is computed: IPv4 total length and
header checksum, UDP length and checksum (0, as RoCEv2 sends), ``bth.padcount`` and the
ICRC; every other field comes from the record, and the extended headers follow the
opcode (:func:`fpgaccl.proto.extension_headers`), as :func:`fpgaccl.proto.build_frame`.

Pipeline: a prepare stage computes the next frame's header bytes and lengths (IPv4
checksum included) while the current frame streams, so back-to-back frames leave with no
gap; the stream stage emits one beat per cycle (header bytes, payload realigned by the
header length mod N, pad, ICRC), updating the ICRC over each beat as it goes, and writes
into a small output FIFO whose registered level is the only back-pressure it looks at.
"""

from __future__ import annotations

from amaranth.hdl import Cat, Module, Mux, Signal, signed
from amaranth.lib import stream, wiring
from amaranth.lib.wiring import In, Out
from amaranth.utils import exact_log2

from fpgaccl.proto import BTH, IPV4, UDP, extension_headers
from fpgaccl.proto.headers import ICRC_BYTES
from fpgaccl.proto.opcodes import SUPPORTED_OPCODES

from ..stream.beat import beat_stream
from ..stream.fifo import BeatFIFO
from . import crc as crcmod
from .layouts import header_layout, to_wire
from .parser import _bytes_to_bits, _thermo
from .record import BASE_HDR_BYTES, HEADER_LENGTHS, MAX_EXT_BYTES, MAX_HDR_BYTES, RECORD, OpcodeInfo

_FIXED_TRAILER = IPV4.size + UDP.size + BTH.size + ICRC_BYTES
_RECORD_KEY = {"RETH": "reth", "AETH": "aeth", "ImmDt": "immdt"}


class RoceBuilder(wiring.Component):
    def __init__(self, width: int, *, out_depth: int = 8) -> None:
        self.width = width
        self.nbytes = width // 8
        self.out_depth = out_depth
        super().__init__({
            "hdr": In(stream.Signature(RECORD)),
            "i": In(beat_stream(width)),
            "o": Out(beat_stream(width)),
        })

    def elaborate(self, platform) -> Module:
        m = Module()
        N, W = self.nbytes, self.width
        logn = exact_log2(N)
        m.submodules.out = of = BeatFIFO(W, self.out_depth)
        wiring.connect(m, of.o, wiring.flipped(self.o))

        # --- prepare: header bytes and lengths of the next frame --------------------------
        rec = self.hdr.payload
        op = OpcodeInfo(m, rec.bth.opcode, "prep")
        plen = rec.payload_len
        pad = Signal(2)
        m.d.comb += pad.eq(-plen)
        ip_len = Signal(16)
        m.d.comb += ip_len.eq(_FIXED_TRAILER + op.ext_len + plen + pad)
        ipv = Signal(header_layout(IPV4))
        m.d.comb += [ipv.eq(rec.ip), ipv.len.eq(ip_len), ipv.chksum.eq(0)]
        raw = ipv.as_value()
        csum = Signal(20)
        m.d.comb += csum.eq(sum(raw[i:i + 16] for i in range(0, IPV4.bits, 16)))
        c1, c2 = Signal(17), Signal(17)
        m.d.comb += [c1.eq(csum[:16] + csum[16:]), c2.eq(c1[:16] + c1[16:])]
        ipf = Signal(header_layout(IPV4))
        m.d.comb += [ipf.eq(ipv), ipf.chksum.eq(~c2[:16])]
        udpv = Signal(header_layout(UDP))
        m.d.comb += [udpv.eq(rec.udp), udpv.len.eq(ip_len - IPV4.size), udpv.chksum.eq(0)]
        bthv = Signal(header_layout(BTH))
        m.d.comb += [bthv.eq(rec.bth), bthv.padcount.eq(pad)]
        ext = Signal(MAX_EXT_BYTES * 8)
        with m.Switch(rec.bth.opcode):
            for code in sorted(SUPPORTED_OPCODES):
                hdrs = extension_headers(code)
                if hdrs:
                    with m.Case(code):
                        m.d.comb += ext.eq(Cat(*(to_wire(rec[_RECORD_KEY[h.name]])
                                                 for h in hdrs)))
        hbytes = Cat(to_wire(rec.eth), to_wire(ipf), to_wire(udpv), to_wire(bthv), ext)
        assert len(hbytes) == MAX_HDR_BYTES * 8

        nxt_valid = Signal()
        nxt_hdr = Signal(MAX_HDR_BYTES * 8)
        nxt_h = Signal(range(MAX_HDR_BYTES + 1))
        nxt_p = Signal(16)
        nxt_l = Signal(18)
        m.d.comb += self.hdr.ready.eq(~nxt_valid)
        with m.If(self.hdr.valid & ~nxt_valid):
            m.d.sync += [nxt_valid.eq(1), nxt_hdr.eq(hbytes),
                         nxt_h.eq(BASE_HDR_BYTES + op.ext_len), nxt_p.eq(plen),
                         nxt_l.eq(14 + ip_len)]

        # --- stream: one frame beat per cycle ----------------------------------------------
        active = Signal()
        cur_hdr = Signal.like(nxt_hdr)
        hlen = Signal.like(nxt_h)
        pl = Signal.like(nxt_p)
        flen = Signal.like(nxt_l)
        k = Signal(18 - logn + 1)
        base = Signal(19)
        m.d.comb += base.eq(k << logn)
        carry = Signal(W)
        pc = Signal(17)
        n_in = Signal(17)
        m.d.comb += n_in.eq((pl + N - 1) >> logn)
        q = hlen >> logn
        s = hlen[:logn]

        room = Signal()
        m.d.comb += room.eq(of.level < self.out_depth - 1)
        need = Signal()
        m.d.comb += need.eq(active & (k >= q) & (pc < n_in))
        adv = Signal()
        m.d.comb += [adv.eq(active & room & (~need | self.i.valid)),
                     self.i.ready.eq(active & room & need)]

        cur_in = Signal(W)
        m.d.comb += cur_in.eq(self.i.payload.data)
        pair = Cat(carry, cur_in)
        window = Signal(W)
        with m.Switch(s):
            for sv in sorted({h % N for h in HEADER_LENGTHS}):
                with m.Case(sv):
                    m.d.comb += window.eq(pair[(N - sv) * 8:(2 * N - sv) * 8])
        hbeat = Signal(W)
        with m.Switch(k):
            for kk in range(-(-MAX_HDR_BYTES // N)):
                lo, hi = kk * N, min((kk + 1) * N, MAX_HDR_BYTES)
                with m.Case(kk):
                    m.d.comb += hbeat.eq(cur_hdr[lo * 8:hi * 8])
        hrem, prem, krem = (Signal(signed(21), name=n) for n in ("hrem", "prem", "krem"))
        m.d.comb += [hrem.eq(hlen - base), prem.eq(hlen + pl - base), krem.eq(flen - base)]
        hmask = _thermo(m, hrem, N, "hmask")
        pmask = _thermo(m, prem, N, "pmask")
        kmask = _thermo(m, krem, N, "kmask")
        body = Signal(W)
        m.d.comb += body.eq((hbeat & _bytes_to_bits(hmask)) |
                            (window & _bytes_to_bits(pmask & ~hmask)))

        # ICRC over frame bytes [0, L - 4), inserted at [L - 4, L).
        rem = Signal(signed(21))
        m.d.comb += rem.eq(flen - ICRC_BYTES - base)
        fixed = Signal(W)
        m.d.comb += fixed.eq(body)
        with m.Switch(k):
            for kk, (and_m, or_m) in enumerate(crcmod.icrc_beat_masks(N)):
                with m.Case(kk):
                    m.d.comb += fixed.eq((body & and_m) | or_m)
        masked = Signal(W)
        m.d.comb += masked.eq(fixed & _bytes_to_bits(_thermo(m, rem, N, "crc_keep")))
        crc = Signal(32)
        crc_in = Signal(32)
        m.d.comb += crc_in.eq(Mux(k == 0, 0, crc))
        upd = Signal(32)
        m.d.comb += upd.eq(crcmod.crc_update(crc_in, masked))
        ends_here = Signal()
        m.d.comb += ends_here.eq((rem > 0) & (rem <= N))
        zeros = Signal(logn)
        m.d.comb += zeros.eq(N - rem)
        final_now = Signal(32)
        m.d.comb += final_now.eq(~crcmod.crc_unzero(m, upd, zeros, "tx_unzero"))
        icrc_reg = Signal(32)
        icrc = Signal(32)
        m.d.comb += icrc.eq(Mux(ends_here, final_now, icrc_reg))
        # The ICRC slot bytes of ``body`` are zero: OR the ICRC in, shifted to frame byte
        # L - 4 (it may have started in the previous beat: rem in -3..-1).
        lead = 8 * (ICRC_BYTES - 1)
        shifted = Signal(W + lead)
        at = Signal(range(N + ICRC_BYTES))
        m.d.comb += at.eq(rem + ICRC_BYTES - 1)
        with m.If((rem > -ICRC_BYTES) & (rem < N)):
            m.d.comb += shifted.eq(icrc << (at * 8))
        out = Signal(W)
        m.d.comb += out.eq(body | shifted[lead:])
        last = Signal()
        m.d.comb += last.eq(krem <= N)

        m.d.comb += [
            of.i.valid.eq(adv),
            of.i.payload.data.eq(out),
            of.i.payload.keep.eq(kmask),
            of.i.payload.first.eq(k == 0),
            of.i.payload.last.eq(last),
        ]

        def load():
            return [active.eq(1), cur_hdr.eq(nxt_hdr), hlen.eq(nxt_h), pl.eq(nxt_p),
                    flen.eq(nxt_l), k.eq(0), pc.eq(0), nxt_valid.eq(0)]

        with m.If(adv):
            m.d.sync += k.eq(k + 1)
            with m.If(rem > 0):
                m.d.sync += crc.eq(upd)
            with m.If(ends_here):
                m.d.sync += icrc_reg.eq(final_now)
            with m.If(need):
                m.d.sync += [carry.eq(self.i.payload.data), pc.eq(pc + 1)]
            with m.If(last):
                m.d.sync += active.eq(0)
                with m.If(nxt_valid):
                    m.d.sync += load()
        with m.If(~active & nxt_valid):
            m.d.sync += load()
        return m

