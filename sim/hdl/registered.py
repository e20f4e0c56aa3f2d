"""A simulation top that registers every input of the design it wraps.

Verilator evaluates, on every ``eval()`` (cocotb calls it at both clock edges), all the
combinational logic that depends on a top-level input, because it cannot know which
inputs changed. Amaranth's comb logic depends on the domain's reset almost everywhere,
and a testbench bus (CSR, backdoor) reaches deep into the design, so in the four-node
cluster about two thirds of the simulation time went to that input-combinational pass
(measured with ``perf``: 39% of samples in ``_ico_`` functions against 18% in the
clocked ``_nba_`` ones). Behind this wrapper the inputs reach the design only through
registers, and the design runs in a domain whose reset is a register too, so its logic
is evaluated once per rising edge.

Plain input ports get one register stage (one cycle of latency); stream ports get a
small FIFO in each direction, so the handshake stays a handshake. Output ports pass
straight through.
"""

from __future__ import annotations

from amaranth.hdl import ClockDomain, ClockSignal, DomainRenamer, Module, ResetSignal, Signal
from amaranth.lib import fifo, stream, wiring
from amaranth.lib.wiring import In


class RegisteredInputs(wiring.Component):
    def __init__(self, inner: wiring.Component, *, fifo_depth: int = 4) -> None:
        self.inner = inner
        self.fifo_depth = fifo_depth
        super().__init__(inner.signature)

    def elaborate(self, platform) -> Module:
        m = Module()
        m.domains.core = core = ClockDomain("core", local=True)
        rst = Signal(init=1, reset_less=True)
        m.d.sync += rst.eq(ResetSignal())
        m.d.comb += [core.clk.eq(ClockSignal()), core.rst.eq(rst)]
        m.submodules.inner = DomainRenamer("core")(self.inner)

        streams = set()
        for name, member in self.signature.members.items():
            if not (member.is_signature and isinstance(member.signature, stream.Signature)):
                continue
            streams.add(name)
            outer, inner = getattr(self, name), getattr(self.inner, name)
            width = len(outer.payload.as_value())
            q = fifo.SyncFIFOBuffered(width=width, depth=self.fifo_depth)
            m.submodules[f"q_{name}"] = DomainRenamer("core")(q)
            src, dst = (outer, inner) if member.flow == In else (inner, outer)
            m.d.comb += [q.w_data.eq(src.payload), q.w_en.eq(src.valid),
                         src.ready.eq(q.w_rdy),
                         dst.payload.eq(q.r_data), dst.valid.eq(q.r_rdy),
                         q.r_en.eq(dst.ready)]

        ours = self.signature.flatten(self)
        theirs = self.inner.signature.flatten(self.inner)
        for (path, member, outer), (_, _, inner) in zip(ours, theirs, strict=True):
            if path[0] in streams:
                continue
            if member.flow == In:
                reg = Signal.like(outer, reset_less=True, name="r_" + "_".join(map(str, path)))
                m.d.sync += reg.eq(outer)
                m.d.comb += inner.eq(reg)
            else:
                m.d.comb += outer.eq(inner)
        return m
