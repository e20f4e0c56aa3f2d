"""RC requester: RDMA WRITE (with immediate) segmentation, PSN assignment, ACK/NAK
processing, go-back-N and the retransmit timer. The gateware twin of the send half of
:class:`fpgaccl.host.qp.QueuePair`.

A WRITE descriptor becomes ``max(1, ceil(len / mtu))`` packets with consecutive PSNs:
FIRST (RETH: remote va, rkey, total length), MIDDLEs, LAST (ImmDt when ``has_imm``), or
one ONLY packet. For each packet the issuer emits its header on ``hdr`` and, unless the
payload is empty, a read request for exactly its bytes on ``rd_req``; the memory's answer
streams out on ``data`` behind the header (the builder pairs them in order). AckReq is
set on a message's last packet and every ``ackreq_every`` packets, which bounds how many
packets an ACK answers for and so how late the window opens again.

State per QP: the message in flight (one per QP: a descriptor for a busy QP waits at the
head of ``desc``; a modest simplification, documented in the report), its first and end
PSNs, the next PSN to send, the oldest unacknowledged PSN (``una``) and the highest PSN
sent. Because a message's packets have fixed size, a PSN maps back to a byte offset by a
shift: go-back-N rewinds the send pointer to a PSN and the issuer re-reads the memory
from that offset -- nothing is buffered for retransmission.

* ACK for PSN p in [una, end): everything up to p is acknowledged; the timer restarts
  and the retry count clears; when ``una`` reaches ``end`` the descriptor completes OK.
* NAK PSN-sequence-error p: everything before p is acknowledged and sending resumes at p.
* Any other NAK (remote access error, invalid request): error completion, QP in error.
* Nothing acknowledged for ``timeout << min(retries, 3)`` cycles while packets are out
  (the host model's exponential backoff, capped): rewind to ``una``; after
  ``max_retries`` such timeouts in a row the descriptor completes RETRY_EXCEEDED and the
  QP goes to error. Error QPs flush later descriptors (status FLUSHED) until software
  moves them back through RESET (which also reloads ``next_psn`` from the CSR).

Messages must satisfy ``len < 2^23 * mtu`` (half the PSN space per message).
"""

from __future__ import annotations

from amaranth.hdl import Cat, Const, Module, Mux, Signal
from amaranth.lib import stream, wiring
from amaranth.lib.wiring import In, Out
from amaranth.utils import exact_log2

from fpgaccl.hw.stream.beat import beat_stream
from fpgaccl.proto.opcodes import AethKind, NakCode, Opcode

from .common import behind, pick, psn_sub, qp_lookup, sat_inc
from .layouts import (
    HDR,
    MEM_READ_REQ,
    WRITE_CMPL,
    WRITE_DESC,
    QPState,
    Status,
    qp_ctl_layout,
    qp_sts_layout,
)

TIMER_BITS = 32


class Requester(wiring.Component):
    def __init__(self, width: int, *, nqp: int = 8, mtu: int = 4096, window: int = 64,
                 ackreq_every: int = 16, timeout: int = 1 << 14, max_retries: int = 7) -> None:
        self.width = width
        self.nqp = nqp
        self.mtu = mtu
        self.log2mtu = exact_log2(mtu)
        self.window = window
        self.ackreq_every = ackreq_every
        exact_log2(ackreq_every)
        self.timeout = timeout
        self.max_retries = max_retries
        super().__init__({
            "desc": In(stream.Signature(WRITE_DESC)),
            "cmpl": Out(stream.Signature(WRITE_CMPL)),
            "ack": In(stream.Signature(HDR)),
            "hdr": Out(stream.Signature(HDR)),
            "rd_req": Out(stream.Signature(MEM_READ_REQ)),
            "rd_resp": In(beat_stream(width)),
            "data": Out(beat_stream(width)),
            "qp_ctl": In(qp_ctl_layout(nqp)),
            "qp_sts": Out(qp_sts_layout(nqp)),
            "qp_error": Out(nqp),
            "tx_packets": Out(32),
            "retransmits": Out(32),
            "timeouts": Out(32),
            "naks_rx": Out(32),
            "bad_qpn": Out(32),
        })

    def elaborate(self, platform) -> Module:
        m = Module()
        nqp = self.nqp

        def per_qp(width, name):
            return [Signal(width, name=f"{name}{i}") for i in range(nqp)]

        active, err = per_qp(1, "active"), per_qp(1, "err")
        laddr, raddr = per_qp(64, "laddr"), per_qp(64, "raddr")
        rkey, length, imm, has_imm = (per_qp(32, "rkey"), per_qp(32, "len"), per_qp(32, "imm"),
                                      per_qp(1, "has_imm"))
        first, end, send, una, hi = (per_qp(24, n) for n in ("first", "end", "send", "una", "hi"))
        retries = per_qp(8, "retries")
        timer = per_qp(TIMER_BITS, "timer")
        kick = per_qp(1, "kick")   # comb: restart this QP's timer
        state = [self.qp_ctl[i].state.state for i in range(nqp)]
        m.d.comb += self.qp_error.eq(Cat(*err))

        # ---- retransmit timers --------------------------------------------------------
        # ``expired`` is registered (a timeout fires a cycle later; the 32-bit compare
        # stays off the control's path) and cleared with the timer.
        expired = Signal(nqp)
        for i in range(nqp):
            limit = Signal(TIMER_BITS, name=f"limit{i}")
            m.d.comb += limit.eq(self.timeout << Mux(retries[i] > 3, 3, retries[i][:2]))
            counting = active[i] & ~err[i] & (send[i] != una[i])
            m.d.sync += expired[i].eq(counting & ~kick[i] & (timer[i] >= limit))
            with m.If(kick[i] | ~counting):
                m.d.sync += timer[i].eq(0)
            with m.Elif(~expired[i]):
                m.d.sync += timer[i].eq(timer[i] + 1)

        # ---- issuer: one packet header + read request at a time -------------------------
        elig = Signal(nqp)
        for i in range(nqp):
            out_n = psn_sub(m, send[i], una[i], f"outstanding{i}")
            m.d.comb += elig[i].eq(active[i] & ~err[i] & (state[i] == QPState.RTS)
                                   & (send[i] != end[i]) & (out_n < self.window))
        s = Signal(range(max(nqp, 2)))
        sel = Signal(range(max(nqp, 2)))
        c_send = pick(send, sel, 24, m, "c_send")
        c_first = pick(first, sel, 24, m, "c_first")
        c_end = pick(end, sel, 24, m, "c_end")
        c_hi = pick(hi, sel, 24, m, "c_hi")
        c_len = pick(length, sel, 32, m, "c_len")
        c_laddr = pick(laddr, sel, 64, m, "c_laddr")
        c_raddr = pick(raddr, sel, 64, m, "c_raddr")
        c_rkey = pick(rkey, sel, 32, m, "c_rkey")
        c_imm = pick(imm, sel, 32, m, "c_imm")
        c_has_imm = pick(has_imm, sel, 1, m, "c_has_imm")
        c_rqpn = pick([self.qp_ctl[i].remote_qpn.value[:24] for i in range(nqp)], sel, 24, m,
                      "c_rqpn")
        idx = psn_sub(m, c_send, c_first, "pkt_idx")
        off = Signal(24 + self.log2mtu)
        m.d.comb += off.eq(idx << self.log2mtu)
        rem = Signal(33)
        m.d.comb += rem.eq(c_len - off)
        nbytes = Signal(range(self.mtu + 1))
        m.d.comb += nbytes.eq(Mux(rem > self.mtu, self.mtu, rem))
        is_first = idx == 0
        nxt = Signal(24)
        m.d.comb += nxt.eq(c_send + 1)
        is_last = nxt == c_end
        opcode = Signal(8)
        with m.Switch(Cat(is_last, is_first, c_has_imm)):
            for lst in (0, 1):
                for fst in (0, 1):
                    for im in (0, 1):
                        op = Opcode.RDMA_WRITE_MIDDLE
                        if fst and lst:
                            op = Opcode.RDMA_WRITE_ONLY_WITH_IMMEDIATE if im else \
                                Opcode.RDMA_WRITE_ONLY
                        elif fst:
                            op = Opcode.RDMA_WRITE_FIRST
                        elif lst:
                            op = Opcode.RDMA_WRITE_LAST_WITH_IMMEDIATE if im else \
                                Opcode.RDMA_WRITE_LAST
                        with m.Case(lst | fst << 1 | im << 2):
                            m.d.comb += opcode.eq(op)
        k = exact_log2(self.ackreq_every)
        periodic = (idx[:k] == self.ackreq_every - 1) if k else Const(1)

        with m.If(self.hdr.ready):
            m.d.sync += self.hdr.valid.eq(0)
        with m.If(self.rd_req.ready):
            m.d.sync += self.rd_req.valid.eq(0)
        h = self.hdr.payload
        with m.FSM(name="issue"):
            with m.State("SELECT"):
                m.d.sync += s.eq(Mux(s == nqp - 1, 0, s + 1))
                with m.If(elig.bit_select(s, 1)):
                    m.d.sync += sel.eq(s)
                    m.next = "BUILD"
            with m.State("BUILD"):
                m.next = "SELECT"
                with m.If(elig.bit_select(sel, 1)):
                    m.d.sync += [
                        self.hdr.valid.eq(1),
                        h.bth.eq(0),
                        h.bth.opcode.eq(opcode),
                        h.bth.pkey.eq(0xFFFF),
                        h.bth.dqpn.eq(c_rqpn),
                        h.bth.ackreq.eq(is_last | periodic),
                        h.bth.psn.eq(c_send),
                        h.reth.va.eq(c_raddr),
                        h.reth.rkey.eq(c_rkey),
                        h.reth.dlen.eq(c_len),
                        h.has_reth.eq(is_first),
                        h.aeth.eq(0),
                        h.has_aeth.eq(0),
                        h.immdt.imm.eq(c_imm),
                        h.has_immdt.eq(is_last & c_has_imm),
                        h.payload_len.eq(nbytes),
                        h.qp.eq(sel),
                        self.rd_req.valid.eq(nbytes != 0),
                        self.rd_req.payload.addr.eq(c_laddr + off),
                        self.rd_req.payload.len.eq(nbytes),
                    ]
                    sat_inc(m, self.tx_packets)
                    for i in range(nqp):
                        with m.If(sel == i):
                            m.d.sync += send[i].eq(nxt)
                            with m.If(behind(psn_sub(m, c_send, c_hi, f"vs_hi{i}"))):
                                sat_inc(m, self.retransmits)
                            with m.Else():
                                m.d.sync += hi[i].eq(nxt)
                    m.next = "EMIT"
            with m.State("EMIT"), m.If((~self.hdr.valid | self.hdr.ready)
                                       & (~self.rd_req.valid | self.rd_req.ready)):
                m.next = "SELECT"

        # Payload: memory read data to the wire through a registered pipeline stage.
        free = ~self.data.valid | self.data.ready
        m.d.comb += self.rd_resp.ready.eq(free)
        with m.If(free):
            m.d.sync += [self.data.valid.eq(self.rd_resp.valid),
                         self.data.payload.eq(self.rd_resp.payload)]

        # ---- control: one event per cycle (ACK/NAK, timeout, new descriptor) -----------
        # An ACK takes two stages: ``a`` (as received) has its QP looked up (it reads only
        # context software set before RTS) into ``b``; the control stage then picks that
        # QP's una/end from flops. ACKs come at most once per packet, so the extra cycle
        # costs no throughput.
        a = Signal(HDR)
        a_v = Signal()
        m.d.comb += self.ack.ready.eq(~a_v)
        with m.If(self.ack.valid & ~a_v):
            m.d.sync += [a.eq(self.ack.payload), a_v.eq(1)]
        with m.If(self.cmpl.ready):
            m.d.sync += self.cmpl.valid.eq(0)

        a_hit, a_q = qp_lookup(m, self.qp_ctl, nqp, a.bth.dqpn, QPState.RTS, "ack_qp")
        b_v = Signal()
        hit = Signal()
        aq = Signal(range(max(nqp, 2)))
        p = Signal(24)
        syndrome = Signal(8)
        with m.If(a_v & ~b_v):
            m.d.sync += [b_v.eq(1), a_v.eq(0), hit.eq(a_hit), aq.eq(a_q),
                         p.eq(a.bth.psn), syndrome.eq(a.aeth.syndrome)]
        a_una = pick(una, aq, 24, m, "a_una")
        a_end = pick(end, aq, 24, m, "a_end")
        a_active = pick(active, aq, 1, m, "a_active")
        a_err = pick(err, aq, 1, m, "a_err")
        d_una = psn_sub(m, p, a_una, "d_una")
        d_end = psn_sub(m, p, a_end, "d_end")
        in_window = ~behind(d_una) & behind(d_end)
        kind = syndrome[5:7]
        code = syndrome[:5]
        p1 = Signal(24)
        m.d.comb += p1.eq(p + 1)

        t = Signal(range(max(nqp, 2)))
        m.d.sync += t.eq(Mux(t == nqp - 1, 0, t + 1))
        t_una = pick(una, t, 24, m, "t_una")
        t_retries = pick(retries, t, 8, m, "t_retries")

        dq = self.desc.payload.qp
        dsc = self.desc.payload
        d_ok = Signal()
        d_busy = Signal()
        d_next = pick(end, dq, 24, m, "d_next")
        for i in range(nqp):
            with m.If(dq == i):
                m.d.comb += [d_ok.eq(~err[i] & (state[i] == QPState.RTS)), d_busy.eq(active[i])]
        npkts = Signal(24)
        m.d.comb += npkts.eq(Mux(dsc.len == 0, 1,
                                 (dsc.len + (self.mtu - 1)) >> self.log2mtu))

        def on(sigs, index, value):
            for i, sig in enumerate(sigs):
                with m.If(index == i):
                    m.d.sync += sig.eq(value)

        def complete(qp, status):
            m.d.sync += [self.cmpl.valid.eq(1), self.cmpl.payload.qp.eq(qp),
                         self.cmpl.payload.status.eq(status)]

        def restart(index):
            for i in range(nqp):
                with m.If(index == i):
                    m.d.comb += kick[i].eq(1)

        retries_total = [self.qp_sts[i].retries.value for i in range(nqp)]
        with m.If(~self.cmpl.valid):
            with m.If(b_v):
                m.d.sync += b_v.eq(0)
                with m.If(~hit):
                    sat_inc(m, self.bad_qpn)
                with m.Elif(a_active & ~a_err):
                    with m.If((kind == AethKind.ACK) & in_window):
                        on(una, aq, p1)
                        on(retries, aq, 0)
                        restart(aq)
                        with m.If(p1 == a_end):
                            on(active, aq, 0)
                            complete(aq, Status.OK)
                    with m.Elif((kind == AethKind.NAK) & (code == NakCode.PSN_SEQUENCE_ERROR)):
                        sat_inc(m, self.naks_rx)
                        with m.If(in_window):
                            on(una, aq, p)
                            on(send, aq, p)
                            restart(aq)
                            with m.If(d_una != 0):
                                on(retries, aq, 0)
                    with m.Elif(kind == AethKind.NAK):
                        sat_inc(m, self.naks_rx)
                        on(err, aq, 1)
                        on(active, aq, 0)
                        complete(aq, Status.REMOTE_ACCESS)
            with m.Elif(expired.bit_select(t, 1)):
                with m.If(t_retries >= self.max_retries):
                    on(err, t, 1)
                    on(active, t, 0)
                    complete(t, Status.RETRY_EXCEEDED)
                with m.Else():
                    sat_inc(m, self.timeouts)
                    on(retries, t, t_retries + 1)
                    on(send, t, t_una)
                    restart(t)
                for i in range(nqp):
                    with m.If(t == i):
                        sat_inc(m, retries_total[i])
            with m.Elif(self.desc.valid):
                with m.If((dq >= nqp) | ~d_ok):
                    m.d.comb += self.desc.ready.eq(1)
                    complete(dq, Status.FLUSHED)
                with m.Elif(~d_busy):
                    m.d.comb += self.desc.ready.eq(1)
                    on(active, dq, 1)
                    on(laddr, dq, dsc.laddr)
                    on(raddr, dq, dsc.raddr)
                    on(rkey, dq, dsc.rkey)
                    on(length, dq, dsc.len)
                    on(imm, dq, dsc.imm)
                    on(has_imm, dq, dsc.has_imm)
                    for sigs in (first, send, una, hi):
                        on(sigs, dq, d_next)
                    on(end, dq, d_next + npkts)
                    on(retries, dq, 0)
                    restart(dq)

        for i in range(nqp):
            # Software owns the context until it moves the QP to RTS (last: it wins).
            with m.If(state[i] < QPState.RTS):
                psn0 = self.qp_ctl[i].next_psn.value[:24]
                m.d.sync += [active[i].eq(0), err[i].eq(0), retries[i].eq(0),
                             first[i].eq(psn0), end[i].eq(psn0), send[i].eq(psn0),
                             una[i].eq(psn0), hi[i].eq(psn0)]
        return m
