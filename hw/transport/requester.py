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

* ACK for PSN p in [una, hi) (outstanding: sent, not yet ACKed): everything up to p is
  acknowledged; the timer restarts and the retry count clears; when ``una`` reaches
  ``end`` the descriptor completes OK.
* NAK PSN-sequence-error p in [una, hi): everything before p is acknowledged and
  sending resumes at p.
* Any other NAK (remote access error, invalid request) for p in [una, hi): error
  completion, QP in error.
* An ACK/NAK for a PSN not outstanding (but an ACK of ``una - 1``, the answer to a
  duplicate) does nothing and is counted (``ack_psn_invalid``: the drop reason
  ``ACK_PSN_INVALID``), so a forged or stale NAK cannot fail the QP or force a resend.
* An ACK/NAK whose IPv4 source is not the QP's ``peer_ip`` does nothing and is counted
  (``wrong_source``: ``WRONG_SOURCE``).
* Nothing acknowledged for ``timeout << min(retries, 3)`` cycles while packets are out
  (the host model's exponential backoff, capped): rewind to ``una``; after
  ``max_retries`` such timeouts in a row the descriptor completes RETRY_EXCEEDED and the
  QP goes to error. Error QPs flush later descriptors (status FLUSHED) until software
  moves them back through RESET (which also reloads ``next_psn`` from the CSR).

Messages must satisfy ``len < 2^23 * mtu`` (half the PSN space per message).
"""

from __future__ import annotations

import operator
from functools import reduce

from amaranth.hdl import Cat, Const, Module, Mux, Signal
from amaranth.lib import stream, wiring
from amaranth.lib.wiring import In, Out
from amaranth.utils import exact_log2

from fpgaccl.hw.stream.beat import beat_stream
from fpgaccl.proto.opcodes import PSN_BITS, QPN_BITS, AethKind, NakCode, Opcode

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
            "ack_psn_invalid": Out(32),
            "wrong_source": Out(32),
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
        first, end, send, una, hi = (per_qp(PSN_BITS, n)
                                      for n in ("first", "end", "send", "una", "hi"))
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
        # SELECT -> PICK (the QP's context into registers) -> CALC (packet index, offset,
        # length, opcode into registers) -> BUILD -> EMIT. Eligibility is registered, a
        # cycle old: at BUILD it is that of the CALC cycle, which has every change made
        # before it; a control event (ACK/NAK, timeout, descriptor) during PICK/CALC may
        # have changed the QP after that, so BUILD then gives up and the QP is selected
        # again. (SELECT only uses it as a hint.)
        elig = Signal(nqp)
        elig_r = Signal(nqp)
        for i in range(nqp):
            out_n = psn_sub(m, send[i], una[i], f"outstanding{i}")
            m.d.comb += elig[i].eq(active[i] & ~err[i] & (state[i] == QPState.RTS)
                                   & (send[i] != end[i]) & (out_n < self.window))
        m.d.sync += elig_r.eq(elig)
        can = elig_r
        s = Signal(range(max(nqp, 2)))
        sel = Signal(range(max(nqp, 2)))
        dirty = Signal()        # a control event since PICK
        # BUILD's go, from flops: the selected QP's eligibility as of CALC (what
        # elig_r holds at BUILD) and `sel` one-hot. Its 8:1 pick and decode ahead of
        # every QP's send-pointer mux were 10.3 ns routed at a129e4e.
        sel_elig = Signal()
        sel_hot = Signal(nqp)
        ctl_event = Signal()
        pk = {}

        def picked(values, width, name):
            r = Signal(width, name=name)
            pk[name] = (r, pick(values, sel, width, m, f"{name}_p"))
            return r

        c_send = picked(send, PSN_BITS, "c_send")
        c_first = picked(first, PSN_BITS, "c_first")
        c_end = picked(end, PSN_BITS, "c_end")
        c_hi = picked(hi, PSN_BITS, "c_hi")
        c_len = picked(length, 32, "c_len")
        c_laddr = picked(laddr, 64, "c_laddr")
        c_raddr = picked(raddr, 64, "c_raddr")
        c_rkey = picked(rkey, 32, "c_rkey")
        c_imm = picked(imm, 32, "c_imm")
        c_has_imm = picked(has_imm, 1, "c_has_imm")
        c_rqpn = picked([self.qp_ctl[i].remote_qpn.value[:QPN_BITS] for i in range(nqp)], QPN_BITS,
                        "c_rqpn")
        idx = psn_sub(m, c_send, c_first, "pkt_idx")
        off = Signal(PSN_BITS + self.log2mtu)
        m.d.comb += off.eq(idx << self.log2mtu)
        rem = Signal(33)
        m.d.comb += rem.eq(c_len - off)
        nbytes_c = Signal(range(self.mtu + 1))
        m.d.comb += nbytes_c.eq(Mux(rem > self.mtu, self.mtu, rem))
        nxt_c = Signal(PSN_BITS)
        m.d.comb += nxt_c.eq(c_send + 1)
        is_last_c = nxt_c == c_end
        is_first_c = idx == 0
        opcode = Signal(8)
        with m.Switch(Cat(is_last_c, is_first_c, c_has_imm)):
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
        periodic_c = (idx[:k] == self.ackreq_every - 1) if k else Const(1)
        # CALC's registers: what BUILD puts in the header and the read request.
        nbytes = Signal.like(nbytes_c)
        nxt = Signal(PSN_BITS)
        is_first, is_last, ackreq, retx = Signal(), Signal(), Signal(), Signal()
        op_r = Signal(8)
        rd_addr = Signal(64)
        calc = [nbytes.eq(nbytes_c), nxt.eq(nxt_c), is_first.eq(is_first_c),
                is_last.eq(is_last_c), ackreq.eq(is_last_c | periodic_c), op_r.eq(opcode),
                rd_addr.eq(c_laddr + off),
                retx.eq(behind(psn_sub(m, c_send, c_hi, "vs_hi")))]

        with m.If(self.hdr.ready):
            m.d.sync += self.hdr.valid.eq(0)
        with m.If(self.rd_req.ready):
            m.d.sync += self.rd_req.valid.eq(0)
        h = self.hdr.payload
        with m.FSM(name="issue"):
            with m.State("SELECT"):
                m.d.sync += [s.eq(Mux(s == nqp - 1, 0, s + 1)), dirty.eq(0)]
                with m.If(can.bit_select(s, 1)):
                    m.d.sync += [sel.eq(s), sel_hot.eq(Cat(s == i for i in range(nqp)))]
                    m.next = "PICK"
            with m.State("PICK"):
                m.d.sync += [r.eq(v) for r, v in pk.values()]
                m.d.sync += dirty.eq(ctl_event)
                m.next = "CALC"
            with m.State("CALC"):
                m.d.sync += calc
                m.d.sync += sel_elig.eq(elig.bit_select(sel, 1))
                m.d.sync += dirty.eq(dirty | ctl_event)
                m.next = "BUILD"
            with m.State("BUILD"):
                m.next = "SELECT"
                with m.If(sel_elig & ~dirty):
                    m.d.sync += [
                        self.hdr.valid.eq(1),
                        h.bth.eq(0),
                        h.bth.opcode.eq(op_r),
                        h.bth.pkey.eq(0xFFFF),
                        h.bth.dqpn.eq(c_rqpn),
                        h.bth.ackreq.eq(ackreq),
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
                        self.rd_req.payload.addr.eq(rd_addr),
                        self.rd_req.payload.len.eq(nbytes),
                    ]
                    sat_inc(m, self.tx_packets)
                    with m.If(retx):
                        sat_inc(m, self.retransmits)
                    for i in range(nqp):
                        with m.If(sel_hot[i]):
                            m.d.sync += send[i].eq(nxt)
                            with m.If(~retx):
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
        # An ACK takes three stages: ``a`` (as received) has its QP looked up (it reads
        # only context software set before RTS) into ``b``; for one cycle ``b`` only
        # waits (the control does nothing else) while its PSN is compared with every
        # QP's una/end into registers, which are then exact; the next cycle acts on the
        # looked-up QP's flags. ACKs come at most once per packet, so the extra cycles
        # cost no throughput.
        a = Signal(HDR)
        a_v = Signal()
        m.d.comb += self.ack.ready.eq(~a_v)
        with m.If(self.ack.valid & ~a_v):
            m.d.sync += [a.eq(self.ack.payload), a_v.eq(1)]
        with m.If(self.cmpl.ready):
            m.d.sync += self.cmpl.valid.eq(0)

        a_hit, a_q = qp_lookup(m, self.qp_ctl, nqp, a.bth.dqpn, QPState.RTS, "ack_qp")
        # Only the QP's peer may ACK or NAK for it (an ACK from elsewhere is counted,
        # ``wrong_source``, and does nothing): every QP's peer address against the
        # source, side by side with the lookup, into per-QP flops.
        b_v = Signal()
        hit = Signal()
        b_src = Signal(nqp)
        aq = Signal(range(max(nqp, 2)))
        p = Signal(PSN_BITS)
        syndrome = Signal(8)
        with m.If(a_v & ~b_v):
            m.d.sync += [b_v.eq(1), a_v.eq(0), hit.eq(a_hit), aq.eq(a_q),
                         b_src.eq(Cat(*(self.qp_ctl[i].peer_ip.value == a.src_ip
                                        for i in range(nqp)))),
                         p.eq(a.bth.psn), syndrome.eq(a.aeth.syndrome)]
        b_old = Signal()        # b has waited its cycle: the flags below are its own
        m.d.sync += b_old.eq(b_v)
        p1 = Signal(PSN_BITS)
        m.d.comb += p1.eq(p + 1)
        kind = syndrome[5:7]
        code = syndrome[:5]
        is_ack = kind == AethKind.ACK
        is_seq = (kind == AethKind.NAK) & (code == NakCode.PSN_SEQUENCE_ERROR)
        is_fatal = (kind == AethKind.NAK) & (code != NakCode.PSN_SEQUENCE_ERROR)
        # What the ACK will do, per QP (one-hot: only the looked-up QP's can be set),
        # worked out in b's waiting cycle into registers from the QP's state then
        # (the control changes none of it in that cycle): the acting cycle only ANDs a
        # flop with the handshake.
        acks, fins, seqs, seq_clrs, fatals, bads = (
            Signal(nqp, name=n) for n in ("acks", "fins", "seqs", "seq_clrs", "fatals", "bads"))
        naks = Signal()         # a NAK a live QP acts on: counted
        live_any = []
        is_nak = kind == AethKind.NAK
        for i in range(nqp):
            du = psn_sub(m, p, una[i], f"d_una{i}")
            dh = psn_sub(m, p, hi[i], f"d_hi{i}")
            mine = (aq == i) & hit & b_src[i] & ~err[i]
            live = mine & active[i]
            # Outstanding: sent (before ``hi``) and not yet ACKed. Anything else is
            # dropped and counted, but a repeat ACK of the newest ACKed (una - 1).
            win = ~behind(du) & behind(dh)
            live_any.append(live & win)
            m.d.sync += [acks[i].eq(live & is_ack & win),
                         fins[i].eq(live & is_ack & win & (p1 == end[i])),
                         seqs[i].eq(live & is_seq & win),
                         seq_clrs[i].eq(live & is_seq & win & (du != 0)),
                         fatals[i].eq(live & is_fatal & win),
                         bads[i].eq(mine & ~(live & win) & (is_nak | (p1 != una[i])))]
        m.d.sync += naks.eq(Cat(*live_any).any() & is_nak)
        wrong = Signal()        # the looked-up QP's peer did not send it
        m.d.sync += wrong.eq(hit & ~b_src.bit_select(aq, 1))

        t = Signal(range(max(nqp, 2)))
        m.d.sync += t.eq(Mux(t == nqp - 1, 0, t + 1))

        # The control addresses a QP through one-hot registers (the ACK's, the timer
        # scan's, the descriptor's): a QP's flags are an AND-OR of flops and its
        # registers' enables a single bit, not a decoder after an 8:1 mux.
        def one_hot(index):
            return Cat(*(index == i for i in range(nqp)))

        def sel_hot(h, sigs, width, name):
            out = Signal(width, name=name)
            m.d.comb += out.eq(reduce(operator.or_,
                                      (sig & h[i].replicate(width) for i, sig in enumerate(sigs))))
            return out

        t_hot = Signal(nqp, init=1)     # t's one-hot twin, kept in step with it
        m.d.sync += t_hot.eq(Mux(t == nqp - 1, 1, t_hot << 1)[:nqp])
        t_una = sel_hot(t_hot, una, PSN_BITS, "t_una")
        t_retries = sel_hot(t_hot, retries, 8, "t_retries")
        t_expired = (t_hot & expired).any()
        # Each QP's "retries used up" is a flop written beside its retry count, then the
        # one-hot pick: a compare on the path (after the pick: 11.31 ns routed at
        # 1ebd86a; before it, from the count's flops: 10.04 ns at ab24a50) ran into
        # every send-pointer enable.
        at_max0 = int(self.max_retries == 0)
        maxed = [Signal(init=at_max0, name=f"maxed{i}") for i in range(nqp)]
        t_maxed = (t_hot & Cat(*maxed)).any()

        # A descriptor waits in a register stage, its QP one-hot; whether that QP can
        # take it is looked at live each cycle, as before.
        dsc = Signal.like(self.desc.payload)
        dv = Signal()
        dv_old = Signal()       # dv since last cycle: d_ok/d_busy below are its QP's
        dq_hot = Signal(nqp)
        dq_bad = Signal()
        npkts = Signal(PSN_BITS)
        taken = Signal()        # the control is done with the descriptor
        m.d.comb += self.desc.ready.eq(~dv)
        with m.If(taken):
            m.d.sync += dv.eq(0)
        with m.If(self.desc.valid & ~dv):
            dl = self.desc.payload.len
            m.d.sync += [dv.eq(1), dsc.eq(self.desc.payload),
                         dq_hot.eq(one_hot(self.desc.payload.qp)),
                         dq_bad.eq(self.desc.payload.qp >= nqp),
                         npkts.eq(Mux(dl == 0, 1, (dl + (self.mtu - 1)) >> self.log2mtu))]
        dq = dsc.qp
        # Registered, so a cycle old: a QP that just went idle is seen busy one more
        # cycle; one that just failed went idle in the same cycle, so it is seen busy
        # until its error shows. Nothing else makes a QP idle-and-ready.
        d_ok, d_busy = Signal(), Signal()
        m.d.sync += [dv_old.eq(dv & ~taken),
                     d_ok.eq(~dq_bad & (dq_hot & Cat(*[~err[i] & (state[i] == QPState.RTS)
                                                       for i in range(nqp)])).any()),
                     d_busy.eq((dq_hot & Cat(*active)).any())]
        d_next = sel_hot(dq_hot, end, PSN_BITS, "d_next")

        def on(sigs, h, value):
            for i, sig in enumerate(sigs):
                with m.If(h[i]):
                    m.d.sync += sig.eq(value)

        def complete(qp, status):
            m.d.sync += [self.cmpl.valid.eq(1), self.cmpl.payload.qp.eq(qp),
                         self.cmpl.payload.status.eq(status)]

        def set_retries(h, value):
            on(retries, h, value)
            on(maxed, h, value[:8] >= self.max_retries)

        def restart(h):
            for i in range(nqp):
                with m.If(h[i]):
                    m.d.comb += kick[i].eq(1)

        retries_total = [self.qp_sts[i].retries.value for i in range(nqp)]
        # Anything the control may change of a QP (for the issuer's PICK/CALC, see above).
        m.d.comb += ctl_event.eq(~self.cmpl.valid & ((b_v & b_old) | (~b_v & t_expired))
                                 | taken)
        with m.If(~self.cmpl.valid):
            with m.If(b_v & ~b_old):
                pass
            with m.Elif(b_v):
                m.d.sync += b_v.eq(0)
                with m.If(wrong):
                    sat_inc(m, self.wrong_source)
                with m.Elif(~hit):
                    sat_inc(m, self.bad_qpn)
                with m.If(naks):
                    sat_inc(m, self.naks_rx)
                with m.If(bads.any()):
                    sat_inc(m, self.ack_psn_invalid)
                # ACK in the window: acknowledged up to p, done when that is the end.
                on(una, acks, p1)
                set_retries(acks, Const(0, 8))
                restart(acks)
                on(active, fins, 0)
                with m.If(fins.any()):
                    complete(aq, Status.OK)
                # NAK PSN-sequence-error in the window: go back to p.
                on(una, seqs, p)
                on(send, seqs, p)
                restart(seqs)
                set_retries(seq_clrs, Const(0, 8))
                # Any other NAK: the QP fails.
                on(err, fatals, 1)
                on(active, fatals, 0)
                with m.If(fatals.any()):
                    complete(aq, Status.REMOTE_ACCESS)
            with m.Elif(t_expired):
                with m.If(t_maxed):
                    on(err, t_hot, 1)
                    on(active, t_hot, 0)
                    complete(t, Status.RETRY_EXCEEDED)
                with m.Else():
                    sat_inc(m, self.timeouts)
                    set_retries(t_hot, t_retries + 1)
                    on(send, t_hot, t_una)
                    restart(t_hot)
                for i in range(nqp):
                    with m.If(t_hot[i]):
                        sat_inc(m, retries_total[i])
            with m.Elif(dv & dv_old):
                with m.If(~d_ok):
                    m.d.comb += taken.eq(1)
                    complete(dq, Status.FLUSHED)
                with m.Elif(~d_busy):
                    m.d.comb += taken.eq(1)
                    on(active, dq_hot, 1)
                    on(laddr, dq_hot, dsc.laddr)
                    on(raddr, dq_hot, dsc.raddr)
                    on(rkey, dq_hot, dsc.rkey)
                    on(length, dq_hot, dsc.len)
                    on(imm, dq_hot, dsc.imm)
                    on(has_imm, dq_hot, dsc.has_imm)
                    for sigs in (first, send, una, hi):
                        on(sigs, dq_hot, d_next)
                    on(end, dq_hot, d_next + npkts)
                    set_retries(dq_hot, Const(0, 8))
                    restart(dq_hot)

        for i in range(nqp):
            # Software owns the context until it moves the QP to RTS (last: it wins).
            with m.If(state[i] < QPState.RTS):
                psn0 = self.qp_ctl[i].next_psn.value[:PSN_BITS]
                m.d.sync += [active[i].eq(0), err[i].eq(0), retries[i].eq(0), maxed[i].eq(at_max0),
                             first[i].eq(psn0), end[i].eq(psn0), send[i].eq(psn0),
                             una[i].eq(psn0), hi[i].eq(psn0)]
        return m
