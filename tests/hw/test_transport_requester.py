"""The RC requester on Amaranth's simulator: segmentation, PSNs, ACK completion,
go-back-N on NAK and on timeout, bounded retries, remote-access NAK and PSN wrap."""

from __future__ import annotations

from amaranth.sim import Simulator

from fpgaccl.hw.transport import QPState, Requester, Status
from fpgaccl.hw.transport.layouts import HDR, WRITE_DESC
from fpgaccl.proto.opcodes import AethKind, NakCode, Opcode, aeth_syndrome
from fpgaccl.sim.tb.transport_model import hdr, unpack

W = 64
NB = W // 8
MTU = 32
LQPN, RQPN = 0x000123, 0x000456
LQPN0, RQPN0 = 0x000777, 0x000888     # QP index 0, where a test brings it up too
PEER_IP = 0x0A000002                    # both QPs' peer
ACK = aeth_syndrome(AethKind.ACK, 0x1F)


def src_byte(addr):
    return (addr * 7 + 3) & 0xFF


def ack(psn, syndrome=ACK, dqpn=LQPN, src_ip=PEER_IP):
    return {**hdr(opcode=Opcode.ACKNOWLEDGE, psn=psn & 0xFFFFFF, dqpn=dqpn,
                  aeth={"syndrome": syndrome, "msn": 0}), "src_ip": src_ip}


def run(descs, peer, *, npsn=0, timeout=400, max_retries=3, cycles=1500, qp0=False):
    """``peer(packet_index, header, payload)`` returns ACK headers to answer with.
    QP index 1 is up; with ``qp0`` index 0 too (QPNs ``LQPN0``/``RQPN0``, PSN 0)."""
    dut = Requester(W, nqp=2, mtu=MTU, window=8, ackreq_every=2, timeout=timeout,
                    max_retries=max_retries)
    pkts, cmpls, state = [], [], {}

    async def bench(ctx):
        qp = dut.qp_ctl[1]
        ctx.set(qp.local_qpn.value, LQPN)
        ctx.set(qp.remote_qpn.value, RQPN)
        ctx.set(qp.next_psn.value, npsn)
        ctx.set(qp.peer_ip.value, PEER_IP)
        ctx.set(dut.qp_ctl[0].peer_ip.value, PEER_IP)
        if qp0:
            ctx.set(dut.qp_ctl[0].local_qpn.value, LQPN0)
            ctx.set(dut.qp_ctl[0].remote_qpn.value, RQPN0)
        await ctx.tick().repeat(2)
        ctx.set(qp.state.state, QPState.RTS)
        if qp0:
            ctx.set(dut.qp_ctl[0].state.state, QPState.RTS)
        dq = list(descs)
        reads, resp, acks = [], [], []
        hq, buf = [], bytearray()  # headers waiting for their payload, in order
        for _ in range(cycles):
            ctx.set(dut.desc.valid, bool(dq))
            if dq:
                ctx.set(dut.desc.payload, WRITE_DESC.const(dq[0]))
            ctx.set(dut.ack.valid, bool(acks))
            if acks:
                ctx.set(dut.ack.payload, HDR.const(acks[0]))
            if not resp and reads:
                addr, n = reads.pop(0)
                for off in range(0, n, NB):
                    k = min(NB, n - off)
                    resp.append({"data": sum(src_byte(addr + off + i) << 8 * i for i in range(k)),
                                 "keep": (1 << k) - 1, "first": int(off == 0),
                                 "last": int(off + NB >= n)})
            ctx.set(dut.rd_resp.valid, bool(resp))
            if resp:
                ctx.set(dut.rd_resp.payload, resp[0])
            for s in (dut.hdr.ready, dut.data.ready, dut.rd_req.ready, dut.cmpl.ready):
                ctx.set(s, 1)
            if dq and ctx.get(dut.desc.ready):
                dq.pop(0)
            if acks and ctx.get(dut.ack.ready):
                acks.pop(0)
            if resp and ctx.get(dut.rd_resp.ready):
                resp.pop(0)
            if ctx.get(dut.rd_req.valid):
                r = ctx.get(dut.rd_req.payload)
                reads.append((r.addr, r.len))
            if ctx.get(dut.hdr.valid):
                h = unpack(ctx.get(dut.hdr.payload).as_value().value)
                if h["payload_len"] == 0:
                    pkts.append((h, b""))
                    acks += peer(len(pkts) - 1, h, b"")
                else:
                    hq.append(h)
            if ctx.get(dut.data.valid):
                b = ctx.get(dut.data.payload)
                buf += b.data.to_bytes(NB, "little")[:b.keep.bit_length()]
                if b.last:
                    h = hq.pop(0)
                    pkts.append((h, bytes(buf)))
                    acks += peer(len(pkts) - 1, h, bytes(buf))
                    buf = bytearray()
            if ctx.get(dut.cmpl.valid):
                c = ctx.get(dut.cmpl.payload)
                cmpls.append((c.qp, c.status))
            await ctx.tick()
        state["error"] = ctx.get(dut.qp_error)
        state["retries"] = ctx.get(dut.qp_sts[1].retries.value)
        state["retransmits"] = ctx.get(dut.retransmits)
        state["timeouts"] = ctx.get(dut.timeouts)
        state["ack_psn_invalid"] = ctx.get(dut.ack_psn_invalid)
        state["wrong_source"] = ctx.get(dut.wrong_source)
        state["bad_qpn"] = ctx.get(dut.bad_qpn)
        state["naks_rx"] = ctx.get(dut.naks_rx)

    sim = Simulator(dut)
    sim.add_clock(1e-8)
    sim.add_testbench(bench)
    sim.run()
    return pkts, cmpls, state


def desc(n, *, laddr=0x100, raddr=0x9000, imm=0xABCD, has_imm=1, qp=1):
    return {"qp": qp, "laddr": laddr, "raddr": raddr, "rkey": 0x55, "len": n, "imm": imm,
            "has_imm": has_imm}


def acker(last_psn_of):
    """A clean peer: ACK every packet with AckReq."""
    def peer(i, h, p):
        return [ack(h["bth"]["psn"])] if h["bth"]["ackreq"] else []
    return peer


def test_segmentation_and_completion():
    pkts, cmpls, _ = run([desc(100), desc(0, has_imm=1, imm=7)], acker(None), npsn=50)
    ops = [h["bth"]["opcode"] for h, _ in pkts]
    assert ops == [Opcode.RDMA_WRITE_FIRST, Opcode.RDMA_WRITE_MIDDLE, Opcode.RDMA_WRITE_MIDDLE,
                   Opcode.RDMA_WRITE_LAST_WITH_IMMEDIATE, Opcode.RDMA_WRITE_ONLY_WITH_IMMEDIATE]
    assert [h["bth"]["psn"] for h, _ in pkts] == [50, 51, 52, 53, 54]
    assert [h["bth"]["ackreq"] for h, _ in pkts] == [0, 1, 0, 1, 1]
    first = pkts[0][0]
    assert first["has_reth"] and first["reth"] == {"va": 0x9000, "rkey": 0x55, "dlen": 100}
    assert all(h["bth"]["dqpn"] == RQPN and h["qp"] == 1 for h, _ in pkts)
    assert pkts[3][0]["has_immdt"] and pkts[3][0]["immdt"]["imm"] == 0xABCD
    data = b"".join(p for _, p in pkts[:4])
    assert data == bytes(src_byte(0x100 + i) for i in range(100))
    assert pkts[4][1] == b"" and pkts[4][0]["payload_len"] == 0
    assert cmpls == [(1, Status.OK), (1, Status.OK)]


def test_nak_sequence_error_goes_back_n():
    st = {"epsn": 0, "lost": False, "nak": False}

    def peer(i, h, p):
        """A strict in-order responder that loses PSN 2 once."""
        psn = h["bth"]["psn"]
        if psn == 2 and not st["lost"]:
            st["lost"] = True
            return []
        if psn == st["epsn"]:
            st["epsn"] += 1
            st["nak"] = False
            return [ack(psn)] if h["bth"]["ackreq"] else []
        if psn > st["epsn"] and not st["nak"]:
            st["nak"] = True
            return [ack(st["epsn"], aeth_syndrome(AethKind.NAK, NakCode.PSN_SEQUENCE_ERROR))]
        return []

    pkts, cmpls, stats = run([desc(160)], peer)
    psns = [h["bth"]["psn"] for h, _ in pkts]
    assert psns[:3] == [0, 1, 2] and psns[-3:] == [2, 3, 4]
    # Retransmitted packets carry the same bytes as the originals.
    by_psn = {}
    for h, p in pkts:
        assert by_psn.setdefault(h["bth"]["psn"], p) == p
    assert cmpls == [(1, Status.OK)] and stats["retransmits"] >= 3
    # The NAK itself rewound the send pointer: no timeout was needed.
    assert stats["timeouts"] == 0


def test_timeout_rewinds_then_retry_limit_fails():
    def silent(i, h, p):
        return []

    pkts, cmpls, st = run([desc(64), desc(8)], silent, timeout=100, max_retries=2,
                          cycles=2500)
    psns = [h["bth"]["psn"] for h, _ in pkts]
    # Original + 2 retransmissions of both packets (backoff doubles the wait), then
    # RETRY_EXCEEDED, then the next descriptor is flushed.
    assert psns == [0, 1] * 3
    assert cmpls == [(1, Status.RETRY_EXCEEDED), (1, Status.FLUSHED)]
    assert st["error"] == 0b10 and st["retries"] == 3


def test_remote_access_nak_fails_the_write():
    def peer(i, h, p):
        return [ack(h["bth"]["psn"], aeth_syndrome(AethKind.NAK, NakCode.REMOTE_ACCESS_ERROR))]

    _, cmpls, st = run([desc(8)], peer)
    assert cmpls == [(1, Status.REMOTE_ACCESS)] and st["error"] == 0b10


def test_psn_wrap_and_stale_acks_ignored():
    def peer(i, h, p):
        extra = [ack(0xFFFF00)]  # stale: far behind una, must not complete anything
        return extra + ([ack(h["bth"]["psn"])] if h["bth"]["ackreq"] else [])

    pkts, cmpls, st = run([desc(4 * MTU)], peer, npsn=0xFFFFFE)
    assert [h["bth"]["psn"] for h, _ in pkts] == [0xFFFFFE, 0xFFFFFF, 0, 1]
    assert cmpls == [(1, Status.OK)]
    assert st["ack_psn_invalid"] == 4  # each stale ACK counted


def test_naks_and_acks_for_psns_not_outstanding_are_dropped_and_counted():
    """Issue 34: a NAK (remote access error: would fail the QP; PSN sequence error: would
    rewind it) or an ACK (would complete what was never sent) naming a PSN outside
    [una, hi) does nothing but count ACK_PSN_INVALID. A repeat ACK of ``una - 1`` is no
    drop."""
    fatal = aeth_syndrome(AethKind.NAK, NakCode.REMOTE_ACCESS_ERROR)
    seq = aeth_syndrome(AethKind.NAK, NakCode.PSN_SEQUENCE_ERROR)
    st = {"forged": 0}

    def peer(i, h, p):
        psn = h["bth"]["psn"]
        out = []
        if psn == 0:
            # Ahead of everything sent (the window is 8 of the message's 24 packets).
            out = [ack(20, fatal), ack(20), ack(20, seq), ack(psn - 1)]
            st["forged"] += 3
        if psn == 5:
            out = [ack(1, fatal), ack(1, seq)]  # ACKed already (ACK for 1 came before)
            st["forged"] += 2
        return out + ([ack(psn)] if h["bth"]["ackreq"] else [])

    pkts, cmpls, state = run([desc(24 * MTU)], peer, cycles=3000)
    assert cmpls == [(1, Status.OK)] and state["error"] == 0
    assert [h["bth"]["psn"] for h, _ in pkts] == list(range(24))  # no resend, no skip
    assert state["ack_psn_invalid"] == st["forged"] == 5
    assert state["retransmits"] == 0 and state["naks_rx"] == 0


def test_acks_and_naks_from_another_address_are_dropped_and_counted():
    """Issue 34: only the QP's peer speaks for it. NAKs (fatal and sequence error) and
    ACKs with the right QPN and an outstanding PSN, but another IPv4 source, do nothing
    but count WRONG_SOURCE: the QP neither fails, rewinds nor completes early."""
    fatal = aeth_syndrome(AethKind.NAK, NakCode.REMOTE_ACCESS_ERROR)
    seq = aeth_syndrome(AethKind.NAK, NakCode.PSN_SEQUENCE_ERROR)
    stranger = PEER_IP + 1

    def peer(i, h, p):
        psn = h["bth"]["psn"]
        out = []
        if psn == 2:
            out = [ack(psn, fatal, src_ip=stranger), ack(1, seq, src_ip=stranger),
                   ack(23, src_ip=stranger)]
        return out + ([ack(psn)] if h["bth"]["ackreq"] else [])

    pkts, cmpls, state = run([desc(24 * MTU)], peer, cycles=3000)
    assert cmpls == [(1, Status.OK)] and state["error"] == 0
    assert [h["bth"]["psn"] for h, _ in pkts] == list(range(24))  # no resend, no skip
    assert state["wrong_source"] == 3
    assert state["ack_psn_invalid"] == 0 and state["bad_qpn"] == 0
    assert state["retransmits"] == 0 and state["naks_rx"] == 0


def test_retry_limit_is_the_timed_out_qps_own():
    """QP 1's peer is dead: QP 1 uses up its retries and fails. Meanwhile QP 0 streams
    messages, and one of its packets is lost once QP 1's retries are used up: QP 0's own
    retry count decides that timeout, so it retransmits and every message completes."""
    st = {"qp1_sent": 0, "lost": None}

    def peer(i, h, p):
        if h["qp"] == 1:
            st["qp1_sent"] += 1
            return []
        psn = h["bth"]["psn"]
        if st["lost"] is None and st["qp1_sent"] >= 3:   # QP 1 at its retry limit
            st["lost"] = psn
            return []
        return [ack(psn, dqpn=LQPN0)] if h["bth"]["ackreq"] else []

    n0 = 40
    pkts, cmpls, state = run([desc(8)] + [desc(8, qp=0, imm=k) for k in range(n0)], peer,
                             timeout=100, max_retries=2, cycles=3000, qp0=True)
    assert st["lost"] is not None
    assert [c for c in cmpls if c[0] == 1] == [(1, Status.RETRY_EXCEEDED)]
    assert [c for c in cmpls if c[0] == 0] == [(0, Status.OK)] * n0
    assert state["error"] == 0b10 and state["timeouts"] >= 3
    psns0 = [h["bth"]["psn"] for h, _ in pkts if h["qp"] == 0]
    assert psns0.count(st["lost"]) == 2 and sorted(set(psns0)) == list(range(n0))


def test_an_ack_after_the_last_retry_gives_the_qp_its_retries_back():
    """The peer is silent until the message's first packet has gone out three times
    (two timeouts: QP 1 is at its limit of 2), then answers, but loses the last packet
    once. The ACK that moved the window reset the retry count, so that loss costs one
    more timeout and a retransmission, not the QP."""
    seen = {"psn0": 0, "lost": False}

    def peer(i, h, p):
        psn = h["bth"]["psn"]
        seen["psn0"] += psn == 0
        if seen["psn0"] < 3:
            return []
        if psn == 3 and not seen["lost"]:
            seen["lost"] = True
            return []
        return [ack(psn)] if h["bth"]["ackreq"] else []

    pkts, cmpls, st = run([desc(4 * MTU)], peer, timeout=100, max_retries=2, cycles=3000)
    assert seen["lost"] and cmpls == [(1, Status.OK)]
    assert st["error"] == 0 and st["timeouts"] == 3
    psns = [h["bth"]["psn"] for h, _ in pkts]
    assert psns.count(0) == 3 and psns.count(3) == 4


def test_a_nak_that_moves_the_window_gives_the_qp_its_retries_back():
    """As above, but the window moves by a PSN-sequence NAK (the peer lost the third
    packet and saw the fourth), and the retransmitted last packet is lost once more:
    that timeout is the QP's first since the NAK, so it retransmits."""
    st = {"psn0": 0, "epsn": 0, "lost": set()}

    def peer(i, h, p):
        psn = h["bth"]["psn"]
        st["psn0"] += psn == 0
        if st["psn0"] < 3:
            return []
        if psn == 2 and "first" not in st["lost"]:
            st["lost"].add("first")
            return []
        if psn > st["epsn"]:
            return [ack(st["epsn"], aeth_syndrome(AethKind.NAK, NakCode.PSN_SEQUENCE_ERROR))]
        if psn == 3 and "retransmit" not in st["lost"]:
            st["lost"].add("retransmit")
            return []
        if psn == st["epsn"]:
            st["epsn"] += 1
        return [ack(psn)] if psn == 3 else []

    pkts, cmpls, stats = run([desc(4 * MTU)], peer, timeout=100, max_retries=2, cycles=3000)
    assert st["lost"] == {"first", "retransmit"} and cmpls == [(1, Status.OK)]
    assert stats["error"] == 0 and stats["timeouts"] == 3
    # Back to the NAK's PSN, then (the timeout) back to the same PSN, nothing ACKed since.
    assert [h["bth"]["psn"] for h, _ in pkts][-4:] == [2, 3, 2, 3]
