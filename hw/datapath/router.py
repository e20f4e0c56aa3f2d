"""Turns sequencer commands into jobs for the copy and reduce engines and RDMA WRITEs
for the transport, and turns received messages back into sequencer events.

Addressing: the sequencer speaks elements in its four buffers; the router adds the
local buffer bases (``coll`` registers) or, for a SEND, the destination peer's buffer
base and rkey (``peer`` registers, filled at rendezvous). QP ``i`` talks to rank ``i``.
A GRANT is a zero-length WRITE whose immediate data has the grant bit set
(:data:`fpgaccl.proto.COLLECTIVE_IMM`) and whose RETH VA is the call's signature digest
(``ctx.sig``, 0: none; a zero-length WRITE's VA is not validated). A received GRANT whose
digest and ours are both non-zero and differ is no grant: the router latches the peer
and its digest (``mismatch``, until the next ``start``), so that nothing is ever sent to
that peer, and the sequencer stops the program (:attr:`StopCause.SIGNATURE`). A GRANT
that comes before its program's doorbell is compared when that program starts (see
:meth:`Router._receive`).

Commands are dispatched, not waited for: the sequencer moves on as soon as a command is
handed to its engine, so a SEND streams out while the next RECV_REDUCE runs. What keeps
the program's in-order meaning is a scoreboard of what is in flight -- one SEND (or
GRANT) per peer, as the transport runs one message per QP, until its completion; one
local COPY/RECV_REDUCE until its engine is done -- and the hazards it checks before
dispatch, on element ranges per buffer:

* a SEND waits while the local job writes what it would read (read after write);
* a COPY/RECV_REDUCE waits for the local job before it, and while a SEND in flight still
  reads what it would write (write after read; the transport re-reads memory for
  go-back-N until the peer acknowledged);
* a GRANT waits for everything in flight: it lets a peer overwrite a region, and says
  no range;
* ``idle`` (nothing in flight) is what the sequencer's DONE waits for.

Ranges are compared per buffer name. An in-place collective (IN and OUT at one address)
is safe with the library's programs: the only instructions that read IN while others
run read ranges no instruction writes before them (each rank's first SEND and first
reduction of a block).
"""

from __future__ import annotations

from amaranth.hdl import Array, Cat, Module, Mux, Signal
from amaranth.lib import data, stream, wiring
from amaranth.lib.wiring import In, Out

from fpgaccl.hw.net.layouts import header_layout
from fpgaccl.hw.sequencer.command import Command, Event
from fpgaccl.hw.transport.layouts import RECV_CMPL, WRITE_CMPL, WRITE_DESC
from fpgaccl.proto import COLLECTIVE_IMM
from fpgaccl.proto.isa import SeqOp
from fpgaccl.proto.reduce import DTYPE_BITS, OP_BITS, DType

from .engines import COPY_JOB, REDUCE_JOB

_IMM = header_layout(COLLECTIVE_IMM)
N_BUFS = 4


def context_layout(peers: int) -> data.StructLayout:
    return data.StructLayout({
        "base": data.ArrayLayout(64, N_BUFS),                      # local IN/OUT/TMP/TMP2
        "rbase": data.ArrayLayout(data.ArrayLayout(64, N_BUFS), peers),
        "rkey": data.ArrayLayout(data.ArrayLayout(32, N_BUFS), peers),
        "dtype": DTYPE_BITS,
        "op": OP_BITS,
        "sig": 64,                                                 # signature digest
    })


def element_shift(m: Module, dtype) -> Signal:
    """log2 of the element size of ``dtype``, from proto's table."""
    shift = Signal(3)
    with m.Switch(dtype):
        for d in DType:
            with m.Case(int(d)):
                m.d.comb += shift.eq((d.bits // 8).bit_length() - 1)
    return shift


class Router(wiring.Component):
    def __init__(self, peers: int, counter_bits: int = 8) -> None:
        self.peers = peers
        self.counter_bits = counter_bits
        super().__init__({
            "ctx": In(context_layout(peers)),
            "coll_id": In(16),
            "cmd": In(stream.Signature(Command)),
            "cmd_done": Out(1),
            "grant": Out(stream.Signature(Event)),
            "landed": Out(stream.Signature(Event)),
            "copy_job": Out(stream.Signature(COPY_JOB)),
            "copy_done": In(1),
            "reduce_job": Out(stream.Signature(REDUCE_JOB)),
            "reduce_done": In(1),
            "desc": Out(stream.Signature(WRITE_DESC)),
            "cmpl": In(stream.Signature(WRITE_CMPL)),
            "recv": In(stream.Signature(RECV_CMPL)),
            "idle": Out(1),
            "error": Out(1),
            "start": In(1),              # a program starts: forget the last mismatch
            "mismatch": Out(1),
            "mismatch_peer": Out(range(peers)),
            "mismatch_sig": Out(64),
            # peer p's count in bits [counter_bits * p, counter_bits * (p + 1)). Flat: an
            # ArrayLayout's `ahead[p]` wires broke yosys 0.70's abc9 (ABC_OPS_REINTEGRATE)
            "ahead": Out(counter_bits * peers),
        })

    def elaborate(self, platform) -> Module:
        m = Module()
        ctx = self.ctx
        shift = element_shift(m, ctx.dtype)
        c = Signal(Command)
        base = Array(ctx.base[i] for i in range(N_BUFS))
        rbase = Array(Array(ctx.rbase[p][i] for i in range(N_BUFS)) for p in range(self.peers))
        rkey = Array(Array(ctx.rkey[p][i] for i in range(N_BUFS)) for p in range(self.peers))

        m.d.sync += self.cmd_done.eq(0)
        for st in (self.copy_job, self.reduce_job, self.desc):
            with m.If(st.ready):
                m.d.sync += st.valid.eq(0)

        # The scoreboard: ranges in elements, [lo, hi) of buffer `buf`. `hi` is a
        # register loaded with the command (its add off the hazard tests' path).
        c_hi = Signal(33)
        lo, hi = c.offset, c_hi
        s_busy = Signal(self.peers)
        s_buf = Array(Signal(2, name=f"s_buf{p}") for p in range(self.peers))
        s_lo = Array(Signal(33, name=f"s_lo{p}") for p in range(self.peers))
        s_hi = Array(Signal(33, name=f"s_hi{p}") for p in range(self.peers))
        l_busy, l_buf, l_lo, l_hi = Signal(), Signal(2), Signal(33), Signal(33)

        def overlaps(buf_a, lo_a, hi_a, buf_b, lo_b, hi_b):
            return (buf_a == buf_b) & (lo_a < hi_b) & (lo_b < hi_a)

        # The hazard tests take a cycle of their own: `judged` says the registered range
        # overlaps below are those of the command now in `c` (it is 0 the cycle after a
        # command is taken). The ranges they compare change only when `c` is
        # dispatched, and a new command is taken only after that, so the overlaps
        # stay exact while `c` waits; the busy flags (cleared by completions) are
        # applied live.
        judged = Signal()
        o_raw = Signal()                    # c.src's range meets the local job's
        o_war = Signal(self.peers)          # c.dst's range meets peer p's SEND
        m.d.sync += [
            judged.eq(c.op != int(SeqOp.NOP)),
            o_raw.eq(overlaps(l_buf, l_lo, l_hi, c.src, lo, hi)),
            o_war.eq(Cat(overlaps(s_buf[p], s_lo[p], s_hi[p], c.dst, lo, hi)
                         for p in range(self.peers))),
        ]
        raw = l_busy & o_raw
        # c.peer one-hot, loaded with the command: the SEND's own busy flag and its
        # set are then an AND-OR and per-bit enables, not an 8:1 pick and a decode
        # (dispatch -> s_busy was 10.1 ns routed at a129e4e).
        c_hot = Signal(self.peers)
        war = (s_busy & o_war).any()
        desc_free = ~self.desc.valid
        m.d.comb += self.idle.eq(~s_busy.any() & ~l_busy & desc_free & ~self.copy_job.valid
                                 & ~self.reduce_job.valid & ~self.cmd.valid
                                 & (c.op == int(SeqOp.NOP)))

        # Completions free their peer's slot (one message per QP, in order).
        m.d.comb += self.cmpl.ready.eq(1)
        with m.If(self.cmpl.valid):
            m.d.sync += s_busy.bit_select(self.cmpl.payload.qp, 1).eq(0)
            with m.If(self.cmpl.payload.status != 0):
                m.d.sync += self.error.eq(1)
        with m.If(self.copy_done | self.reduce_done):
            m.d.sync += l_busy.eq(0)

        def take_local() -> None:
            m.d.sync += [l_busy.eq(1), l_buf.eq(c.dst), l_lo.eq(lo), l_hi.eq(hi),
                         self.cmd_done.eq(1), c.op.eq(int(SeqOp.NOP))]

        # The command's addresses, in two registered steps so that no cycle holds both a
        # wide pick and a 64-bit add: the buffer bases (a 4-way pick, and for a SEND
        # the 32-way pick of the peer's base and key) are registered as the command is
        # taken, from the sequencer's registered payload; the judged cycle adds the
        # offsets. Dispatch then only loads registers. `c` and the context hold still
        # while the command waits, so these stay its own.
        c_sends, c_grant = Signal(), Signal()   # c is a SEND or GRANT / a GRANT
        nbytes = Signal(33 + 7)
        p_src, p_dst, p_scr, p_raddr = (Signal(64, name=f"p_{n}")
                                        for n in ("src", "dst", "scr", "raddr"))
        a_src, a_dst, a_scr, a_raddr = (Signal(64, name=f"a_{n}")
                                        for n in ("src", "dst", "scr", "raddr"))
        a_rkey = Signal.like(ctx.rkey[0][0])
        m.d.sync += [
            nbytes.eq(c.length << shift),
            a_src.eq(p_src + (c.offset << shift)),
            a_dst.eq(p_dst + (c.offset << shift)),
            a_scr.eq(p_scr + (c.xoffset << shift)),
            # A GRANT's VA is the digest: picked here, a register ahead of dispatch.
            a_raddr.eq(Mux(c_grant, ctx.sig, p_raddr + (c.xoffset << shift))),
        ]
        # `c.op` is NOP while no command waits (commands never carry NOP).
        with m.If(c.op == int(SeqOp.NOP)):
            m.d.comb += self.cmd.ready.eq(1)
            with m.If(self.cmd.valid):
                nc = self.cmd.payload
                m.d.sync += [c.eq(nc), c_hi.eq(nc.offset + nc.length),
                             c_hot.eq(Cat(nc.peer == p for p in range(self.peers))),
                             p_src.eq(base[nc.src]), p_dst.eq(base[nc.dst]),
                             p_scr.eq(base[nc.scratch]),
                             p_raddr.eq(rbase[nc.peer][nc.dst]),
                             a_rkey.eq(rkey[nc.peer][nc.dst])]
        with m.Switch(c.op):
            with m.Case(int(SeqOp.NOP)):
                pass
            with m.Case(int(SeqOp.COPY)), m.If(judged & ~l_busy & ~war):
                m.d.sync += [
                    self.copy_job.payload.src.eq(a_src),
                    self.copy_job.payload.dst.eq(a_dst),
                    self.copy_job.payload.len.eq(nbytes),
                    self.copy_job.valid.eq(1)]
                take_local()
            with m.Case(int(SeqOp.RECV_REDUCE)), m.If(judged & ~l_busy & ~war):
                j = self.reduce_job.payload
                m.d.sync += [
                    j.a.eq(a_src), j.b.eq(a_scr), j.dst.eq(a_dst),
                    j.len.eq(nbytes), j.dtype.eq(ctx.dtype), j.op.eq(ctx.op),
                    self.reduce_job.valid.eq(1)]
                take_local()
            with m.Case(int(SeqOp.SEND), int(SeqOp.GRANT)):
                is_grant = c.op == int(SeqOp.GRANT)
                blocked = Mux(is_grant, s_busy.any() | l_busy, (s_busy & c_hot).any() | raw)
                with m.If(judged & desc_free & ~blocked):
                    d = self.desc.payload
                    imm = Signal(_IMM)
                    m.d.comb += [imm.coll_id.eq(self.coll_id), imm.step.eq(c.step),
                                 imm.grant.eq(is_grant)]
                    m.d.sync += [
                        d.qp.eq(c.peer),
                        d.laddr.eq(a_src), d.raddr.eq(a_raddr), d.rkey.eq(a_rkey),
                        d.len.eq(Mux(is_grant, 0, nbytes)),
                        d.imm.eq(imm.as_value()), d.has_imm.eq(1),
                        self.desc.valid.eq(1),
                        self.cmd_done.eq(1), c.op.eq(int(SeqOp.NOP))]
                    # Bit by bit: a completion may free another peer in this cycle.
                    for p in range(self.peers):
                        with m.If(c_hot[p]):
                            m.d.sync += s_busy[p].eq(1)
            with m.Default():
                m.d.sync += [self.error.eq(1), c.op.eq(int(SeqOp.NOP))]

        # A peer slot takes the waiting SEND's (or GRANT's) range from the cycle it is
        # judged, before its dispatch: the ranges are only read by the WAR tests of
        # COPY/RECV_REDUCE, and none is judged while this command waits (one command at
        # a time, in order), so the slot's old range is not needed once it comes. The
        # dispatch decision in these ~70 flops' enables per peer was the router's routed
        # worst (10.56 ns to `s_buf7` at 1ebd86a).
        # Both flags are loaded with the command and, like `c`'s fields, kept until the
        # next one: after the dispatch (`c.op` is NOP then) the slot reloads the same
        # range, a GRANT's still empty.
        with m.If((c.op == int(SeqOp.NOP)) & self.cmd.valid):
            new_op = self.cmd.payload.op
            m.d.sync += [c_sends.eq((new_op == int(SeqOp.SEND)) | (new_op == int(SeqOp.GRANT))),
                         c_grant.eq(new_op == int(SeqOp.GRANT))]
        for p in range(self.peers):
            with m.If(c_sends & c_hot[p]):
                m.d.sync += [s_buf[p].eq(c.src), s_lo[p].eq(lo),
                             s_hi[p].eq(Mux(c_grant, lo, hi))]

        self._receive(m)
        return m

    def _receive(self, m: Module) -> None:
        """Received messages become sequencer events (the sequencer always accepts), a
        cycle after a register stage that compares a GRANT's digest with ours in 16-bit
        parts and its coll_id with the running program's: no 64-bit compare or 16-bit
        subtraction on the event flops' inputs.

        A GRANT with a digest (VA != 0) is judged by its coll_id: this program's is
        compared now; one ahead (a peer already in a later segment or call, before
        our doorbell) is counted, and its digest compared after the next ``start``;
        one behind is a leftover of a call that failed, dropped. A program without a
        digest (send/recv, numbered apart) compares nothing and takes every other
        program's grant for one ahead. Once ``mismatch`` is
        latched, the rest of the call's grants and messages are dropped, and a message
        behind a checked program's coll_id too: nothing of a failed call may count for
        the next. ``ahead`` counts the grants for a later program since this one
        started: those the sequencer keeps when it stops on a mismatch."""
        ctx = self.ctx
        imm_in = data.View(_IMM, self.recv.payload.imm)
        r_valid, r_grant = Signal(), Signal()
        r_peer, r_step = Signal.like(self.recv.payload.qp), Signal.like(imm_in.step)
        r_va = Signal(64)
        r_ne, r_vz = Signal(4), Signal(4)       # per part: differs from ours / is zero
        r_d = Signal(16)                        # its coll_id - this program's
        sig_nz = Signal()                       # ours is not 0 (static while it runs)
        va = self.recv.payload.va
        m.d.comb += self.recv.ready.eq(1)
        m.d.sync += [
            r_valid.eq(self.recv.valid & self.recv.payload.has_imm),
            r_grant.eq(imm_in.grant), r_peer.eq(self.recv.payload.qp),
            r_step.eq(imm_in.step), r_va.eq(va),
            r_ne.eq(Cat(va[16 * i:16 * i + 16] != ctx.sig[16 * i:16 * i + 16]
                        for i in range(4))),
            r_vz.eq(Cat(va[16 * i:16 * i + 16] == 0 for i in range(4))),
            r_d.eq(imm_in.coll_id - self.coll_id),
            sig_nz.eq(ctx.sig != 0),
        ]
        same, behind = r_d == 0, r_d[15]
        digest = ~r_vz.all()

        # Digests of grants that came ahead of their program, and their count.
        e_sig = Array(Signal(64, name=f"e_sig{p}") for p in range(self.peers))
        e_pend = Signal(self.peers)
        e_ne = Array(Signal(4, name=f"e_ne{p}") for p in range(self.peers))
        for p in range(self.peers):
            m.d.sync += e_ne[p].eq(Cat(e_sig[p][16 * i:16 * i + 16]
                                       != ctx.sig[16 * i:16 * i + 16] for i in range(4)))
        ahead = Array(Signal(self.counter_bits, name=f"ahead{p}") for p in range(self.peers))
        m.d.comb += self.ahead.eq(Cat(ahead))

        def latch(peer, sig) -> None:
            with m.If(~self.mismatch):
                m.d.sync += [self.mismatch.eq(1), self.mismatch_peer.eq(peer),
                             self.mismatch_sig.eq(sig)]

        m.d.sync += [self.grant.valid.eq(0), self.landed.valid.eq(0)]
        for s in (self.grant, self.landed):
            m.d.sync += [s.payload.peer.eq(r_peer), s.payload.step.eq(r_step)]
        with m.If(r_valid):
            with m.If(~r_grant):
                m.d.sync += self.landed.valid.eq(~((sig_nz & behind) | (self.mismatch & same)))
            with m.Elif(~digest):
                m.d.sync += self.grant.valid.eq(1)
            with m.Elif(behind & sig_nz):
                pass
            with m.Elif(~same):
                m.d.sync += [self.grant.valid.eq(1), e_sig[r_peer].eq(r_va),
                             e_pend.bit_select(r_peer, 1).eq(1),
                             ahead[r_peer].eq(ahead[r_peer] + 1)]
            with m.Elif(self.mismatch):
                pass
            with m.Elif(sig_nz & r_ne.any()):
                latch(r_peer, r_va)
            with m.Else():
                m.d.sync += self.grant.valid.eq(1)

        # Of the peers whose early digest differs, the lowest is latched: one-hot, then an
        # AND-OR of the digests (not 8 nested latches: a priority chain per digest bit).
        e_bad = Signal(self.peers)                  # early digest differs from ours
        e_hot = Signal(self.peers)                  # e_bad's lowest set bit alone
        e_first = Signal.like(self.mismatch_peer)
        e_pick = Signal(64)
        m.d.comb += [
            e_bad.eq(Cat(e_pend[p] & e_ne[p].any() for p in range(self.peers))),
            e_hot.eq(Cat(e_bad[p] & ~e_bad[:p].any() for p in range(self.peers))),
            e_first.eq(Cat(Cat(e_hot[p] for p in range(self.peers) if p >> b & 1).any()
                           for b in range(len(e_first)))),
            e_pick.eq(Cat(Cat(e_sig[p][i] & e_hot[p] for p in range(self.peers)).any()
                          for i in range(64))),
        ]
        # The grants that came ahead are this program's from its start on: their digests
        # are compared a few cycles later (the compare registered, the doorbell's
        # coll_id settled), before the sequencer's first EXEC.
        started = Signal(4)
        m.d.sync += started.eq(Cat(self.start, started[:-1]))
        with m.If(self.start):
            m.d.sync += self.mismatch.eq(0)
        with m.If(started[-1]):
            m.d.sync += e_pend.eq(0)
            for p in range(self.peers):
                m.d.sync += ahead[p].eq(0)
            with m.If(sig_nz & e_bad.any()):
                latch(e_first, e_pick)
