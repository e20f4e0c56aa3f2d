"""RoCEv2 receive parser: Ethernet II / IPv4 / UDP 4791 / BTH (+RETH/AETH/ImmDt) / ICRC.

In: a frame stream (``i``), one beat per cycle, ``last`` closing each frame (``first`` is
not needed: the frame after a ``last`` starts a new one). Out: per accepted frame one
header record on ``hdr`` (:data:`~fpgaccl.hw.net.record.RECORD`) and, when the payload
is not empty, one payload packet on ``o`` realigned so payload byte 0 is beat byte 0,
``keep`` covering exactly the payload (BTH pad, ICRC and Ethernet padding removed).

Store and forward (the choice issue 4 asks to document): a frame's validity is only known
at its end (ICRC, frame length), and malformed packets must never reach memory, so the
realigned payload is written into a :class:`~fpgaccl.hw.stream.commit_fifo.CommitFIFO`
and only committed (made readable) together with the header record once every check
passed; a dropped frame is rewound and leaves no trace downstream. The price is latency:
the first payload beat leaves after the frame's last beat came in. The checks are those
of :func:`fpgaccl.proto.parse_frame`, in its order, so a dropped frame is counted under
the same :class:`~fpgaccl.proto.DropReason` (saturating counters on ``drops``). A frame
longer than the FIFO holds is dropped and counted on ``oversize`` (DropReason.OVERSIZE in the node).

Pipeline: the cycle a beat is taken, its header bytes are captured, the ICRC register
is updated and (after the header) a realigned payload beat is written. The cycle after a
frame's ``last`` (``eof``) evaluates every check from registers, writes the payload's
remainder if it is still in the shifter, and commits or rewinds; it overlaps the next
frame's first beat, which never writes payload, so back-to-back frames run at one beat
per cycle with no gap.
"""

from __future__ import annotations

from amaranth.hdl import Cat, Const, Module, Mux, Signal, signed
from amaranth.lib import data, fifo, stream, wiring
from amaranth.lib.wiring import In, Out
from amaranth.utils import ceil_log2, exact_log2

from fpgaccl.proto import AETH, BTH, ETH, IMMDT, IPV4, RETH, UDP, DropReason
from fpgaccl.proto.drops import DROP_COUNTER_BITS
from fpgaccl.proto.headers import ICRC_BYTES
from fpgaccl.proto.opcodes import ETHERTYPE_IPV4, IMMDT_OPCODES, IP_PROTO_UDP, ROCEV2_UDP_PORT

from ..stream.beat import beat_stream
from ..stream.commit_fifo import CommitFIFO
from . import crc as crcmod
from .layouts import from_wire
from .record import (
    BASE_HDR_BYTES,
    HEADER_LENGTHS,
    MAX_HDR_BYTES,
    MIN_FRAME_BYTES,
    OFFSETS,
    RECORD,
    OpcodeInfo,
    ext_offset,
)

PARSER_DROPS = (DropReason.TRUNCATED, DropReason.BAD_ETHERTYPE, DropReason.IPV4_VERSION,
                DropReason.IPV4_OPTIONS, DropReason.IPV4_FRAGMENT, DropReason.IPV4_CHECKSUM,
                DropReason.IPV4_PROTOCOL, DropReason.IPV4_LENGTH, DropReason.UDP_PORT,
                DropReason.UDP_LENGTH, DropReason.BTH_VERSION, DropReason.UNKNOWN_OPCODE,
                DropReason.BAD_ICRC)
"""The reasons this parser can give; ``drops[r]`` counts reason ``r``."""
N_DROP_COUNTERS = max(PARSER_DROPS) + 1

# Lengths the checks use, from the tables.
_L4 = IPV4.size + UDP.size
_FIXED_TRAILER = IPV4.size + UDP.size + BTH.size + ICRC_BYTES  # IP length minus ext+payload+pad


def _pow2_at_least(n: int) -> int:
    return 1 << ceil_log2(max(n, 4))


def _thermo(m: Module, count, nbytes: int, name: str) -> Signal:
    """Byte mask with the low ``clamp(count, 0, nbytes)`` bits set."""
    n = Signal(range(nbytes + 1), name=f"{name}_n")
    m.d.comb += n.eq(Mux(count >= nbytes, nbytes, Mux(count <= 0, 0, count)))
    mask = Signal(nbytes, name=name)
    m.d.comb += mask.eq((Const(1, nbytes + 1) << n) - 1)
    return mask


def _bytes_to_bits(mask: Signal) -> Signal:
    return Cat(*(b.replicate(8) for b in mask))


def sat_inc(m: Module, counter: Signal) -> None:
    with m.If(~counter.all()):
        m.d.sync += counter.eq(counter + 1)


class RoceParser(wiring.Component):
    """See the module docstring. ``max_payload`` sizes the store-and-forward FIFO (two
    frames of that payload, so one drains while the next fills)."""

    def __init__(self, width: int, *, max_payload: int = 4096, hdr_depth: int = 16) -> None:
        self.width = width
        self.nbytes = width // 8
        max_frame = MAX_HDR_BYTES + max_payload + 3 + ICRC_BYTES
        self.depth = _pow2_at_least(2 * -(-max_frame // self.nbytes) + 2)
        self.hdr_depth = hdr_depth
        super().__init__({
            "i": In(beat_stream(width)),
            "hdr": Out(stream.Signature(RECORD)),
            "o": Out(beat_stream(width)),
            "drops": Out(data.ArrayLayout(DROP_COUNTER_BITS, N_DROP_COUNTERS)),
            "oversize": Out(DROP_COUNTER_BITS),
            "accepted": Out(DROP_COUNTER_BITS),
        })

    def elaborate(self, platform) -> Module:
        m = Module()
        N = self.nbytes
        W = self.width
        logn = exact_log2(N)

        m.submodules.fifo = pf = CommitFIFO(W, self.depth)
        m.submodules.hfifo = hf = fifo.SyncFIFOBuffered(width=RECORD.size, depth=self.hdr_depth)
        wiring.connect(m, wiring.flipped(self.o), pf.o)

        beat = self.i.payload
        take = Signal()
        m.d.comb += take.eq(self.i.valid & self.i.ready)

        beat_idx = Signal(18)
        base = Signal(18 + logn)
        m.d.comb += base.eq(beat_idx << logn)
        with m.If(take):
            m.d.sync += beat_idx.eq(Mux(beat.last, 0, beat_idx + 1))

        # --- header capture (registered) --------------------------------------------
        hdr = Signal(MAX_HDR_BYTES * 8)
        for k in range(-(-MAX_HDR_BYTES // N)):
            lo, hi = k * N, min((k + 1) * N, MAX_HDR_BYTES)
            with m.If(take & (beat_idx == k)):
                m.d.sync += hdr[lo * 8:hi * 8].eq(beat.data[:(hi - lo) * 8])

        def view(header, offset=None):
            off = OFFSETS[header.name] if offset is None else offset
            return from_wire(header, hdr[off * 8:(off + header.size) * 8])

        eth, ip, udp, bth = view(ETH), view(IPV4), view(UDP), view(BTH)
        op = OpcodeInfo(m, bth.opcode)

        # --- ICRC: CRC over frame bytes [0, 14 + ip.len), compared with the residue ------
        len_pos = OFFSETS[IPV4.name] + IPV4.offset("len") // 8
        len_beat, len_off = divmod(len_pos, N)
        ip_len_now = Signal(16)
        m.d.comb += ip_len_now.eq(Mux(beat_idx == len_beat,
                                      Cat(beat.data[(len_off + 1) * 8:(len_off + 2) * 8],
                                          beat.data[len_off * 8:(len_off + 1) * 8]),
                                      ip.len))
        crc = Signal(32)
        crc_z = Signal(logn)
        rem = Signal(signed(20 + logn))
        m.d.comb += rem.eq(ETH.size + ip_len_now - base)
        fixed = Signal(W)
        m.d.comb += fixed.eq(beat.data)
        with m.Switch(beat_idx):
            for k, (and_m, or_m) in enumerate(crcmod.icrc_beat_masks(N)):
                with m.Case(k):
                    m.d.comb += fixed.eq((beat.data & and_m) | or_m)
        # Before the beat carrying ip.len the region is open whatever the stale length says.
        early = Signal()
        m.d.comb += early.eq(beat_idx < len_beat) if len_beat else early.eq(0)
        in_region = _thermo(m, Mux(early, N, rem), N, "crc_keep")
        masked = Signal(W)
        m.d.comb += masked.eq(fixed & _bytes_to_bits(in_region))
        crc_in = Signal(32)
        m.d.comb += crc_in.eq(Mux(beat_idx == 0, 0, crc))
        with m.If(take & (early | (rem > 0))):
            m.d.sync += [crc.eq(crcmod.crc_update(crc_in, masked)),
                         crc_z.eq(Mux(~early & (rem < N), N - rem, 0))]

        # --- realigner: payload byte 0 to beat byte 0 ----------------------------------
        hlen = Signal(range(MAX_HDR_BYTES + 1))
        m.d.comb += hlen.eq(BASE_HDR_BYTES + op.ext_len)
        q = hlen >> logn
        s = hlen[:logn] if logn else Const(0)
        plen = Signal(signed(19))
        m.d.comb += plen.eq(ip.len - _FIXED_TRAILER - op.ext_len - bth.padcount)
        written = Signal(18)
        left = Signal(signed(20))
        m.d.comb += left.eq(plen - written)
        prev = Signal(W)
        eof = Signal()
        cur = Mux(eof, 0, beat.data)
        window = Signal(W)
        pair = Cat(prev, cur)
        with m.Switch(s):
            for sv in sorted({h % N for h in HEADER_LENGTHS}):
                with m.Case(sv):
                    m.d.comb += window.eq(pair[sv * 8:sv * 8 + W])
        wkeep = _thermo(m, left, N, "wkeep")

        ovf = Signal()
        want = Signal()
        m.d.comb += want.eq(take & (beat_idx > q) & (left > 0) & ~ovf)
        full = Signal()
        m.d.comb += full.eq(pf.pending >= self.depth - 2)
        write = Signal()
        m.d.comb += write.eq(want & ~full)
        with m.If(want & full):
            m.d.sync += ovf.eq(1)
        with m.If(write):
            m.d.sync += written.eq(written + N)
        with m.If(take):
            m.d.sync += prev.eq(beat.data)

        # --- end of frame: the checks, in parse_frame's order ---------------------------
        frame_len = Signal(18 + logn)
        with m.If(take & beat.last):
            m.d.sync += frame_len.eq(base + sum(beat.keep[i] for i in range(N)))
        m.d.sync += eof.eq(take & beat.last)

        cs = Signal(20)
        ip_raw = hdr[OFFSETS[IPV4.name] * 8:(OFFSETS[IPV4.name] + IPV4.size) * 8]
        m.d.comb += cs.eq(sum(Cat(ip_raw[i + 8:i + 16], ip_raw[i:i + 8])
                              for i in range(0, IPV4.size * 8, 16)))
        cs1 = Signal(17)
        cs2 = Signal(17)
        m.d.comb += [cs1.eq(cs[:16] + cs[16:]), cs2.eq(cs1[:16] + cs1[16:])]
        transport = Signal(signed(18))
        m.d.comb += transport.eq(ip.len - _L4)
        icrc_final = Signal(32)
        m.d.comb += icrc_final.eq(crcmod.crc_unzero(m, crc, crc_z))

        checks = [
            (DropReason.TRUNCATED, frame_len < MIN_FRAME_BYTES),
            (DropReason.BAD_ETHERTYPE, eth.type != ETHERTYPE_IPV4),
            (DropReason.IPV4_VERSION, ip.version != 4),
            (DropReason.IPV4_OPTIONS, ip.ihl != IPV4.size // 4),
            (DropReason.IPV4_FRAGMENT, ip.flags[0] | (ip.frag != 0)),
            (DropReason.IPV4_CHECKSUM, cs2[:16] != 0xFFFF),
            (DropReason.IPV4_PROTOCOL, ip.proto != IP_PROTO_UDP),
            (DropReason.IPV4_LENGTH, (ip.len < _L4) | (ETH.size + ip.len > frame_len)),
            (DropReason.UDP_PORT, udp.dport != ROCEV2_UDP_PORT),
            (DropReason.UDP_LENGTH, udp.len != (ip.len - IPV4.size)[:16]),
            (DropReason.TRUNCATED, transport < BTH.size + ICRC_BYTES),
            (DropReason.BTH_VERSION, bth.version != 0),
            (DropReason.UNKNOWN_OPCODE, ~op.supported),
            (DropReason.TRUNCATED,
             transport < BTH.size + op.ext_len + ICRC_BYTES + bth.padcount),
            (DropReason.BAD_ICRC, icrc_final != crcmod.RESIDUE),
        ]
        assert {r for r, _ in checks} == set(PARSER_DROPS)
        bad = Signal()
        reason = Signal(range(N_DROP_COUNTERS))
        with m.If(ovf):
            m.d.comb += bad.eq(1)
        for i, (r, cond) in enumerate(checks):
            with (m.If if i == 0 else m.Elif)(cond):
                m.d.comb += [bad.eq(1), reason.eq(r)]

        good = Signal()
        flush = Signal()
        m.d.comb += [good.eq(eof & ~bad), flush.eq(good & (left > 0))]
        with m.If(eof):
            with m.If(ovf):
                sat_inc(m, self.oversize)
            with m.Elif(bad):
                for r in PARSER_DROPS:
                    with m.If(reason == r):
                        sat_inc(m, self.drops[r])
            with m.Else():
                sat_inc(m, self.accepted)

        m.d.comb += [
            pf.w_en.eq(write | flush),
            pf.w_data.data.eq(window),
            pf.w_data.keep.eq(wkeep),
            pf.w_data.first.eq(written == 0),
            pf.w_data.last.eq(left <= N),
            pf.commit.eq(good),
            pf.rewind.eq(eof & bad),
        ]

        # Per-frame state restarts on a frame's first beat (after eof has used it).
        with m.If(take & (beat_idx == 0)):
            m.d.sync += [written.eq(0), ovf.eq(0)]

        # --- header record -------------------------------------------------------------
        rec = Signal(RECORD)
        imm_offsets = sorted({ext_offset(o, IMMDT) for o in IMMDT_OPCODES})
        assert len(imm_offsets) == 2 and imm_offsets[0] == BASE_HDR_BYTES
        m.d.comb += [
            rec.eth.eq(eth), rec.ip.eq(ip), rec.udp.eq(udp), rec.bth.eq(bth),
            rec.reth.eq(Mux(op.has_reth, view(RETH, BASE_HDR_BYTES).as_value(), 0)),
            rec.aeth.eq(Mux(op.has_aeth, view(AETH, BASE_HDR_BYTES).as_value(), 0)),
            rec.immdt.eq(Mux(op.has_immdt,
                             Mux(op.has_reth, view(IMMDT, imm_offsets[1]).as_value(),
                                 view(IMMDT, imm_offsets[0]).as_value()), 0)),
            rec.has_reth.eq(op.has_reth), rec.has_aeth.eq(op.has_aeth),
            rec.has_immdt.eq(op.has_immdt),
            rec.payload_len.eq(plen),
            hf.w_data.eq(rec),
            hf.w_en.eq(good),
            self.hdr.payload.eq(hf.r_data),
            self.hdr.valid.eq(hf.r_rdy),
            hf.r_en.eq(self.hdr.ready),
        ]

        # Input ready from registers only: room for a payload beat and a pending flush
        # (or the frame already overflowed), and for the header of a pending commit.
        m.d.comb += self.i.ready.eq(((pf.space >= 2) | ovf) & (hf.level < self.hdr_depth - 2))
        return m
