"""A node's memory as hardware: serves the node's simple memory ports (read requests
answered in order with byte 0 of the first beat at the requested address, write beats
with an address and byte mask) at one beat per cycle after a fixed latency, on one or
more independent channels, plus a word-wide backdoor port for the testbench to fill and
read buffers.

Unaligned accesses are handled as a DMA engine would: every beat touches two
neighbouring words, through two read and two write ports.
"""

from __future__ import annotations

from pathlib import Path

from amaranth.hdl import Cat, ClockSignal, Const, Instance, Module, Mux, Signal
from amaranth.lib import memory, wiring
from amaranth.lib.wiring import In, Out

from fpgaccl.hw.datapath.memport import channel_names, memory_ports

RAM_VERILOG = Path(__file__).with_name("sim_ram.v")
"""Source of the Verilog RAM; a Verilator build of a design using
``SimMemory(verilog_ram=True)`` passes it as an extra source."""


class _Port:
    """Just the signals the access logic below drives, for either RAM flavour."""

    def __init__(self, aw: int, width: int, nb: int, name: str) -> None:
        self.addr = Signal(aw, name=f"{name}_addr")
        self.data = Signal(width, name=f"{name}_data")
        self.en = Signal(nb, name=f"{name}_en")


class SimMemory(wiring.Component):
    """``reads``/``writes`` independent channels share the storage, each at one beat
    per cycle: a multi-channel memory (HBM pseudo-channels, separate banks) for a node
    whose datapath masters each have their own port. Channels never wait for each
    other; writers of one word in one cycle are the designer's bug, as in hardware.

    ``verilog_ram`` puts the storage in :data:`RAM_VERILOG` (for Verilator builds of
    large memories); otherwise it is an Amaranth memory (for Amaranth's simulator)."""

    def __init__(self, width: int, size: int, latency: int = 8, *,
                 verilog_ram: bool = False, reads: int = 1, writes: int = 1) -> None:
        if size & (size - 1):
            raise ValueError("memory size must be a power of two")
        if reads < 1 or writes < 1:
            raise ValueError(f"reads/writes: at least one channel each, not {reads}/{writes}")
        self.verilog_ram = verilog_ram
        self.width, self.size, self.latency = width, size, latency
        self.reads, self.writes = reads, writes
        self.nbytes = width // 8
        self.depth = size // self.nbytes
        members = {k: m.flip() for k, m in memory_ports(width, reads, writes).items()}
        super().__init__({
            **members,
            # backdoor: word address, whole-word writes, reads one cycle later
            "bd_addr": In(range(self.depth)),
            "bd_wdata": In(width),
            "bd_we": In(1),
            "bd_rdata": Out(width),
        })

    def elaborate(self, platform) -> Module:
        m = Module()
        nb, w = self.nbytes, self.width
        aw = (self.depth - 1).bit_length()
        # Two RAM ports per channel: every beat touches two neighbouring words.
        wports = [_Port(aw, w, nb, f"wr{i}") for i in range(2 * self.writes)]
        rports = [_Port(aw, w, 1, f"rd{i}") for i in range(2 * self.reads)]
        bd_rd, bd_wr = _Port(aw, w, 1, "bd_rd"), _Port(aw, w, 1, "bd_wr")
        if self.verilog_ram:
            m.submodules.ram = Instance(
                "fpgaccl_sim_ram", p_WIDTH=w, p_AW=aw, p_NR=len(rports), p_NW=len(wports),
                i_clk=ClockSignal(),
                i_ra=Cat(*(r.addr for r in rports)), i_re=Cat(*(r.en for r in rports)),
                o_rd=Cat(*(r.data for r in rports)),
                i_wa=Cat(*(p.addr for p in wports)), i_we=Cat(*(p.en for p in wports)),
                i_wd=Cat(*(p.data for p in wports)),
                i_bra=bd_rd.addr, o_brd=bd_rd.data,
                i_bwa=bd_wr.addr, i_bwe=bd_wr.en, i_bwd=bd_wr.data)
        else:
            m.submodules.ram = ram = memory.Memory(shape=w, depth=self.depth, init=[])
            for mine in [*wports, bd_wr]:
                port = ram.write_port(granularity=8 if mine is not bd_wr else None)
                m.d.comb += [port.addr.eq(mine.addr), port.data.eq(mine.data),
                             port.en.eq(mine.en)]
            for mine in [*rports, bd_rd]:
                port = ram.read_port()
                m.d.comb += [port.addr.eq(mine.addr), mine.data.eq(port.data)]
                if mine is not bd_rd:
                    m.d.comb += port.en.eq(mine.en)

        m.d.comb += [bd_rd.addr.eq(self.bd_addr), self.bd_rdata.eq(bd_rd.data),
                     bd_wr.addr.eq(self.bd_addr), bd_wr.data.eq(self.bd_wdata),
                     bd_wr.en.eq(self.bd_we)]
        for i, name in enumerate(channel_names("wr", self.writes)):
            self._write_channel(m, getattr(self, name), *wports[2 * i:2 * i + 2])
        for i, (req, resp) in enumerate(zip(channel_names("rd_req", self.reads),
                                            channel_names("rd_resp", self.reads),
                                            strict=True)):
            self._read_channel(m, getattr(self, req), getattr(self, resp),
                               *rports[2 * i:2 * i + 2], name=f"ch{i}")
        return m

    def _write_channel(self, m: Module, wr, lo: _Port, hi: _Port) -> None:
        """Shift the beat to its byte offset and split it over two words."""
        nb, w = self.nbytes, self.width
        lg = (nb - 1).bit_length()
        p = wr.payload
        off = p.addr[:lg]
        word = p.addr[lg:]
        shifted = Signal(2 * w, name=f"{lo.addr.name}_shifted")
        mask = Signal(2 * nb, name=f"{lo.addr.name}_mask")
        m.d.comb += [shifted.eq(p.data << (off * 8)), mask.eq(p.keep << off), wr.ready.eq(1)]
        m.d.comb += [lo.addr.eq(word), lo.data.eq(shifted[:w]),
                     hi.addr.eq(word + 1), hi.data.eq(shifted[w:])]
        m.d.comb += [lo.en.eq(mask[:nb] & wr.valid.replicate(nb)),
                     hi.en.eq(mask[nb:] & wr.valid.replicate(nb))]

    def _read_channel(self, m: Module, req, resp, lo: _Port, hi: _Port, *, name: str) -> None:
        """One beat per cycle; each beat reads words k and k+1 and shifts."""
        nb, w = self.nbytes, self.width
        lg = (nb - 1).bit_length()
        addr = Signal(64, name=f"{name}_addr")
        left = Signal(17, name=f"{name}_left")
        first = Signal(name=f"{name}_first")
        active = Signal(name=f"{name}_active")
        advance = Signal(name=f"{name}_advance")
        m.d.comb += req.ready.eq(~active)
        with m.If(req.valid & ~active):
            m.d.sync += [addr.eq(req.payload.addr), left.eq(req.payload.len),
                         first.eq(1), active.eq(req.payload.len != 0)]
        # Pipeline: stage 0 issues the RAM reads, then `latency` register stages.
        m.d.comb += [lo.addr.eq(addr[lg:]), hi.addr.eq(addr[lg:] + 1)]
        s_valid = Signal(name=f"{name}_s_valid")
        s_off = Signal(lg, name=f"{name}_s_off")
        s_keep = Signal(nb, name=f"{name}_s_keep")
        s_first = Signal(name=f"{name}_s_first")
        s_last = Signal(name=f"{name}_s_last")
        is_last = left <= nb
        with m.If(advance):
            m.d.sync += [s_valid.eq(active), s_off.eq(addr[:lg]), s_first.eq(first),
                         s_last.eq(is_last),
                         s_keep.eq(Mux(left >= nb, (1 << nb) - 1,
                                       (Const(1, nb + 1) << left[:lg + 1]) - 1))]
            with m.If(active):
                m.d.sync += [addr.eq(addr + nb), left.eq(left - nb), first.eq(0)]
                with m.If(is_last):
                    m.d.sync += [active.eq(0), left.eq(0)]
        data_now = Signal(w, name=f"{name}_data_now")
        m.d.comb += data_now.eq(Cat(lo.data, hi.data) >> (s_off * 8))
        beat = Cat(data_now, s_keep, s_first, s_last)
        valid = s_valid
        for i in range(self.latency):
            r = Signal(len(beat), name=f"{name}_beat_d{i}")
            v = Signal(name=f"{name}_valid_d{i}")
            with m.If(advance):
                m.d.sync += [r.eq(beat), v.eq(valid)]
            beat, valid = r, v
        m.d.comb += [advance.eq(~valid | resp.ready),
                     lo.en.eq(advance), hi.en.eq(advance),
                     resp.valid.eq(valid), resp.payload.eq(beat)]
