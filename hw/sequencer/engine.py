"""The sequencer engine: fetches 64-bit instructions from program memory, resolves chunk
numbers to element ranges, waits on per-peer grant/message counters, and hands data
movement to the datapath as :class:`~.command.Command`s.

Per-peer counters suffice (no tag matching CAM) because RC delivers a peer's messages
in order and every library program consumes them in that order; the sequencer model
(:mod:`fpgaccl.sim.models.sequencer`) rejects programs that would not.
"""

from __future__ import annotations

from amaranth.hdl import Cat, Module, Mux, Signal
from amaranth.lib import data, stream, wiring
from amaranth.lib.wiring import In, Out

from fpgaccl.hw.net.layouts import header_layout
from fpgaccl.proto.isa import INSTRUCTION, WORDS_PER_INSTRUCTION, SeqOp
from fpgaccl.proto.regmap import StopCause

from .command import ELEM_BITS, Command, Event
from .divider import CeilDivider

_INSTR = header_layout(INSTRUCTION)
CS_SPLIT = 17  # `cs` is multiplied in two parts, each within one 18x18 DSP block


ErrorCode = StopCause


class Sequencer(wiring.Component):
    def __init__(self, *, imem_words: int = 512, peers: int = 8, counter_bits: int = 8):
        self.imem_words = imem_words
        self.peers = peers
        self.counter_bits = counter_bits
        super().__init__({
            # program memory read port (the CSR bank's imem block), 1-cycle latency
            "imem_raddr": Out(range(imem_words)),
            "imem_rdata": In(32),
            # doorbell: start the program at instruction `entry` over `count` elements
            "start": In(1),
            "entry": In(16),
            "coll_id": In(16),
            "count": In(ELEM_BITS),
            "cmd": Out(stream.Signature(Command)),
            "cmd_done": In(1),
            # the datapath has nothing in flight: DONE waits for it (a datapath that
            # finishes each command before cmd_done leaves it at 1)
            "drained": In(1, init=1),
            "grant": In(stream.Signature(Event)),
            "landed": In(stream.Signature(Event)),
            # a peer granted with another signature (the router's latch): no further
            # instruction runs; one GRANT goes to that peer (`abort_peer`), so that it
            # sees our digest even where the program had not granted it yet; then the
            # program stops once the datapath has drained, its grant counters
            # reloaded with `keep_grants` (those for later programs) and its message
            # counters cleared: nothing of it counts for the next
            "abort": In(1),
            "abort_peer": In(range(peers)),
            "keep_grants": In(counter_bits * peers),     # flat, as Router.ahead
            "busy": Out(1),
            "done": Out(1),           # one-cycle pulse at DONE
            "error": Out(1),
            "error_code": Out(4),
            "pc": Out(16),
        })

    def elaborate(self, platform) -> Module:
        m = Module()
        m.submodules.div = div = CeilDivider(ELEM_BITS, 16)
        n_peers = self.peers
        cb = self.counter_bits

        # Events from the transport are counted as they arrive; the program consumes them.
        grants = Signal(data.ArrayLayout(cb, n_peers))
        landed = Signal(data.ArrayLayout(cb, n_peers))
        take_grant = Signal()
        take_landed = Signal()
        m.d.comb += [self.grant.ready.eq(1), self.landed.ready.eq(1)]

        ins = Signal(_INSTR)
        lo_word = Signal(32)
        pc = Signal(16)
        count = Signal(ELEM_BITS)
        coll_id = Signal(16)
        cs = Signal(ELEM_BITS + 1)       # elements per chunk
        nchunks = Signal(16)
        first = Signal(ELEM_BITS + 9)
        last = Signal(ELEM_BITS + 9)
        xoff = Signal(ELEM_BITS + 9)
        clamp_first = Signal(ELEM_BITS)  # first and last clamped to the count
        clamp_last = Signal(ELEM_BITS)
        cs_lo, cs_hi = cs[:CS_SPLIT], cs[CS_SPLIT:]
        k_last = Signal(9)
        m.d.comb += k_last.eq(ins.chunk + ins.count)
        p_first, p_last, p_xoff = ([Signal(len(k_last) + CS_SPLIT, name=f"p_{n}{i}")
                                    for i in range(2)] for n in ("first", "last", "xoff"))
        in_range = Signal()              # chunk + count <= nchunks, from RANGE
        m.d.comb += self.pc.eq(pc)

        peer_ok = ins.peer < n_peers
        for i in range(n_peers):
            g_inc = self.grant.valid & (self.grant.payload.peer == i)
            l_inc = self.landed.valid & (self.landed.payload.peer == i)
            g_dec = take_grant & (ins.peer == i)
            l_dec = take_landed & (ins.peer == i)
            m.d.sync += [grants[i].eq(grants[i] + g_inc - g_dec),
                         landed[i].eq(landed[i] + l_inc - l_dec)]
        grant_ready = Signal()
        landed_ready = Signal()
        m.d.comb += [grant_ready.eq(grants[ins.peer] != 0),
                     landed_ready.eq(landed[ins.peer] != 0)]

        m.d.sync += self.done.eq(0)
        cmd = self.cmd.payload
        told = Signal()      # the mismatched peer has had its GRANT
        with m.If(self.cmd.valid & self.cmd.ready):
            m.d.sync += self.cmd.valid.eq(0)

        def fail(code: int) -> None:
            m.d.sync += [self.error.eq(1), self.error_code.eq(code)]
            m.next = "IDLE"

        def issue(op: SeqOp) -> None:
            m.d.sync += [
                cmd.op.eq(int(op)), cmd.peer.eq(ins.peer), cmd.src.eq(ins.src),
                cmd.dst.eq(ins.rbuf if op is SeqOp.SEND else ins.buf), cmd.scratch.eq(ins.rbuf),
                cmd.offset.eq(clamp_first), cmd.length.eq(clamp_last - clamp_first),
                cmd.xoffset.eq(xoff), cmd.step.eq(ins.step), cmd.coll_id.eq(coll_id),
                self.cmd.valid.eq(1),
            ]
            m.next = "WAIT_DONE"

        with m.FSM():
            with m.State("IDLE"):
                m.d.comb += self.busy.eq(0)
                with m.If(self.start):
                    m.d.sync += [pc.eq(self.entry), count.eq(self.count), told.eq(0),
                                 coll_id.eq(self.coll_id), self.error.eq(0),
                                 self.error_code.eq(0), nchunks.eq(0)]
                    m.next = "FETCH_LO"
            with m.State("FETCH_LO"):
                m.d.comb += self.busy.eq(1)
                with m.If(pc >= self.imem_words // WORDS_PER_INSTRUCTION):
                    fail(ErrorCode.RUNAWAY)
                with m.Else():
                    m.d.comb += self.imem_raddr.eq(pc * WORDS_PER_INSTRUCTION)
                    m.next = "FETCH_HI"
            with m.State("FETCH_HI"):
                m.d.comb += [self.busy.eq(1),
                             self.imem_raddr.eq(pc * WORDS_PER_INSTRUCTION + 1)]
                m.d.sync += lo_word.eq(self.imem_rdata)
                m.next = "DECODE"
            with m.State("DECODE"):
                m.d.comb += self.busy.eq(1)
                m.d.sync += [ins.eq(Cat(lo_word, self.imem_rdata)), pc.eq(pc + 1)]
                m.next = "RANGE"
            with m.State("RANGE"):
                # Chunk numbers -> element offsets, a cycle each for the multiplies (each
                # chunk number times both halves of `cs`, one DSP block apiece), their
                # sums, and the clamp to the count: a DSP and the adders behind it in one
                # cycle were among the node's slowest paths on the ECP5.
                m.d.comb += self.busy.eq(1)
                # The chunk-range test too, into a register: EXEC's command enables then
                # do not wait for its add and compare.
                m.d.sync += [p_first[0].eq(ins.chunk * cs_lo), p_first[1].eq(ins.chunk * cs_hi),
                             p_last[0].eq(k_last * cs_lo), p_last[1].eq(k_last * cs_hi),
                             p_xoff[0].eq(ins.xchunk * cs_lo), p_xoff[1].eq(ins.xchunk * cs_hi),
                             in_range.eq(k_last <= nchunks)]
                m.next = "OFFSETS"
            with m.State("OFFSETS"):
                m.d.comb += self.busy.eq(1)
                m.d.sync += [first.eq(p_first[0] + (p_first[1] << CS_SPLIT)),
                             last.eq(p_last[0] + (p_last[1] << CS_SPLIT)),
                             xoff.eq(p_xoff[0] + (p_xoff[1] << CS_SPLIT))]
                m.next = "CLAMP"
            with m.State("CLAMP"):
                m.d.comb += self.busy.eq(1)
                m.d.sync += [clamp_first.eq(Mux(first > count, count, first)),
                             clamp_last.eq(Mux(last > count, count, last))]
                m.next = "EXEC"
            with m.State("EXEC"):
                m.d.comb += self.busy.eq(1)
                with m.If(self.abort & ~told):
                    m.d.sync += [cmd.eq(0), cmd.op.eq(int(SeqOp.GRANT)),
                                 cmd.peer.eq(self.abort_peer), cmd.coll_id.eq(coll_id),
                                 self.cmd.valid.eq(1), told.eq(1)]
                    m.next = "WAIT_DONE"
                with m.Elif(self.abort & self.drained):
                    fail(ErrorCode.SIGNATURE)
                    m.d.sync += [grants.eq(self.keep_grants), landed.eq(0)]
                with m.Elif(~self.abort), m.Switch(ins.op):
                    with m.Case(int(SeqOp.NOP)):
                        m.next = "FETCH_LO"
                    with m.Case(int(SeqOp.SETUP)):
                        with m.If(ins.step == 0):
                            fail(ErrorCode.BAD_SETUP)
                        with m.Else():
                            m.d.comb += [div.start.eq(1), div.dividend.eq(count),
                                         div.divisor.eq(ins.step)]
                            m.d.sync += nchunks.eq(ins.step)
                            m.next = "DIVIDE"
                    with m.Case(int(SeqOp.COPY)):
                        with m.If(~in_range):
                            fail(ErrorCode.CHUNK_RANGE)
                        with m.Else():
                            issue(SeqOp.COPY)
                    with m.Case(int(SeqOp.GRANT)):
                        with m.If(~peer_ok):
                            fail(ErrorCode.PEER_RANGE)
                        with m.Else():
                            issue(SeqOp.GRANT)
                    with m.Case(int(SeqOp.SEND)):
                        with m.If(~in_range | ~peer_ok):
                            fail(Mux(peer_ok, ErrorCode.CHUNK_RANGE, ErrorCode.PEER_RANGE))
                        with m.Elif(grant_ready):
                            m.d.comb += take_grant.eq(1)
                            issue(SeqOp.SEND)
                    with m.Case(int(SeqOp.RECV)):
                        with m.If(~peer_ok):
                            fail(ErrorCode.PEER_RANGE)
                        with m.Elif(landed_ready):
                            m.d.comb += take_landed.eq(1)
                            m.next = "FETCH_LO"
                    with m.Case(int(SeqOp.RECV_REDUCE)):
                        with m.If(~in_range | ~peer_ok):
                            fail(Mux(peer_ok, ErrorCode.CHUNK_RANGE, ErrorCode.PEER_RANGE))
                        with m.Elif(landed_ready):
                            m.d.comb += take_landed.eq(1)
                            issue(SeqOp.RECV_REDUCE)
                    with m.Case(int(SeqOp.DONE)), m.If(self.drained):
                        m.d.sync += self.done.eq(1)
                        m.next = "IDLE"
                    with m.Default():
                        fail(ErrorCode.BAD_OP)
            with m.State("DIVIDE"):
                m.d.comb += self.busy.eq(1)
                with m.If(~div.busy):
                    m.d.sync += cs.eq(div.quotient)
                    m.next = "FETCH_LO"
            with m.State("WAIT_DONE"):
                m.d.comb += self.busy.eq(1)
                with m.If(self.cmd_done):
                    m.next = "FETCH_LO"
        return m
