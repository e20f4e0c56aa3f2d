"""N sequencers, each with its own program memory, in one design: the multi-rank top a
cocotb bench drives with a Python datapath and network (sim/benches/sequencer_array.py).
One build serves every world size up to ``ranks``; unused ranks are never started."""

from __future__ import annotations

from amaranth.hdl import Module
from amaranth.lib import memory, stream, wiring
from amaranth.lib.wiring import In, Out

from fpgaccl.hw.sequencer.command import ELEM_BITS, Command, Event
from fpgaccl.hw.sequencer.engine import Sequencer


class SequencerArray(wiring.Component):
    def __init__(self, ranks: int = 8, imem_words: int = 512) -> None:
        self.ranks = ranks
        self.imem_words = imem_words
        members = {
            "load_rank": In(range(ranks)), "load_addr": In(range(imem_words)),
            "load_data": In(32), "load_en": In(1),
            "start": In(ranks), "count": In(ELEM_BITS), "coll_id": In(16),
            "busy": Out(ranks), "error": Out(ranks), "done": Out(ranks),
        }
        for r in range(ranks):
            members[f"cmd{r}"] = Out(stream.Signature(Command))
            members[f"cmd_done{r}"] = In(1)
            members[f"grant{r}"] = In(stream.Signature(Event))
            members[f"landed{r}"] = In(stream.Signature(Event))
        super().__init__(members)

    def elaborate(self, platform) -> Module:
        m = Module()
        for r in range(self.ranks):
            m.submodules[f"mem{r}"] = mem = memory.Memory(shape=32, depth=self.imem_words,
                                                          init=[])
            wr, rd = mem.write_port(), mem.read_port()
            m.submodules[f"seq{r}"] = seq = Sequencer(imem_words=self.imem_words,
                                                      peers=self.ranks)
            m.d.comb += [
                wr.addr.eq(self.load_addr), wr.data.eq(self.load_data),
                wr.en.eq(self.load_en & (self.load_rank == r)),
                rd.addr.eq(seq.imem_raddr), seq.imem_rdata.eq(rd.data),
                seq.start.eq(self.start[r]), seq.entry.eq(0), seq.count.eq(self.count),
                seq.coll_id.eq(self.coll_id), seq.cmd_done.eq(getattr(self, f"cmd_done{r}")),
                self.busy[r].eq(seq.busy), self.error[r].eq(seq.error),
                self.done[r].eq(seq.done),
            ]
            wiring.connect(m, wiring.flipped(getattr(self, f"cmd{r}")), seq.cmd)
            wiring.connect(m, seq.grant, wiring.flipped(getattr(self, f"grant{r}")))
            wiring.connect(m, seq.landed, wiring.flipped(getattr(self, f"landed{r}")))
        return m
