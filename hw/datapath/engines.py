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

from amaranth.hdl import Module, Signal
from amaranth.lib import data, fifo, stream, wiring
from amaranth.lib.wiring import In, Out

from fpgaccl.hw.reduce.unit import ReduceUnit
from fpgaccl.hw.stream.beat import beat_layout, beat_stream
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
    """Issues one read request per segment of a job on ``port``."""

    def __init__(self, m: Module, port, seg_bytes: int, name: str) -> None:
        self.base = Signal(64, name=f"{name}_base")
        self.len = Signal(32, name=f"{name}_len")
        self.issued = Signal(32, name=f"{name}_issued")
        self.port = port
        self.remaining = self.len - self.issued
        self.seg = seg_bytes
        m.d.comb += port.payload.addr.eq(self.base + self.issued)
        with m.If(self.remaining > seg_bytes):
            m.d.comb += port.payload.len.eq(seg_bytes)
        with m.Else():
            m.d.comb += port.payload.len.eq(self.remaining)

    def load(self, m: Module, base, length) -> None:
        m.d.sync += [self.base.eq(base), self.len.eq(length), self.issued.eq(0)]

    def issue(self, m: Module, enable) -> None:
        m.d.comb += self.port.valid.eq(enable & (self.issued < self.len))
        with m.If(self.port.valid & self.port.ready):
            m.d.sync += self.issued.eq(self.issued + self.port.payload.len)


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
        dst = Signal(64)
        moved = Signal(32)
        busy = Signal()
        m.d.sync += self.done.eq(0)
        m.d.comb += self.job.ready.eq(~busy)
        with m.If(self.job.valid & ~busy):
            seg.load(m, self.job.payload.src, self.job.payload.len)
            m.d.sync += [dst.eq(self.job.payload.dst), moved.eq(0)]
            with m.If(self.job.payload.len == 0):
                m.d.sync += self.done.eq(1)
            with m.Else():
                m.d.sync += busy.eq(1)
        seg.issue(m, busy)

        nbytes = _popcount(m, self.rd_resp.payload.keep)
        m.d.comb += [
            self.wr.valid.eq(self.rd_resp.valid & busy),
            self.wr.payload.addr.eq(dst + moved),
            self.wr.payload.data.eq(self.rd_resp.payload.data),
            self.wr.payload.keep.eq(self.rd_resp.payload.keep),
            self.wr.payload.last.eq(self.rd_resp.payload.last),
            self.rd_resp.ready.eq(self.wr.ready & busy),
        ]
        with m.If(self.wr.valid & self.wr.ready):
            m.d.sync += moved.eq(moved + nbytes)
            with m.If(moved + nbytes == seg.len):
                m.d.sync += [busy.eq(0), self.done.eq(1)]
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
        dst = Signal(64)
        moved = Signal(32)
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
            m.d.sync += [dst.eq(j.dst), moved.eq(0), dtype.eq(j.dtype), op.eq(j.op)]
            with m.If(j.len == 0):
                m.d.sync += self.done.eq(1)
            with m.Else():
                m.d.sync += busy.eq(1)

        if self.read_ports == 2:
            seg_a.issue(m, busy)
            seg_b.issue(m, busy)
            wiring.connect(m, wiring.flipped(self.rd_resp), alu.a)
            wiring.connect(m, wiring.flipped(self.rd_resp_b), alu.b)
        else:
            self._share_port(m, alu, busy, seg_a, seg_b, req_a, req_b)

        nbytes = _popcount(m, alu.o.payload.keep)
        m.d.comb += [
            self.wr.valid.eq(alu.o.valid),
            self.wr.payload.addr.eq(dst + moved),
            self.wr.payload.data.eq(alu.o.payload.data),
            self.wr.payload.keep.eq(alu.o.payload.keep),
            self.wr.payload.last.eq(alu.o.payload.last),
            alu.o.ready.eq(self.wr.ready),
        ]
        with m.If(self.wr.valid & self.wr.ready):
            m.d.sync += moved.eq(moved + nbytes)
            with m.If(moved + nbytes == seg_a.len):
                m.d.sync += [busy.eq(0), self.done.eq(1)]
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

        # Answers alternate too: even packets are `a` (to the buffer), odd ones `b`.
        resp_is_b = Signal()
        with m.If(self.rd_resp.valid & self.rd_resp.ready & self.rd_resp.payload.last):
            m.d.sync += resp_is_b.eq(~resp_is_b)
        with m.If(resp_is_b):
            m.d.comb += [alu.b.valid.eq(self.rd_resp.valid), alu.b.payload.eq(self.rd_resp.payload),
                         self.rd_resp.ready.eq(alu.b.ready)]
        with m.Else():
            m.d.comb += [abuf.w_en.eq(self.rd_resp.valid), abuf.w_data.eq(self.rd_resp.payload),
                         self.rd_resp.ready.eq(abuf.w_rdy)]
        m.d.comb += [alu.a.valid.eq(abuf.r_rdy), alu.a.payload.eq(abuf.r_data),
                     abuf.r_en.eq(alu.a.ready)]
        a_beat = data.View(beat_layout(w), abuf.r_data)
        m.d.comb += a_done_seg.eq(abuf.r_rdy & alu.a.ready & a_beat.last)
