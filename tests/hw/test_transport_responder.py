"""The RC responder on Amaranth's simulator: PSN checks, duplicates, gaps, coalesced
ACKs, memory-key protection and PSN wrap-around, against the host model's rules."""

from __future__ import annotations

import random

from amaranth.sim import Simulator

from fpgaccl.hw.transport import QPState, Responder
from fpgaccl.hw.transport.layouts import HDR
from fpgaccl.proto.drops import DropReason
from fpgaccl.proto.opcodes import AethKind, NakCode, Opcode, aeth_syndrome
from fpgaccl.sim.tb.transport_model import unpack, write_hdr

W = 64
NB = W // 8
LQPN, RQPN = 0x000123, 0x000456
BASE, SIZE, KEY = 0x10000, 0x1000, 0xCAFE0001
ACK = aeth_syndrome(AethKind.ACK, 0x1F)


def nak(code):
    return aeth_syndrome(AethKind.NAK, code)


def beats(payload: bytes):
    out = []
    for off in range(0, len(payload), NB):
        chunk = payload[off:off + NB]
        out.append({"data": int.from_bytes(chunk, "little"), "keep": (1 << len(chunk)) - 1,
                    "first": int(off == 0), "last": int(off + NB >= len(payload))})
    return out


def run(packets, *, epsn=0, ack_every=0, access=1, stall=0.0, cycles_after=40,
        peer_ip=0):
    """Feed (header dict, payload) pairs; return (acks, memory writes, completions,
    drop counters)."""
    dut = Responder(W, nqp=2, nmr=2, ack_every=ack_every)
    acks, mem, cmpls = [], {}, []
    result = {}
    rng = random.Random(1)

    async def bench(ctx):
        qp = dut.qp_ctl[1]  # QP index 1, so index decoding is exercised
        ctx.set(qp.local_qpn.value, LQPN)
        ctx.set(qp.remote_qpn.value, RQPN)
        ctx.set(qp.expected_psn.value, epsn)
        ctx.set(qp.peer_ip.value, peer_ip)
        ctx.set(dut.qp_ctl[0].local_qpn.value, 0x999)
        mr = dut.mr_ctl[1]
        ctx.set(mr.base_lo.value, BASE)
        ctx.set(mr.length.value, SIZE)
        ctx.set(mr.key.value, KEY)
        ctx.set(mr.access.remote_write, access)
        await ctx.tick().repeat(2)
        ctx.set(qp.state.state, QPState.RTR)
        ctx.set(dut.qp_ctl[0].state.state, QPState.RTR)
        hq = [h for h, _ in packets]
        dq = [b for _, p in packets for b in beats(p)]
        idle = 0
        while idle < cycles_after:
            ctx.set(dut.hdr.valid, bool(hq))
            if hq:
                ctx.set(dut.hdr.payload, HDR.const(hq[0]))
            ctx.set(dut.data.valid, bool(dq))
            if dq:
                ctx.set(dut.data.payload, dq[0])
            ctx.set(dut.ack.ready, 1)
            ctx.set(dut.cmpl.ready, 1)
            ctx.set(dut.wr.ready, int(rng.random() >= stall))
            if hq and ctx.get(dut.hdr.ready):
                hq.pop(0)
            if dq and ctx.get(dut.data.ready):
                dq.pop(0)
            if ctx.get(dut.ack.valid):
                acks.append(unpack(ctx.get(dut.ack.payload).as_value().value))
            if ctx.get(dut.wr.valid) and ctx.get(dut.wr.ready):
                w = ctx.get(dut.wr.payload)
                for i in range(NB):
                    if (w.keep >> i) & 1:
                        mem[w.addr + i] = (w.data >> (8 * i)) & 0xFF
            if ctx.get(dut.cmpl.valid):
                c = ctx.get(dut.cmpl.payload)
                cmpls.append((c.qp, c.va, c.len, c.imm, c.has_imm))
            idle = 0 if (hq or dq) else idle + 1
            await ctx.tick()
        result["drops"] = {r: ctx.get(dut.drops[r]) for r in DropReason if ctx.get(dut.drops[r])}

    sim = Simulator(dut)
    sim.add_clock(1e-8)
    sim.add_testbench(bench)
    sim.run()
    return acks, mem, cmpls, result["drops"]


def message(psn, data, *, va=BASE, rkey=KEY, mtu=32, imm=0x10002):
    """The packets of one WRITE-with-immediate as the requester segments it."""
    out = []
    chunks = [data[i:i + mtu] for i in range(0, len(data), mtu)] or [b""]
    for i, c in enumerate(chunks):
        first, last = i == 0, i == len(chunks) - 1
        out.append((write_hdr(psn=(psn + i) & 0xFFFFFF, dqpn=LQPN, first=first, last=last,
                              imm=imm, va=va, rkey=rkey, dlen=len(data), payload_len=len(c)),
                    c))
    return out


def mem_bytes(mem, va, n):
    return bytes(mem.get(va + i, 0) for i in range(n))


def ack_list(acks):
    return [(a["aeth"]["syndrome"], a["bth"]["psn"]) for a in acks]


def test_in_order_message_writes_memory_and_acks_once():
    data = bytes(random.Random(2).getrandbits(8) for _ in range(100))
    acks, mem, cmpls, drops = run(message(10, data, va=BASE + 5), epsn=10, stall=0.3)
    assert mem_bytes(mem, BASE + 5, 100) == data
    assert len(mem) == 100  # nothing outside the message
    # One coalesced ACK for the last packet (AckReq on it only), MSN 1.
    assert ack_list(acks) == [(ACK, 13)]
    assert acks[0]["bth"]["dqpn"] == RQPN and acks[0]["bth"]["opcode"] == Opcode.ACKNOWLEDGE
    assert acks[0]["aeth"]["msn"] == 1 and acks[0]["qp"] == 1
    assert cmpls == [(1, BASE + 5, 100, 0x10002, 1)]
    assert drops == {}


def test_duplicate_dropped_and_reacked():
    pkts = message(0, b"A" * 32) + message(1, b"B" * 8, va=BASE + 64)
    acks, mem, _, drops = run([*pkts, pkts[0]])
    assert drops == {DropReason.PSN_DUPLICATE: 1}
    assert ack_list(acks)[-1] == (ACK, 1)
    assert mem_bytes(mem, BASE, 32) == b"A" * 32


def test_gap_naks_once_then_recovers():
    pkts = message(0, bytes(range(96)))  # 3 packets
    seq = [pkts[0], pkts[2], pkts[2], pkts[1], pkts[2]]
    acks, mem, cmpls, drops = run(seq)
    assert drops == {DropReason.PSN_OUT_OF_ORDER: 2}
    assert ack_list(acks) == [(nak(NakCode.PSN_SEQUENCE_ERROR), 1), (ACK, 2)]
    assert mem_bytes(mem, BASE, 96) == bytes(range(96))
    assert len(cmpls) == 1


def test_ack_every_n_packets_without_ackreq():
    data = bytes(8 * 32)  # 8 packets; only the last asks for an ACK
    acks, _, _, _ = run(message(0, data), ack_every=3)
    assert [p for _, p in ack_list(acks)] == [2, 5, 7]


def test_bad_rkey_bounds_rights_nak_and_write_nothing():
    for kw, reason, access in (({"rkey": KEY + 1}, DropReason.BAD_RKEY, 1),
                               ({"va": BASE + SIZE - 16}, DropReason.OUT_OF_BOUNDS, 1),
                               ({"va": BASE - 1}, DropReason.OUT_OF_BOUNDS, 1),
                               ({}, DropReason.ACCESS_DENIED, 0)):
        pkts = message(7, bytes(64), **kw)
        acks, mem, cmpls, drops = run(pkts, epsn=7, access=access)
        assert mem == {} and cmpls == [], kw
        # One NAK for the offending FIRST; the MIDDLE/LAST after it is a gap, NAK
        # suppressed until the requester restarts (it fails the WRITE instead).
        assert ack_list(acks) == [(nak(NakCode.REMOTE_ACCESS_ERROR), 7)], kw
        assert drops == {reason: 1, DropReason.PSN_OUT_OF_ORDER: 1}, kw


def test_bounds_are_exact_at_the_region_end():
    """A message ending on the region's last byte is written; one byte further is
    OUT_OF_BOUNDS (va + dlen against base + length, both sums exact)."""
    data = bytes(range(64))
    acks, mem, cmpls, drops = run(message(7, data, va=BASE + SIZE - 64), epsn=7)
    assert mem_bytes(mem, BASE + SIZE - 64, 64) == data and drops == {}
    assert cmpls == [(1, BASE + SIZE - 64, 64, 0x10002, 1)]
    assert ack_list(acks) == [(ACK, 8)]
    acks, mem, cmpls, drops = run(message(7, data, va=BASE + SIZE - 63), epsn=7)
    assert mem == {} and cmpls == []
    assert ack_list(acks) == [(nak(NakCode.REMOTE_ACCESS_ERROR), 7)]
    assert drops == {DropReason.OUT_OF_BOUNDS: 1, DropReason.PSN_OUT_OF_ORDER: 1}


def test_overrun_of_dlen_is_remote_access_error():
    h, _p = message(0, bytes(16))[0]
    h["payload_len"] = 24  # more than the 16 bytes RETH announced
    acks, mem, _, drops = run([(h, bytes(24))])
    assert ack_list(acks) == [(nak(NakCode.REMOTE_ACCESS_ERROR), 0)]
    assert mem == {} and drops == {DropReason.OUT_OF_BOUNDS: 1}


def test_psn_wraps_at_2_24():
    data = bytes(range(128))
    acks, mem, _cmpls, drops = run(message(0xFFFFFE, data), epsn=0xFFFFFE)
    assert mem_bytes(mem, BASE, 128) == data and drops == {}
    assert ack_list(acks) == [(ACK, 1)]
    # A packet from before the wrap is a duplicate, not a gap.
    acks, _, _, drops = run(message(0xFFFFFF, b"x" * 8) + message(0xFFFFF0, b"y" * 8),
                            epsn=0xFFFFFF)
    assert drops == {DropReason.PSN_DUPLICATE: 1}


def test_unknown_qpn_and_orphan_middle():
    h, p = message(0, bytes(8))[0]
    h["bth"]["dqpn"] = 0x777
    mid = write_hdr(psn=0, dqpn=LQPN, first=False, last=False, payload_len=8)
    acks, mem, _, drops = run([(h, p), (mid, bytes(8))])
    assert drops == {DropReason.BAD_QPN: 1, DropReason.ACCESS_DENIED: 1}
    assert ack_list(acks) == [(nak(NakCode.INVALID_REQUEST), 0)] and mem == {}


def test_packets_from_another_address_are_dropped_and_counted():
    """Issue 34: a packet with the right QPN, PSN, key and ICRC from an IPv4 address
    that is not the QP's peer writes nothing, moves no PSN, is neither ACKed nor NAKed,
    and counts WRONG_SOURCE; the peer's own packets around it are accepted."""
    peer, stranger = 0x0A000002, 0x0A000099
    data = bytes(random.Random(7).getrandbits(8) for _ in range(64))
    pkts = [(dict(h, src_ip=peer), p) for h, p in message(0, data)]
    forged = [(dict(h, src_ip=stranger), bytes(len(p))) for h, p in
              message(0, bytes(64), va=BASE + 128) + message(1, bytes(8), va=BASE + 256)]
    acks, mem, cmpls, drops = run([forged[0], pkts[0], *forged[1:], *pkts[1:]],
                                  peer_ip=peer)
    assert drops == {DropReason.WRONG_SOURCE: len(forged)}
    assert mem_bytes(mem, BASE, 64) == data and len(mem) == 64
    assert ack_list(acks) == [(ACK, 1)] and len(cmpls) == 1


def test_gap_inside_a_message_and_a_non_write_opcode_are_not_accepted():
    # A MIDDLE ahead of its turn fits the WRITE's length, so only the PSN test can stop
    # it; a SEND MIDDLE with the right PSN inside an open WRITE only the opcode test.
    data = bytes(random.Random(5).getrandbits(8) for _ in range(128))
    pkts = message(0, data)  # 4 packets
    send_mid = dict(pkts[1][0], bth=dict(pkts[1][0]["bth"], opcode=int(Opcode.SEND_MIDDLE)))
    seq = [pkts[0], pkts[2], (send_mid, bytes(32)), pkts[1], pkts[2], pkts[3]]
    acks, mem, cmpls, drops = run(seq)
    assert drops == {DropReason.PSN_OUT_OF_ORDER: 1, DropReason.UNKNOWN_OPCODE: 1}
    assert ack_list(acks) == [(nak(NakCode.PSN_SEQUENCE_ERROR), 1), (ACK, 3)]
    assert mem_bytes(mem, BASE, 128) == data and len(mem) == 128
    assert len(cmpls) == 1



def test_back_to_back_zero_length_writes_see_each_others_context():
    """Zero-length WRITE-with-immediate (the sequencer's grants) right behind other
    packets on one QP, with memory stalling the writes so that a grant's CHECK waits and
    the next header is ready when it decides: each packet is checked against the context
    its predecessor committed (CHECK decides, the next cycle commits), so none is taken
    for a gap or a duplicate, and a repeated gap still NAKs once."""
    pkts = []
    for psn in range(0, 12, 3):
        pkts += [message(psn, bytes([psn]) * 8, va=BASE + 8 * psn)[0],
                 message(psn + 1, b"", imm=0x100 + psn)[0],
                 message(psn + 2, b"", imm=0x200 + psn)[0]]
    acks, mem, cmpls, drops = run(pkts, stall=0.6)
    assert drops == {}
    assert [c[3] for c in cmpls] == [x for psn in range(0, 12, 3)
                                     for x in (0x10002, 0x100 + psn, 0x200 + psn)]
    assert all(mem_bytes(mem, BASE + 8 * psn, 8) == bytes([psn]) * 8 for psn in range(0, 12, 3))
    assert ack_list(acks)[-1] == (ACK, 11) and acks[-1]["aeth"]["msn"] == 12
    g = [message(psn, b"", imm=0x100 + psn)[0] for psn in range(4)]
    head = message(0, b"x" * 8, va=BASE)[0]
    seq = [head, g[2], g[2], g[3], g[1], g[2], g[3]]
    acks, _, cmpls, drops = run([(dict(h, bth=dict(h["bth"], psn=0)) if h is head else h, p)
                                 for h, p in seq], stall=0.6)
    assert drops == {DropReason.PSN_OUT_OF_ORDER: 3}
    assert [a for a in ack_list(acks) if a[0] != ACK] == [(nak(NakCode.PSN_SEQUENCE_ERROR), 1)]
    assert ack_list(acks)[-1] == (ACK, 3)
    assert [c[3] for c in cmpls] == [0x10002, 0x101, 0x102, 0x103]


def test_zero_length_write_passes_with_any_va_and_rkey():
    """IBTA: a zero-length WRITE's R_Key and VA are not validated (a GRANT carries its
    signature digest in the VA): accepted with its VA on the completion, without the
    remote-write right even, and a WRITE with bytes to the same VA is still refused."""
    digest = 0xFEDC_BA98_7654_3210
    for rkey, access in ((KEY + 5, 1), (KEY, 0), (0, 1)):
        grant = message(3, b"", va=digest, rkey=rkey, imm=0x4242)
        acks, mem, cmpls, drops = run(grant, epsn=3, access=access)
        assert drops == {} and mem == {}, (rkey, access)
        assert cmpls == [(1, digest, 0, 0x4242, 1)], (rkey, access)
        assert ack_list(acks) == [(ACK, 3)], (rkey, access)
    acks, mem, cmpls, drops = run(message(3, bytes(8), va=digest), epsn=3)
    assert mem == {} and cmpls == [] and drops == {DropReason.OUT_OF_BOUNDS: 1}
    assert ack_list(acks) == [(nak(NakCode.REMOTE_ACCESS_ERROR), 3)]
