"""RC responder: PSN check, in-order RDMA WRITE acceptance, memory-key protection, and
coalesced ACK / NAK generation. The gateware twin of the receive half of
:class:`fpgaccl.host.qp.QueuePair` (same drop reasons, same AETH syndromes and PSNs).

Per received header (from the parser, payload after it on ``data``):

* unknown or not-ready QPN: dropped, ``BAD_QPN``;
* an IPv4 source other than the QP's ``peer_ip``: dropped, ``WRONG_SOURCE`` (anyone can
  seal an ICRC; the UDP source port is RoCEv2's flow entropy, which a sender may vary
  per flow, so it is not part of the check);
* PSN behind the expected one: a retransmission, dropped (``PSN_DUPLICATE``) and an ACK
  of ``epsn - 1`` scheduled, so a requester whose ACK was lost learns how far we got;
* PSN ahead: dropped (``PSN_OUT_OF_ORDER``); one NAK PSN-sequence-error carrying the
  expected PSN per gap (``nak_sent`` suppresses repeats until an in-order packet);
* in order: a FIRST/ONLY looks its RETH rkey up in the region table (key, then
  remote-write right, then ``[va, va+dlen)`` inside the region); a failure is counted
  (``BAD_RKEY``/``ACCESS_DENIED``/``OUT_OF_BOUNDS``), writes nothing and NAKs
  remote-access-error. One of zero DMA length passes unchecked (IBTA: its R_Key and VA
  are not validated; a GRANT's VA is a signature digest). MIDDLE/LAST must continue an
  open message and may not overrun its ``dlen``; LAST/ONLY must end it exactly.
  Accepted payload streams to ``wr``.

ACKs are coalesced: accepted packets only set a per-QP "ACK owed" flag, raised by the
BTH AckReq bit (the requester sets it on a message's last packet and periodically), by
a duplicate, or every ``ack_every`` accepted packets; one ACK of the newest in-order PSN
answers all that piled up while the transmit port was busy.

An ACK (and the receive completion on ``cmpl``) covers a packet only once ``wr`` took
its last payload beat, so a requester's completion means memory has every byte: ACKs
carry ``done_psn`` (newest fully handed-over PSN), not ``epsn - 1``.

Simplifications (documented for the DMA/node issues): "handed to ``wr``" is the point of
no return (posted, in-order writes; the DMA must not reorder or fail them silently);
there is one protection domain (any QP may use any region: the register map's ``mr``
block has no PD/QP field, unlike the host model's per-QP ring); the address written is
the RETH virtual address itself (translation belongs behind ``wr``); the AETH MSN counts
messages whose last header was accepted, so it may lead the ACKed PSN by one message
(the host model ignores MSN).
"""

from __future__ import annotations

from amaranth.hdl import Cat, Const, Module, Mux, Signal
from amaranth.lib import data, stream, wiring
from amaranth.lib.wiring import In, Out

from fpgaccl.hw.stream.beat import beat_stream
from fpgaccl.proto.drops import DROP_COUNTER_BITS, DropReason
from fpgaccl.proto.headers import AETH
from fpgaccl.proto.opcodes import (
    ACK_CREDIT_INVALID,
    FIRST_OPCODES,
    LAST_OPCODES,
    ONLY_OPCODES,
    PSN_BITS,
    QPN_BITS,
    AethKind,
    NakCode,
    Opcode,
    aeth_syndrome,
)

from .common import behind, pick, psn_sub, qp_lookup, sat_inc
from .layouts import (
    HDR,
    RECV_CMPL,
    QPState,
    mem_write_layout,
    mr_ctl_layout,
    qp_ctl_layout,
)

MSN_BITS = AETH["msn"].bits
WRITE_OPS = {int(o) for o in Opcode if o.name.startswith("RDMA_WRITE")}
_FIRST = {int(o) for o in FIRST_OPCODES | ONLY_OPCODES} & WRITE_OPS
_END = {int(o) for o in LAST_OPCODES | ONLY_OPCODES} & WRITE_OPS
_IMM = {int(Opcode.RDMA_WRITE_LAST_WITH_IMMEDIATE), int(Opcode.RDMA_WRITE_ONLY_WITH_IMMEDIATE)}
ACK_SYNDROME = aeth_syndrome(AethKind.ACK, ACK_CREDIT_INVALID)
N_DROPS = len(DropReason)


def _in_set(m: Module, v, values, name: str) -> Signal:
    s = Signal(name=name)
    with m.Switch(v):
        for x in sorted(values):
            with m.Case(x):
                m.d.comb += s.eq(1)
    return s


class Responder(wiring.Component):
    """See the module docstring. ``hdr`` takes non-ACK headers only (the transport's
    receive router sends ACKs to the requester)."""

    def __init__(self, width: int, *, nqp: int = 8, nmr: int = 8, ack_every: int = 16) -> None:
        self.width = width
        self.nqp = nqp
        self.nmr = nmr
        self.ack_every = ack_every
        super().__init__({
            "hdr": In(stream.Signature(HDR)),
            "data": In(beat_stream(width)),
            "ack": Out(stream.Signature(HDR)),
            "wr": Out(stream.Signature(mem_write_layout(width))),
            "cmpl": Out(stream.Signature(RECV_CMPL)),
            "qp_ctl": In(qp_ctl_layout(nqp)),
            "mr_ctl": In(mr_ctl_layout(nmr)),
            "drops": Out(data.ArrayLayout(DROP_COUNTER_BITS, N_DROPS)),
            "accepted": Out(32),
            "acks_tx": Out(32),
            "naks_tx": Out(32),
        })

    def elaborate(self, platform) -> Module:
        m = Module()
        nqp, nmr, nbytes = self.nqp, self.nmr, self.width // 8

        # Per-QP responder context.
        def per_qp(width, name):
            return [Signal(width, name=f"{name}{i}") for i in range(nqp)]

        epsn, msn = per_qp(PSN_BITS, "epsn"), per_qp(MSN_BITS, "msn")
        nak_sent, ack_owed, nak_owed = per_qp(1, "nak_sent"), per_qp(1, "ack_owed"), per_qp(
            1, "nak_owed")
        nak_code, nak_psn = per_qp(5, "nak_code"), per_qp(PSN_BITS, "nak_psn")
        since = per_qp(16, "since_ack")
        # Newest PSN whose payload memory has taken: what an ACK may claim (epsn - 1
        # runs ahead of it while a packet's payload is still streaming).
        done = per_qp(PSN_BITS, "done_psn")
        w_open, w_va, w_rem = per_qp(1, "w_open"), per_qp(64, "w_va"), per_qp(32, "w_rem")
        m_va, m_len = per_qp(64, "m_va"), per_qp(32, "m_len")

        # ACK/NAK generator: round-robin over QPs owing one; a NAK goes before the ACK.
        # It comes first in this function so that, for the same flag in the same cycle,
        # the receive FSM's "set" below overrides its "clear" and no owed ACK is lost.
        # The payload is QP `a`'s, loaded whenever the output is free (it only counts
        # while valid), so only `valid` and the flags wait for the owed test: with the
        # test in every payload flop's enable it was the routed critical path at 243a10b
        # (10.8 ns, `a` -> (a == i) & owed[i] -> OR -> ~90 enables across the die).
        a = Signal(range(max(nqp, 2)))
        free = ~self.ack.valid | self.ack.ready
        out = self.ack.payload
        a_nak = pick(nak_owed, a, 1, m, "a_nak")
        a_owes = pick([ack_owed[i] | nak_owed[i] for i in range(nqp)], a, 1, m, "a_owes")
        with m.If(free):
            m.d.sync += [
                a.eq(Mux(a == nqp - 1, 0, a + 1)),
                self.ack.valid.eq(a_owes),
                out.bth.eq(0),
                out.bth.opcode.eq(Opcode.ACKNOWLEDGE),
                out.bth.pkey.eq(0xFFFF),
                out.bth.dqpn.eq(pick([c.remote_qpn.value[:QPN_BITS] for c in self.qp_ctl], a,
                                     QPN_BITS,
                                     m, "a_dqpn")),
                out.bth.psn.eq(Mux(a_nak, pick(nak_psn, a, PSN_BITS, m, "a_nak_psn"),
                                   pick(done, a, PSN_BITS, m, "a_done"))),
                out.reth.eq(0), out.immdt.eq(0),
                out.has_aeth.eq(1), out.has_reth.eq(0), out.has_immdt.eq(0),
                out.payload_len.eq(0),
                out.qp.eq(a),
                out.aeth.msn.eq(pick(msn, a, MSN_BITS, m, "a_msn")),
                out.aeth.syndrome.eq(Mux(
                    a_nak, Const(int(AethKind.NAK) << 5, 8) | pick(nak_code, a, 5, m, "a_code"),
                    ACK_SYNDROME)),
            ]
            with m.If(a_owes):
                with m.If(a_nak):
                    sat_inc(m, self.naks_tx)
                with m.Else():
                    sat_inc(m, self.acks_tx)
            for i in range(nqp):
                with m.If(a == i):
                    with m.If(nak_owed[i]):
                        m.d.sync += nak_owed[i].eq(0)
                    with m.Else():
                        m.d.sync += ack_owed[i].eq(0)

        # Header stage: one header waits here, with its QP and region lookups computed
        # from flops, while the previous packet's payload still streams.
        # The lookups are registered: a header is taken no sooner than the cycle after
        # the one it arrived in (``hq_new``), when they are its own. They read software's
        # context, which thus takes effect a cycle later than it did.
        hq = Signal(HDR)
        hq_v = Signal()
        hq_new = Signal()
        take = Signal()
        # Ready from the flop alone: the stage refills the cycle after a take. Ready
        # from `take` ran the whole CHECK verdict into the parser's header FIFO read
        # enable (10.6 ns routed at a129e4e), and a header spends two cycles in PICK
        # and CHECK anyway.
        m.d.comb += self.hdr.ready.eq(~hq_v)
        with m.If(take):
            m.d.sync += hq_v.eq(0)
        m.d.sync += hq_new.eq(self.hdr.valid & self.hdr.ready)
        # The region bounds test compares two sums, each in a register of its own: the
        # header's end (va + dlen, added as the header is taken in) and each region's
        # end (base + length, from software's context, a cycle behind it).
        hq_end = Signal(65)
        # IBTA: a zero-length WRITE's R_Key and VA are not validated (a GRANT carries
        # the call's signature digest in its VA); decided here, a flop ahead of CHECK.
        hq_zero = Signal()
        with m.If(self.hdr.valid & self.hdr.ready):
            m.d.sync += [hq.eq(self.hdr.payload), hq_v.eq(1),
                         hq_end.eq(self.hdr.payload.reth.va + self.hdr.payload.reth.dlen),
                         hq_zero.eq(self.hdr.payload.reth.dlen == 0)]

        hit_c, idx_c = qp_lookup(m, self.qp_ctl, nqp, hq.bth.dqpn, QPState.RTR, "rx_qp")
        hit, idx = Signal(), Signal.like(idx_c)
        # Every QP's peer address against the source, side by side with the lookup.
        src_v = Signal(nqp)
        m.d.sync += [hit.eq(hit_c), idx.eq(idx_c),
                     src_v.eq(Cat(*(self.qp_ctl[i].peer_ip.value == hq.src_ip
                                    for i in range(nqp))))]
        k_hit, k_right, k_bound = Signal(nmr), Signal(nmr), Signal(nmr)
        for j in range(nmr):
            mr = self.mr_ctl[j]
            base = Cat(mr.base_lo.value, mr.base_hi.value)
            mr_end = Signal(65, name=f"mr_end{j}")
            m.d.sync += [
                mr_end.eq(base + mr.length.value),
                k_hit[j].eq((mr.key.value == hq.reth.rkey) & (mr.length.value != 0)),
                k_right[j].eq(mr.access.remote_write),
                k_bound[j].eq((hq.reth.va >= base) & (hq_end <= mr_end)),
            ]
        # The first region whose key matches, one-hot: its rights and bounds are an
        # AND-OR of flops rather than a mux indexed by an encoded priority.
        first_hot = Signal(nmr)
        for j in range(nmr):
            m.d.comb += first_hot[j].eq(k_hit[j] & ~k_hit[:j].any() if j else k_hit[j])

        h = Signal(HDR)
        q_hit, q = Signal(), Signal(range(max(nqp, 2)))
        q_wrong = Signal()      # a live QP's, from another source: not q_hit
        key_ok, right_ok, bound_ok = Signal(), Signal(), Signal()
        # The opcode's classes are flops, decoded as the header is taken: CHECK's verdict
        # (the node's slowest path once routed) then starts from registers.
        is_write, is_first, is_end, is_imm = (Signal(name=n) for n in
                                              ("is_write", "is_first", "is_end", "is_imm"))
        hq_op = hq.bth.opcode
        classes = [(is_write, _in_set(m, hq_op, WRITE_OPS, "hq_is_write")),
                   (is_first, _in_set(m, hq_op, _FIRST, "hq_is_first")),
                   (is_end, _in_set(m, hq_op, _END, "hq_is_end")),
                   (is_imm, _in_set(m, hq_op, _IMM, "hq_is_imm"))]

        def take_next():
            """Move the waiting header (if any) into the check stage; returns nothing,
            sets the next state."""
            m.next = "IDLE"
            with m.If(hq_v & ~hq_new):
                m.d.comb += take.eq(1)
                src_ok = src_v.bit_select(idx, 1)
                m.d.sync += [h.eq(hq), q_hit.eq(hit & src_ok), q_wrong.eq(hit & ~src_ok),
                             q.eq(idx), key_ok.eq(k_hit.any() | hq_zero),
                             right_ok.eq((first_hot & k_right).any() | hq_zero),
                             bound_ok.eq((first_hot & k_bound).any() | hq_zero)]
                m.d.sync += [flag.eq(v) for flag, v in classes]
                m.next = "PICK"

        # PICK (the cycle after a header is taken) reads the QP's context through 8:1
        # muxes and works out the PSN distance and the length test into flops; CHECK
        # decides from those. Only CHECK writes these context fields, so they cannot
        # change in between.
        ctx = [(epsn, PSN_BITS, "epsn"), (nak_sent, 1, "nak_sent"), (w_open, 1, "open"),
               (w_va, 64, "va"), (w_rem, 32, "rem"), (m_va, 64, "mva"), (m_len, 32, "mlen"),
               (msn, MSN_BITS, "msn"), (since, 16, "since")]
        picked = {name: pick(sigs, q, w, m, f"pick_{name}") for sigs, w, name in ctx}
        cur = {name: Signal(w, name=f"cur_{name}") for _, w, name in ctx
               if name not in ("va", "rem")}       # those two go into va/rem below
        cur_epsn, cur_nak_sent, cur_open = cur["epsn"], cur["nak_sent"], cur["open"]
        cur_mva, cur_mlen, cur_msn, cur_since = cur["mva"], cur["mlen"], cur["msn"], cur["since"]
        # The PSN tests against every QP's expected PSN side by side, then the pick of
        # two bits: the 8:1 pick of a 24-bit PSN ahead of the subtraction and the
        # compare was the routed critical path at a129e4e (10.9 ns, q -> epsn pick ->
        # borrow chain -> `ooo`).
        dup_v, ooo_v = Signal(nqp), Signal(nqp)
        for i in range(nqp):
            m.d.comb += [dup_v[i].eq(behind(psn_sub(m, h.bth.psn, epsn[i], f"rx_d{i}"))),
                         ooo_v[i].eq(h.bth.psn != epsn[i])]
        n = h.payload_len
        p_rem = Signal(32)
        m.d.comb += p_rem.eq(Mux(is_first, h.reth.dlen, picked["rem"]))
        dup, ooo = Signal(), Signal()
        rem = Signal(32)
        va = Signal(64)
        len_bad = Signal()
        has_payload = h.payload_len != 0
        w_addr = Signal(64)

        def count(reason):
            sat_inc(m, self.drops[reason])

        q_hot = Signal(nqp)     # q one-hot, registered in PICK
        pre_ok = Signal()       # PICK's part of the accept verdict

        # CHECK decides, the cycle after commits: the verdict only sets per-QP strobes
        # (q_hot where the packet changes its QP's context), and each QP's context
        # registers are enabled by a strobe flop. With the verdict in the enables of the
        # ~2,400 context flops themselves, it was the routed critical path at 1ebd86a
        # (11.08 ns to `msn5`'s enable, 225 late inputs). The commit reads `h`, `va`,
        # `rem` and the `cur_*` flops, which hold until the next PICK, and that comes
        # no sooner than the cycle after the commit (see `after`).
        acc_hot, fin_hot, dup_hot, nak_hot, close_hot = (
            Signal(nqp, name=n) for n in ("acc_hot", "fin_hot", "dup_hot", "nak_hot",
                                          "close_hot"))
        k_code, k_psn = Signal(5), Signal(PSN_BITS)
        m.d.sync += [s.eq(0) for s in (acc_hot, fin_hot, dup_hot, nak_hot, close_hot)]

        def nak(code, psn):
            m.d.sync += [nak_hot.eq(q_hot), k_code.eq(code), k_psn.eq(psn)]

        def after(accept):
            # A packet without payload waits a cycle in IDLE before the next header is
            # taken, so that PICK never reads a context whose commit is still pending.
            with m.If(has_payload):
                m.next = "WRITE" if accept else "DRAIN"
            with m.Else():
                m.next = "IDLE"

        with m.If(self.cmpl.ready):
            m.d.sync += self.cmpl.valid.eq(0)
        wr_free = ~self.wr.valid | self.wr.ready
        with m.If(self.wr.ready):
            m.d.sync += self.wr.valid.eq(0)

        # ACK and receive completion only once the packet's last beat is in memory's
        # hands: a requester's completion must mean the bytes are placed.
        pend, pend_owe, pend_cmpl = Signal(), Signal(), Signal()
        pend_q = Signal(range(max(nqp, 2)))
        pend_psn = Signal(PSN_BITS)
        with m.If(pend & self.wr.valid & self.wr.ready & self.wr.payload.last):
            m.d.sync += [pend.eq(0), self.cmpl.valid.eq(pend_cmpl)]
            for i in range(nqp):
                with m.If(pend_q == i):
                    m.d.sync += done[i].eq(pend_psn)
                    with m.If(pend_owe):
                        m.d.sync += ack_owed[i].eq(1)

        # Whether an accepted packet owes an ACK (from flops that hold until the commit).
        owe = h.bth.ackreq | is_end
        if self.ack_every:
            owe = owe | (cur_since + 1 >= self.ack_every)

        def accept():
            """CHECK's accept: the packet is the next of its QP's WRITE and fits it."""
            sat_inc(m, self.accepted)
            m.d.sync += acc_hot.eq(q_hot)
            m.d.sync += [
                self.cmpl.payload.qp.eq(q),
                self.cmpl.payload.va.eq(Mux(is_first, h.reth.va, cur_mva)),
                self.cmpl.payload.len.eq(Mux(is_first, h.reth.dlen, cur_mlen)),
                self.cmpl.payload.imm.eq(h.immdt.imm),
                self.cmpl.payload.has_imm.eq(is_imm),
            ]
            with m.If(has_payload):
                m.d.sync += [pend.eq(1), pend_q.eq(q), pend_owe.eq(owe),
                             pend_cmpl.eq(is_end), pend_psn.eq(h.bth.psn)]
            with m.Else():
                m.d.sync += [fin_hot.eq(q_hot), self.cmpl.valid.eq(is_end)]
            m.d.sync += w_addr.eq(va)
            after(True)

        with m.FSM(name="rx"):
            with m.State("IDLE"):
                take_next()

            with m.State("PICK"):
                m.d.sync += [v.eq(picked[k]) for k, v in cur.items()]
                # Every test of CHECK's accept that does not need the PSN distance or
                # the length, into one flop: CHECK's accept is then a 4-input AND.
                m.d.sync += [
                    q_hot.eq(Cat(q == i for i in range(nqp))),
                    pre_ok.eq(q_hit & is_write & Mux(is_first, key_ok & right_ok & bound_ok,
                                                     picked["open"])),
                ]
                m.d.sync += [
                    dup.eq(dup_v.bit_select(q, 1)), ooo.eq(ooo_v.bit_select(q, 1)),
                    rem.eq(p_rem), va.eq(Mux(is_first, h.reth.va, picked["va"])),
                    # Both candidates' tests side by side, then the pick (not the
                    # pick, then a 32-bit compare).
                    len_bad.eq(Mux(is_first,
                                   (n > h.reth.dlen) | (is_end & (n != h.reth.dlen)),
                                   (n > picked["rem"]) | (is_end & (n != picked["rem"])))),
                ]
                m.next = "CHECK"

            # One receive-completion slot, registered, and one packet awaiting its
            # write: CHECK waits until both are free.
            with m.State("CHECK"), m.If(~self.cmpl.valid & ~pend):
                with m.If(pre_ok & ~dup & ~ooo & ~len_bad):
                    accept()
                with m.Elif(q_wrong):
                    count(DropReason.WRONG_SOURCE)
                    after(False)
                with m.Elif(~q_hit):
                    count(DropReason.BAD_QPN)
                    after(False)
                with m.Elif(~is_write):
                    count(DropReason.UNKNOWN_OPCODE)
                    after(False)
                with m.Elif(dup):
                    count(DropReason.PSN_DUPLICATE)
                    m.d.sync += dup_hot.eq(q_hot)
                    after(False)
                with m.Elif(ooo):
                    count(DropReason.PSN_OUT_OF_ORDER)
                    with m.If(~cur_nak_sent):
                        nak(NakCode.PSN_SEQUENCE_ERROR, cur_epsn)
                    after(False)
                with m.Elif(is_first & ~key_ok):
                    count(DropReason.BAD_RKEY)
                    nak(NakCode.REMOTE_ACCESS_ERROR, h.bth.psn)
                    after(False)
                with m.Elif(is_first & ~right_ok):
                    count(DropReason.ACCESS_DENIED)
                    nak(NakCode.REMOTE_ACCESS_ERROR, h.bth.psn)
                    after(False)
                with m.Elif(is_first & ~bound_ok):
                    count(DropReason.OUT_OF_BOUNDS)
                    nak(NakCode.REMOTE_ACCESS_ERROR, h.bth.psn)
                    after(False)
                with m.Elif(~is_first & ~cur_open):
                    # MIDDLE/LAST with no FIRST before it, as the host model treats it.
                    count(DropReason.ACCESS_DENIED)
                    nak(NakCode.INVALID_REQUEST, h.bth.psn)
                    after(False)
                with m.Elif(len_bad):
                    count(DropReason.OUT_OF_BOUNDS)
                    m.d.sync += close_hot.eq(q_hot)
                    nak(NakCode.REMOTE_ACCESS_ERROR, h.bth.psn)
                    after(False)
            with m.State("DRAIN"):
                m.d.comb += self.data.ready.eq(1)
                with m.If(self.data.valid & self.data.payload.last):
                    take_next()

            # Payload to memory through a one-entry pipeline register: full rate, and
            # ``wr`` is driven from flops only.
            with m.State("WRITE"):
                m.d.comb += self.data.ready.eq(wr_free)
                with m.If(self.data.valid & wr_free):
                    beat = self.data.payload
                    m.d.sync += [
                        self.wr.valid.eq(1),
                        self.wr.payload.addr.eq(w_addr),
                        self.wr.payload.data.eq(beat.data),
                        self.wr.payload.keep.eq(beat.keep),
                        self.wr.payload.last.eq(beat.last),
                        w_addr.eq(w_addr + nbytes),
                    ]
                    with m.If(beat.last):
                        take_next()

        # The commit of CHECK's verdict (see `acc_hot`), after the ACK generator: a set
        # of an owed flag overrides its clear in the same cycle.
        for i in range(nqp):
            with m.If(acc_hot[i]):
                m.d.sync += [epsn[i].eq(h.bth.psn + 1), nak_sent[i].eq(0),
                             w_va[i].eq(va + n), w_rem[i].eq(rem - n), w_open[i].eq(~is_end),
                             # The count restarts when an ACK is decided, not when it
                             # leaves.
                             since[i].eq(Mux(owe, 0, cur_since + 1))]
                with m.If(is_first):
                    m.d.sync += [m_va[i].eq(h.reth.va), m_len[i].eq(h.reth.dlen)]
                with m.If(is_end):
                    m.d.sync += msn[i].eq(cur_msn + 1)
            with m.If(fin_hot[i]):
                m.d.sync += done[i].eq(h.bth.psn)
                with m.If(owe):
                    m.d.sync += ack_owed[i].eq(1)
            with m.If(dup_hot[i]):
                m.d.sync += ack_owed[i].eq(1)
            with m.If(nak_hot[i]):
                m.d.sync += [nak_owed[i].eq(1), nak_code[i].eq(k_code), nak_psn[i].eq(k_psn),
                             nak_sent[i].eq(1)]
            with m.If(close_hot[i]):
                m.d.sync += w_open[i].eq(0)

        for i in range(nqp):
            # Software owns the context until it moves the QP to RTR (last: it wins).
            with m.If(self.qp_ctl[i].state.state < QPState.RTR):
                psn0 = self.qp_ctl[i].expected_psn.value[:PSN_BITS]
                m.d.sync += [epsn[i].eq(psn0), done[i].eq(psn0 - 1), msn[i].eq(0),
                             nak_sent[i].eq(0), ack_owed[i].eq(0), nak_owed[i].eq(0),
                             w_open[i].eq(0), since[i].eq(0)]
        return m
