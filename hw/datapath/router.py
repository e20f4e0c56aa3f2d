"""Turns sequencer commands into jobs for the copy and reduce engines and RDMA WRITEs
for the transport, and turns received messages back into sequencer events.

Addressing: the sequencer speaks elements in its four buffers; the router adds the
local buffer bases (``coll`` registers) or, for a SEND, the destination peer's buffer
base and rkey (``peer`` registers, filled at rendezvous). QP ``i`` talks to rank ``i``.
A GRANT is a zero-length WRITE whose immediate data has the grant bit set
(:data:`fpgaccl.proto.COLLECTIVE_IMM`).
"""

from __future__ import annotations

from amaranth.hdl import Array, Module, Mux, Signal
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
    def __init__(self, peers: int) -> None:
        self.peers = peers
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
            "error": Out(1),
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
        for s in (self.copy_job, self.reduce_job, self.desc):
            with m.If(s.ready):
                m.d.sync += s.valid.eq(0)

        nbytes = c.length << shift
        with m.FSM():
            with m.State("IDLE"):
                m.d.comb += self.cmd.ready.eq(1)
                with m.If(self.cmd.valid):
                    m.d.sync += c.eq(self.cmd.payload)
                    m.next = "DISPATCH"
            with m.State("DISPATCH"), m.Switch(c.op):
                with m.Case(int(SeqOp.COPY)):
                    m.d.sync += [
                        self.copy_job.payload.src.eq(base[c.src] + (c.offset << shift)),
                        self.copy_job.payload.dst.eq(base[c.dst] + (c.offset << shift)),
                        self.copy_job.payload.len.eq(nbytes),
                        self.copy_job.valid.eq(1)]
                    m.next = "WAIT_COPY"
                with m.Case(int(SeqOp.RECV_REDUCE)):
                    j = self.reduce_job.payload
                    m.d.sync += [
                        j.a.eq(base[c.src] + (c.offset << shift)),
                        j.b.eq(base[c.scratch] + (c.xoffset << shift)),
                        j.dst.eq(base[c.dst] + (c.offset << shift)),
                        j.len.eq(nbytes), j.dtype.eq(ctx.dtype), j.op.eq(ctx.op),
                        self.reduce_job.valid.eq(1)]
                    m.next = "WAIT_REDUCE"
                with m.Case(int(SeqOp.SEND), int(SeqOp.GRANT)):
                    d = self.desc.payload
                    is_grant = c.op == int(SeqOp.GRANT)
                    imm = Signal(_IMM)
                    m.d.comb += [imm.coll_id.eq(self.coll_id), imm.step.eq(c.step),
                                 imm.grant.eq(is_grant)]
                    m.d.sync += [
                        d.qp.eq(c.peer),
                        d.laddr.eq(base[c.src] + (c.offset << shift)),
                        d.raddr.eq(rbase[c.peer][c.dst] + (c.xoffset << shift)),
                        d.rkey.eq(rkey[c.peer][c.dst]),
                        d.len.eq(Mux(is_grant, 0, nbytes)),
                        d.imm.eq(imm.as_value()), d.has_imm.eq(1),
                        self.desc.valid.eq(1)]
                    m.next = "WAIT_CMPL"
                with m.Default():
                    m.d.sync += self.error.eq(1)
                    m.next = "IDLE"
            with m.State("WAIT_COPY"), m.If(self.copy_done):
                m.d.sync += self.cmd_done.eq(1)
                m.next = "IDLE"
            with m.State("WAIT_REDUCE"), m.If(self.reduce_done):
                m.d.sync += self.cmd_done.eq(1)
                m.next = "IDLE"
            with m.State("WAIT_CMPL"):
                m.d.comb += self.cmpl.ready.eq(1)
                with m.If(self.cmpl.valid):
                    with m.If(self.cmpl.payload.status != 0):
                        m.d.sync += self.error.eq(1)
                    m.d.sync += self.cmd_done.eq(1)
                    m.next = "IDLE"

        # Received messages become sequencer events (the sequencer always accepts).
        imm_in = data.View(_IMM, self.recv.payload.imm)
        m.d.comb += self.recv.ready.eq(1)
        m.d.sync += [self.grant.valid.eq(0), self.landed.valid.eq(0)]
        with m.If(self.recv.valid & self.recv.payload.has_imm):
            for s in (self.grant, self.landed):
                m.d.sync += [s.payload.peer.eq(self.recv.payload.qp),
                             s.payload.step.eq(imm_in.step)]
            with m.If(imm_in.grant):
                m.d.sync += self.grant.valid.eq(1)
            with m.Else():
                m.d.sync += self.landed.valid.eq(1)
        return m
