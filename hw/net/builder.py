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
header length mod N, pad; payload beats come through a skid buffer, so whether one is
there is a register), its byte masks read from bytes-left registers; three
registers follow it (ICRC update, un-zero, ICRC insertion) before a small output FIFO
whose registered level is the only back-pressure it looks at.
"""

from __future__ import annotations

from amaranth.hdl import Cat, Module, Mux, Signal, signed
from amaranth.lib import stream, wiring
from amaranth.lib.wiring import In, Out
from amaranth.utils import exact_log2

from fpgaccl.proto import BTH, IPV4, UDP, extension_headers
from fpgaccl.proto.headers import ICRC_BYTES
from fpgaccl.proto.opcodes import SUPPORTED_OPCODES

from ..stream.beat import beat_layout, beat_stream
from ..stream.fifo import BeatFIFO
from ..stream.skid import SkidBuffer
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
        # Payload beats enter through a register slice: whether one is here (which
        # decides whether the stream stage moves) is then a register, not the end of
        # the memory read path behind the requester.
        m.submodules.pin = pin = SkidBuffer(beat_layout(W))
        wiring.connect(m, wiring.flipped(self.i), pin.i)
        pi = pin.o

        # --- prepare: header bytes and lengths of the next frame --------------------------
        # Two registers deep: the record is taken with its IP length and the sum of the
        # IPv4 header words other than length and checksum; the next stage adds the
        # length in, folds, and lays out the header bytes.
        rin = self.hdr.payload
        op0 = OpcodeInfo(m, rin.bth.opcode, "prep0")
        pad0 = Signal(2)
        m.d.comb += pad0.eq(-rin.payload_len)
        ipv0 = Signal(header_layout(IPV4))
        m.d.comb += [ipv0.eq(rin.ip), ipv0.len.eq(0), ipv0.chksum.eq(0)]
        raw0 = ipv0.as_value()
        rec = Signal(RECORD)
        rec_v = Signal()
        ip_len = Signal(16)
        part = Signal(20)
        m.d.comb += self.hdr.ready.eq(~rec_v)
        with m.If(self.hdr.valid & ~rec_v):
            m.d.sync += [rec_v.eq(1), rec.eq(rin),
                         ip_len.eq(_FIXED_TRAILER + op0.ext_len + rin.payload_len + pad0),
                         part.eq(sum(raw0[i:i + 16] for i in range(0, IPV4.bits, 16)))]

        op = OpcodeInfo(m, rec.bth.opcode, "prep")
        plen = rec.payload_len
        pad = Signal(2)
        m.d.comb += pad.eq(-plen)
        ipv = Signal(header_layout(IPV4))
        m.d.comb += [ipv.eq(rec.ip), ipv.len.eq(ip_len), ipv.chksum.eq(0)]
        csum = Signal(20)
        m.d.comb += csum.eq(part + ip_len)
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
        nxt_pe = Signal(18)     # header + payload bytes: where the pad starts
        nxt_c = Signal(18)      # frame bytes before the ICRC
        nxt_nin = Signal(17)    # payload beats to take
        with m.If(rec_v & ~nxt_valid):
            m.d.sync += [rec_v.eq(0), nxt_valid.eq(1), nxt_hdr.eq(hbytes),
                         nxt_h.eq(BASE_HDR_BYTES + op.ext_len), nxt_p.eq(plen),
                         nxt_l.eq(14 + ip_len), nxt_pe.eq(BASE_HDR_BYTES + op.ext_len + plen),
                         nxt_c.eq(14 + ip_len - ICRC_BYTES), nxt_nin.eq((plen + N - 1) >> logn)]

        # --- stream: one frame beat per cycle ----------------------------------------------
        # Every per-beat length test reads registers: the bytes left of the header, of
        # header + payload, of the frame and of the ICRC region count down by N per beat
        # (loaded from the prepare stage), each with its byte mask and flags for the next
        # beat computed when it is counted down. A beat then goes through three
        # registers before the output FIFO: P1 runs the ICRC update over it, P2 un-zeroes
        # the CRC once the region's last beat is in it, P3 ORs the ICRC into the beat(s)
        # holding its slot. The whole pipeline moves together (``go``) when the FIFO has
        # room, bubbles included, so the ICRC is ready before its first beat leaves.
        active = Signal()
        cur_hdr = Signal.like(nxt_hdr)
        hlen = Signal.like(nxt_h)
        nin = Signal.like(nxt_nin)
        k = Signal(18 - logn + 1)
        carry = Signal(W)
        pc = Signal(17)
        q = hlen >> logn
        s = hlen[:logn]

        # `go` is a flop, a cycle behind the level it tests: the level rises by at most
        # one a cycle, so a push it allows still finds room (the last entry, which the
        # live test kept free, is now the margin). Read live, the level's compare began
        # the routed path into the byte masks (kmask, 10.2 ns at a129e4e).
        go = Signal()
        m.d.sync += go.eq(of.level < self.out_depth - 1)
        # Whether this beat takes a payload beat (the header is out: k >= q; payload
        # beats are left: pc < nin) is kept in two flags, set for the next beat when
        # k/pc count, so the handshake reads registers only.
        past_hdr = Signal()
        more_in = Signal()
        need = Signal()
        m.d.comb += need.eq(active & past_hdr & more_in)
        prod = Signal()
        m.d.comb += [prod.eq(go & active & (~need | pi.valid)),
                     pi.ready.eq(go & active & need)]
        loading = Signal()      # the next frame's lengths and header come in

        counted = []

        def counter(name: str, load_value):
            """The two candidates for a bytes-left count at the next beat: loaded (the
            next frame's value) and counted down, so that derived values can be muxed
            late. The counted-down one is a register, N below the current count, so
            what is derived from it starts at a flop rather than after a subtraction
            (the count itself is then not needed)."""
            down = Signal(signed(21), name=f"{name}_down", init=-N)
            load = Signal(signed(21), name=f"{name}_load")
            m.d.comb += load.eq(load_value)
            counted.append((load, down))
            return load, down

        h_ld, h_dn = counter("h", nxt_h)
        p_ld, p_dn = counter("p", nxt_pe)
        k_ld, k_dn = counter("k", nxt_l)
        c_ld, c_dn = counter("c", nxt_c)
        hmask, pmask, kmask, cmask = (Signal(N, name=f"{n}mask") for n in "hpkc")
        last_r = Signal()
        c_on, c_ends, ins_on = Signal(), Signal(), Signal()
        zeros = Signal(logn)
        at = Signal(range(N + ICRC_BYTES))
        m.d.comb += loading.eq(nxt_valid & (~active | (prod & last_r)))

        def late(f, ld, dn, name):
            """``f`` of the next value, computed for both candidates beside ``loading``
            (a long path: the output FIFO's level, the payload handshake) and picked last."""
            a, b = f(ld, f"{name}_l"), f(dn, f"{name}_d")
            return Mux(loading, a, b)

        def thermo(v, name):
            return _thermo(m, v, N, name)

        with m.If(loading | prod):
            m.d.sync += [down.eq(Mux(loading, ld - N, down - N)) for ld, down in counted]
            m.d.sync += [
                hmask.eq(late(thermo, h_ld, h_dn, "hmask")),
                pmask.eq(late(thermo, p_ld, p_dn, "pmask")),
                kmask.eq(late(thermo, k_ld, k_dn, "kmask")),
                cmask.eq(late(thermo, c_ld, c_dn, "cmask")),
                last_r.eq(late(lambda v, _: v <= N, k_ld, k_dn, "last")),
                c_on.eq(late(lambda v, _: v > 0, c_ld, c_dn, "c_on")),
                c_ends.eq(late(lambda v, _: (v > 0) & (v <= N), c_ld, c_dn, "c_ends")),
                zeros.eq(late(lambda v, _: (N - v)[:logn], c_ld, c_dn, "zeros")),
                # The ICRC may start in the previous beat: c in -3..-1.
                ins_on.eq(late(lambda v, _: (v > -ICRC_BYTES) & (v < N), c_ld, c_dn, "ins")),
                at.eq(late(lambda v, _: (v + ICRC_BYTES - 1)[:len(at)], c_ld, c_dn, "at")),
            ]

        cur_in = Signal(W)
        m.d.comb += cur_in.eq(pi.payload.data)
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
        body = Signal(W)
        m.d.comb += body.eq((hbeat & _bytes_to_bits(hmask)) |
                            (window & _bytes_to_bits(pmask & ~hmask)))
        n_fixed = len(crcmod.icrc_beat_masks(N))
        k_fixed = Signal(range(n_fixed + 1))
        m.d.comb += k_fixed.eq(Mux(k < n_fixed, k, n_fixed))

        # P1: the ICRC update over frame bytes [0, L - 4).
        p1 = dict(valid=Signal(), body=Signal(W), keep=Signal(N), first=Signal(),
                  last=Signal(), kf=Signal.like(k_fixed), cmask=Signal(N), c_on=Signal(),
                  c_ends=Signal(), zeros=Signal(logn), ins_on=Signal(), at=Signal.like(at))
        with m.If(go):
            m.d.sync += [p1["valid"].eq(prod), p1["body"].eq(body), p1["keep"].eq(kmask),
                         p1["first"].eq(k == 0), p1["last"].eq(last_r),
                         p1["kf"].eq(k_fixed), p1["cmask"].eq(cmask), p1["c_on"].eq(c_on),
                         p1["c_ends"].eq(c_ends), p1["zeros"].eq(zeros),
                         p1["ins_on"].eq(ins_on), p1["at"].eq(at)]
        fixed = Signal(W)
        m.d.comb += fixed.eq(p1["body"])
        with m.Switch(p1["kf"]):
            for kk, (and_m, or_m) in enumerate(crcmod.icrc_beat_masks(N)):
                with m.Case(kk):
                    m.d.comb += fixed.eq((p1["body"] & and_m) | or_m)
        masked = Signal(W)
        m.d.comb += masked.eq(fixed & _bytes_to_bits(p1["cmask"]))
        crc = Signal(32)
        zc = Signal(logn)
        crc_in = Signal(32)
        m.d.comb += crc_in.eq(Mux(p1["first"], 0, crc))
        with m.If(go & p1["valid"] & p1["c_on"]):
            m.d.sync += crc.eq(crcmod.crc_update(crc_in, masked))
        with m.If(go & p1["valid"] & p1["c_ends"]):
            m.d.sync += zc.eq(p1["zeros"])

        # P2: the region's last beat is here, so crc and zc are final: un-zero them.
        # (The next frame's first beat may update crc in this same cycle; icrc keeps the
        # value until the next frame's region ends.)
        p2 = {n: Signal.like(v, name=f"p2_{n}") for n, v in p1.items()
              if n in ("valid", "body", "keep", "first", "last", "c_ends", "ins_on", "at")}
        with m.If(go):
            m.d.sync += [v.eq(p1[n]) for n, v in p2.items()]
        icrc = Signal(32)
        with m.If(go & p2["valid"] & p2["c_ends"]):
            m.d.sync += icrc.eq(~crcmod.crc_unzero(m, crc, zc, "tx_unzero", group=3))

        # P3: the ICRC slot bytes of the body are zero: OR the ICRC in, shifted to frame
        # byte L - 4 (it may have started in the previous beat).
        p3 = {n: Signal.like(v, name=f"p3_{n}") for n, v in p2.items() if n != "c_ends"}
        with m.If(go):
            m.d.sync += [v.eq(p2[n]) for n, v in p3.items()]
        lead = 8 * (ICRC_BYTES - 1)
        shifted = Signal(W + lead)
        with m.If(p3["ins_on"]):
            m.d.comb += shifted.eq(icrc << (p3["at"] * 8))
        m.d.comb += [
            of.i.valid.eq(go & p3["valid"]),
            of.i.payload.data.eq(p3["body"] | shifted[lead:]),
            of.i.payload.keep.eq(p3["keep"]),
            of.i.payload.first.eq(p3["first"]),
            of.i.payload.last.eq(p3["last"]),
        ]

        with m.If(prod):
            m.d.sync += [k.eq(k + 1), past_hdr.eq(k + 1 >= q)]
            with m.If(need):
                m.d.sync += [carry.eq(pi.payload.data), pc.eq(pc + 1), more_in.eq(pc + 1 < nin)]
            with m.If(last_r):
                m.d.sync += active.eq(0)
        with m.If(loading):
            m.d.sync += [active.eq(1), cur_hdr.eq(nxt_hdr), hlen.eq(nxt_h), nin.eq(nxt_nin),
                         k.eq(0), pc.eq(0), nxt_valid.eq(0),
                         past_hdr.eq((nxt_h >> logn) == 0), more_in.eq(nxt_nin != 0)]
        return m
