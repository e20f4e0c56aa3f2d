"""The simple memory ports every datapath master speaks (the transport defined them):
a read request ``{addr, len}`` answered in order by a beat packet whose byte 0 is
``addr``, and write beats ``{addr, data, keep, last}``. The DMA turns them into bus
bursts; these multiplexers share one read and one write port among many masters."""

from __future__ import annotations

from amaranth.hdl import Module, Signal
from amaranth.lib import fifo, stream, wiring
from amaranth.lib.wiring import In, Out

from fpgaccl.hw.stream.beat import beat_stream
from fpgaccl.hw.stream.skid import SkidBuffer
from fpgaccl.hw.transport.layouts import MEM_READ_REQ, mem_write_layout

__all__ = ["MEM_READ_REQ", "ReadMux", "WriteMux", "channel_names", "mem_write_layout",
           "memory_ports"]


def channel_names(kind: str, n: int) -> list[str]:
    """Port names of ``n`` memory channels of a kind (``rd_req``, ``rd_resp``, ``wr``):
    ``rd_req``, ``rd_req1``, ... -- channel 0 keeps the one-port name."""
    return [kind if i == 0 else f"{kind}{i}" for i in range(n)]


def memory_ports(width: int, reads: int, writes: int) -> dict:
    """Signature members of ``reads`` read and ``writes`` write channels, as the master
    (a node) sees them; a memory takes them flipped."""
    members = {}
    for req, resp in zip(channel_names("rd_req", reads), channel_names("rd_resp", reads),
                         strict=True):
        members[req] = Out(stream.Signature(MEM_READ_REQ))
        members[resp] = In(beat_stream(width))
    for wr in channel_names("wr", writes):
        members[wr] = Out(stream.Signature(mem_write_layout(width)))
    return members


def _round_robin(m: Module, last: Signal, valids: list) -> tuple[Signal, Signal]:
    """The first valid requester after ``last`` (wrapping), and whether there is one."""
    n = len(valids)
    chosen = Signal(range(n))
    any_valid = Signal()
    for i in range(n):
        # Farthest candidates first: the nearest one after `last` is assigned last and wins.
        for k in reversed(range(n)):
            j = (i + 1 + k) % n
            with m.If((last == i) & valids[j]):
                m.d.comb += [chosen.eq(j), any_valid.eq(1)]
    return chosen, any_valid


class ReadMux(wiring.Component):
    """``n`` read masters onto one in-order read port.

    Requests are granted round-robin; the winner's index goes into a FIFO so each answer
    packet returns to whoever asked, in order. ``depth`` bounds the requests in flight.
    Each master's requests pass a skid buffer first, so the arbitration sees registered
    valids and a master sees a registered ready: a grant does not reach back into the
    logic that decides a master's next request.
    """

    def __init__(self, width: int, n: int, depth: int = 16) -> None:
        self.width, self.n, self.depth = width, n, depth
        members = {"req": Out(stream.Signature(MEM_READ_REQ)), "resp": In(beat_stream(width))}
        for i in range(n):
            members[f"req{i}"] = In(stream.Signature(MEM_READ_REQ))
            members[f"resp{i}"] = Out(beat_stream(width))
        super().__init__(members)

    def elaborate(self, platform) -> Module:
        m = Module()
        n = self.n
        m.submodules.order = order = fifo.SyncFIFOBuffered(width=max(1, (n - 1).bit_length()),
                                                           depth=self.depth)
        reqs = []
        for i in range(n):
            m.submodules[f"in{i}"] = skid = SkidBuffer(MEM_READ_REQ)
            wiring.connect(m, wiring.flipped(getattr(self, f"req{i}")), skid.i)
            reqs.append(skid.o)
        resps = [getattr(self, f"resp{i}") for i in range(n)]

        # Registered request output: hold a granted request until the port takes it.
        last = Signal(range(n))
        with m.If(self.req.valid & self.req.ready):
            m.d.sync += self.req.valid.eq(0)
        can_load = (~self.req.valid | self.req.ready) & order.w_rdy
        chosen, any_valid = _round_robin(m, last, [r.valid for r in reqs])
        with m.If(can_load), m.If(any_valid):
            for j in range(n):
                with m.If(chosen == j):
                    m.d.comb += reqs[j].ready.eq(1)
                    m.d.sync += self.req.payload.eq(reqs[j].payload)
            m.d.sync += [self.req.valid.eq(1), last.eq(chosen)]
            m.d.comb += [order.w_en.eq(1), order.w_data.eq(chosen)]

        # Answers go to the master at the head of the order FIFO.
        for j in range(n):
            with m.If(order.r_rdy & (order.r_data == j)):
                m.d.comb += [resps[j].valid.eq(self.resp.valid),
                             resps[j].payload.eq(self.resp.payload),
                             self.resp.ready.eq(resps[j].ready)]
        with m.If(self.resp.valid & self.resp.ready & self.resp.payload.last):
            m.d.comb += order.r_en.eq(1)
        return m


class WriteMux(wiring.Component):
    """``n`` write masters onto one write port, switching only between bursts (``last``)."""

    def __init__(self, width: int, n: int) -> None:
        self.width, self.n = width, n
        layout = mem_write_layout(width)
        members = {"wr": Out(stream.Signature(layout))}
        for i in range(n):
            members[f"wr{i}"] = In(stream.Signature(layout))
        super().__init__(members)

    def elaborate(self, platform) -> Module:
        m = Module()
        n = self.n
        ins = [getattr(self, f"wr{i}") for i in range(n)]
        owner = Signal(range(n))
        locked = Signal()
        pick, _ = _round_robin(m, owner, [w.valid for w in ins])
        cur = Signal(range(n))
        with m.If(locked):
            m.d.comb += cur.eq(owner)
        with m.Else():
            m.d.comb += cur.eq(pick)
        for j in range(n):
            with m.If(cur == j):
                m.d.comb += [self.wr.valid.eq(ins[j].valid), self.wr.payload.eq(ins[j].payload),
                             ins[j].ready.eq(self.wr.ready)]
        # Stay with a master from its first offered beat to its last accepted one, so the
        # output never withdraws a beat it has offered.
        with m.If(self.wr.valid):
            m.d.sync += [owner.eq(cur),
                         locked.eq(~(self.wr.ready & self.wr.payload.last))]
        return m
