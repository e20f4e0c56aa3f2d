"""Local data movers of the node: copy (``dst = src``) and reduce
(``dst = a op b``), each a job of byte addresses and a length, spoken to memory through
the simple read/write ports of :mod:`.memport`.

Jobs are cut into segments of ``seg_bytes`` (one read request each). With one read
port (``read_ports=1``) answers come back in request order, so the reduce engine buffers
a whole segment of ``a`` before it asks for the matching segment of ``b``: otherwise
``a``'s answer would wait for ``b``'s, queued behind it (deadlock); a reduction then
takes two read beats per result beat. With two (``read_ports=2``, a node on a
multi-channel memory) ``a`` and ``b`` stream side by side into the ALU: one result beat
per cycle, no buffer.
"""

from __future__ import annotations

from amaranth.hdl import Module, Mux, Signal
from amaranth.lib import data, fifo, stream, wiring
from amaranth.lib.wiring import In, Out

from fpgaccl.hw.reduce.unit import ReduceUnit
from fpgaccl.hw.stream.beat import beat_layout, beat_stream
from fpgaccl.hw.stream.skid import SkidBuffer
from fpgaccl.proto.reduce import DTYPE_BITS, OP_BITS

from .memport import MEM_READ_REQ, mem_write_layout

COPY_JOB = data.StructLayout({"src": 64, "dst": 64, "len": 32})
REDUCE_JOB = data.StructLayout({"a": 64, "b": 64, "dst": 64, "len": 32,
                                "dtype": DTYPE_BITS, "op": OP_BITS})


def _popcount(m: Module, bits) -> Signal:
    out = Signal(range(len(bits) + 1))
    m.d.comb += out.eq(sum(bits[i] for i in range(len(bits))))
    return out


class _Segmenter:
    """Issues one read request per segment of a job on ``port``.

    The request (address, length) and whether one is due are registers, updated when
    a request is taken: what the read multiplexer sees of a segmenter, and what its
    grant drives back, is no deeper than a register and an enable."""

    def __init__(self, m: Module, port, seg_bytes: int, name: str) -> None:
        self.len = Signal(32, name=f"{name}_len")
        self.addr = Signal(64, name=f"{name}_addr")     # of the next request
        # Of the bytes not yet asked for (``left``): left - seg_bytes (meaningful while
        # ``big``), left > seg_bytes, left != 0 and min(left, seg_bytes). A request
        # takes seg_bytes while ``big`` (then the new left is ``lms``, and the new flags
        # compare ``lms`` itself, a register) and all of them otherwise.
        self.lms = Signal(32, name=f"{name}_lms")
        self.big = Signal(name=f"{name}_big")
        self.more = Signal(name=f"{name}_more")
        self.next = Signal(32, name=f"{name}_next")
        self.port = port
        self.seg = seg_bytes
        m.d.comb += [port.payload.addr.eq(self.addr), port.payload.len.eq(self.next)]

    def _set_left(self, m: Module, left) -> None:
        big = left > self.seg
        m.d.sync += [self.lms.eq(left - self.seg), self.big.eq(big), self.more.eq(left != 0),
                     self.next.eq(Mux(big, self.seg, left))]

    def load(self, m: Module, base, length) -> None:
        m.d.sync += [self.addr.eq(base), self.len.eq(length)]
        self._set_left(m, length)

    def issue(self, m: Module, enable) -> None:
        m.d.comb += self.port.valid.eq(enable & self.more)
        with m.If(self.port.valid & self.port.ready):
            m.d.sync += self.addr.eq(self.addr + self.next)
            with m.If(self.big):
                self._set_left(m, self.lms)
            with m.Else():
                m.d.sync += [self.big.eq(0), self.more.eq(0), self.next.eq(0)]


def _write_out(m: Module, width: int, name: str):
    """A skid buffer in front of an engine's write port: what the write multiplexer's
    grant drives back into the engine starts at a register. Its beats carry ``fin``
    (the job's last beat), so ``done`` follows the beat out of the buffer, when memory
    has taken it, not into it."""
    layout = data.StructLayout({"w": mem_write_layout(width), "fin": 1})
    m.submodules[name] = skid = SkidBuffer(layout)
    return skid


def _drain(m: Module, out, wr, busy, done) -> None:
    """``out``'s beats onto the engine's write port; the job ends with its ``fin`` beat."""
    m.d.comb += [wr.valid.eq(out.o.valid), wr.payload.eq(out.o.payload.w),
                 out.o.ready.eq(wr.ready)]
    with m.If(out.o.valid & out.o.ready & out.o.payload.fin):
        m.d.sync += [busy.eq(0), done.eq(1)]


class CopyEngine(wiring.Component):
    def __init__(self, width: int, seg_bytes: int = 4096) -> None:
        self.width, self.seg_bytes = width, seg_bytes
        super().__init__({
            "job": In(stream.Signature(COPY_JOB)),
            "done": Out(1),
            "rd_req": Out(stream.Signature(MEM_READ_REQ)),
            "rd_resp": In(beat_stream(width)),
            "wr": Out(stream.Signature(mem_write_layout(width))),
        })

    def elaborate(self, platform) -> Module:
        m = Module()
        seg = _Segmenter(m, self.rd_req, self.seg_bytes, "rd")
        out = _write_out(m, self.width, "out")
        dst = Signal(64)
        moved = Signal(32)
        todo = Signal(32)       # bytes of the job not yet passed to the write buffer
        busy = Signal()
        m.d.sync += self.done.eq(0)
        m.d.comb += self.job.ready.eq(~busy)
        with m.If(self.job.valid & ~busy):
            seg.load(m, self.job.payload.src, self.job.payload.len)
            m.d.sync += [dst.eq(self.job.payload.dst), moved.eq(0),
                         todo.eq(self.job.payload.len)]
            with m.If(self.job.payload.len == 0):
                m.d.sync += self.done.eq(1)
            with m.Else():
                m.d.sync += busy.eq(1)
        seg.issue(m, busy)

        # Answers come in through a skid buffer too: the byte count of a beat (and the
        # byte counters after it) starts at a register, not at the read multiplexer.
        m.submodules.inp = inp = SkidBuffer(beat_layout(self.width))
        wiring.connect(m, wiring.flipped(self.rd_resp), inp.i)
        resp = inp.o
        nbytes = _popcount(m, resp.payload.keep)
        w = out.i
        m.d.comb += [
            w.valid.eq(resp.valid & busy),
            w.payload.w.addr.eq(dst + moved),
            w.payload.w.data.eq(resp.payload.data),
            w.payload.w.keep.eq(resp.payload.keep),
            w.payload.w.last.eq(resp.payload.last),
            w.payload.fin.eq(todo == nbytes),
            resp.ready.eq(w.ready & busy),
        ]
        with m.If(w.valid & w.ready):
            m.d.sync += [moved.eq(moved + nbytes), todo.eq(todo - nbytes)]
        _drain(m, out, self.wr, busy, self.done)
        return m


class ReduceEngine(wiring.Component):
    def __init__(self, width: int, seg_bytes: int = 4096, *, dtypes=None, ops=None,
                 read_ports: int = 1) -> None:
        if seg_bytes % (width // 8):
            raise ValueError("segments must be whole beats")
        if read_ports not in (1, 2):
            raise ValueError(f"read_ports: 1 (a and b share a port) or 2, not {read_ports}")
        self.width, self.seg_bytes, self.read_ports = width, seg_bytes, read_ports
        self.dtypes, self.ops = dtypes, ops   # the ALU's subset (None: all)
        self.seg_beats = seg_bytes // (width // 8)
        second = {}
        if read_ports == 2:
            second = {"rd_req_b": Out(stream.Signature(MEM_READ_REQ)),
                      "rd_resp_b": In(beat_stream(width))}
        super().__init__({
            "job": In(stream.Signature(REDUCE_JOB)),
            "done": Out(1),
            "rd_req": Out(stream.Signature(MEM_READ_REQ)),
            "rd_resp": In(beat_stream(width)),
            **second,
            "wr": Out(stream.Signature(mem_write_layout(width))),
        })

    def elaborate(self, platform) -> Module:
        m = Module()
        w = self.width
        m.submodules.alu = alu = ReduceUnit(w, dtypes=self.dtypes, ops=self.ops)
        if self.read_ports == 2:
            req_a, req_b = self.rd_req, self.rd_req_b
        else:
            req_a = stream.Signature(MEM_READ_REQ).flip().create()
            req_b = stream.Signature(MEM_READ_REQ).flip().create()
        seg_a = _Segmenter(m, req_a, self.seg_bytes, "a")
        seg_b = _Segmenter(m, req_b, self.seg_bytes, "b")
        out = _write_out(m, w, "out")
        dst = Signal(64)
        moved = Signal(32)
        todo = Signal(32)       # result bytes not yet passed to the write buffer
        busy = Signal()
        dtype = Signal(DTYPE_BITS)
        op = Signal(OP_BITS)
        m.d.comb += [alu.dtype.eq(dtype), alu.op.eq(op)]
        m.d.sync += self.done.eq(0)
        m.d.comb += self.job.ready.eq(~busy)
        with m.If(self.job.valid & ~busy):
            j = self.job.payload
            seg_a.load(m, j.a, j.len)
            seg_b.load(m, j.b, j.len)
            m.d.sync += [dst.eq(j.dst), moved.eq(0), todo.eq(j.len), dtype.eq(j.dtype),
                         op.eq(j.op)]
            with m.If(j.len == 0):
                m.d.sync += self.done.eq(1)
            with m.Else():
                m.d.sync += busy.eq(1)

        if self.read_ports == 2:
            seg_a.issue(m, busy)
            seg_b.issue(m, busy)
            # Answers enter the ALU from registers: its first stage (exponent compare
            # and add) is deep enough on its own.
            for name, resp, operand in (("in_a", self.rd_resp, alu.a),
                                        ("in_b", self.rd_resp_b, alu.b)):
                m.submodules[name] = skid = SkidBuffer(beat_layout(w))
                wiring.connect(m, wiring.flipped(resp), skid.i)
                wiring.connect(m, skid.o, operand)
        else:
            self._share_port(m, alu, busy, seg_a, seg_b, req_a, req_b)

        nbytes = _popcount(m, alu.o.payload.keep)
        o = out.i
        m.d.comb += [
            o.valid.eq(alu.o.valid),
            o.payload.w.addr.eq(dst + moved),
            o.payload.w.data.eq(alu.o.payload.data),
            o.payload.w.keep.eq(alu.o.payload.keep),
            o.payload.w.last.eq(alu.o.payload.last),
            o.payload.fin.eq(todo == nbytes),
            alu.o.ready.eq(o.ready),
        ]
        with m.If(o.valid & o.ready):
            m.d.sync += [moved.eq(moved + nbytes), todo.eq(todo - nbytes)]
        _drain(m, out, self.wr, busy, self.done)
        return m

    def _share_port(self, m: Module, alu, busy, seg_a, seg_b, req_a, req_b) -> None:
        """``a`` and ``b`` over the one in-order read port (see the module docstring)."""
        w = self.width
        # Two segments of `a`: one being reduced, the next arriving.
        m.submodules.abuf = abuf = fifo.SyncFIFOBuffered(width=beat_layout(w).size,
                                                         depth=2 * self.seg_beats)
        # Requests strictly alternate a_i, b_i; at most two `a` segments are pending
        # (asked for and not yet reduced), which is what the buffer holds.
        turn_b = Signal()
        a_pending = Signal(2)
        a_done_seg = Signal()
        seg_a.issue(m, busy & ~turn_b & (a_pending < 2))
        seg_b.issue(m, busy & turn_b)
        a_taken = req_a.valid & req_a.ready
        with m.If(a_taken):
            m.d.sync += turn_b.eq(1)
        with m.If(req_b.valid & req_b.ready):
            m.d.sync += turn_b.eq(0)
        m.d.sync += a_pending.eq(a_pending + a_taken - a_done_seg)
        with m.If(turn_b):
            m.d.comb += [self.rd_req.valid.eq(req_b.valid), self.rd_req.payload.eq(req_b.payload),
                         req_b.ready.eq(self.rd_req.ready)]
        with m.Else():
            m.d.comb += [self.rd_req.valid.eq(req_a.valid), self.rd_req.payload.eq(req_a.payload),
                         req_a.ready.eq(self.rd_req.ready)]

        # Answers alternate too: even packets are `a` (to the buffer), odd ones `b`. They
        # pass a skid buffer first, and `a` another one after the buffer's block RAM, so
        # the ALU's operands are registers and the ALU's stall reaches no RAM enable.
        m.submodules.in_b = resp = SkidBuffer(beat_layout(w))
        m.submodules.in_a = in_a = SkidBuffer(beat_layout(w))
        wiring.connect(m, wiring.flipped(self.rd_resp), resp.i)
        resp_is_b = Signal()
        with m.If(resp.o.valid & resp.o.ready & resp.o.payload.last):
            m.d.sync += resp_is_b.eq(~resp_is_b)
        m.d.comb += [alu.b.payload.eq(resp.o.payload), abuf.w_data.eq(resp.o.payload)]
        with m.If(resp_is_b):
            m.d.comb += [alu.b.valid.eq(resp.o.valid), resp.o.ready.eq(alu.b.ready)]
        with m.Else():
            m.d.comb += [abuf.w_en.eq(resp.o.valid), resp.o.ready.eq(abuf.w_rdy)]
        m.d.comb += [in_a.i.valid.eq(abuf.r_rdy), in_a.i.payload.eq(abuf.r_data),
                     abuf.r_en.eq(in_a.i.ready)]
        wiring.connect(m, in_a.o, alu.a)
        m.d.comb += a_done_seg.eq(alu.a.valid & alu.a.ready & alu.a.payload.last)
