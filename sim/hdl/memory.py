"""A node's memory as hardware: serves the node's simple memory ports (read requests
answered in order with byte 0 of the first beat at the requested address, write beats
with an address and byte mask) at one beat per cycle after a fixed latency, plus a
word-wide backdoor port for the testbench to fill and read buffers.

Unaligned accesses are handled as a DMA engine would: every beat touches two
neighbouring words, through two read and two write ports.
"""

from __future__ import annotations

from pathlib import Path

from amaranth.hdl import Cat, ClockSignal, Const, Instance, Module, Mux, Signal
from amaranth.lib import memory, stream, wiring
from amaranth.lib.wiring import In, Out

from fpgaccl.hw.datapath.memport import MEM_READ_REQ, mem_write_layout
from fpgaccl.hw.stream.beat import beat_stream

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
    """``verilog_ram`` puts the storage in :data:`RAM_VERILOG` (for Verilator builds of
    large memories); otherwise it is an Amaranth memory (for Amaranth's simulator)."""

    def __init__(self, width: int, size: int, latency: int = 8, *,
                 verilog_ram: bool = False) -> None:
        if size & (size - 1):
            raise ValueError("memory size must be a power of two")
        self.verilog_ram = verilog_ram
        self.width, self.size, self.latency = width, size, latency
        self.nbytes = width // 8
        self.depth = size // self.nbytes
        super().__init__({
            "rd_req": In(stream.Signature(MEM_READ_REQ)),
            "rd_resp": Out(beat_stream(width)),
            "wr": In(stream.Signature(mem_write_layout(width))),
            # backdoor: word address, whole-word writes, reads one cycle later
            "bd_addr": In(range(self.depth)),
            "bd_wdata": In(width),
            "bd_we": In(1),
            "bd_rdata": Out(width),
        })

    def elaborate(self, platform) -> Module:
        m = Module()
        nb, w = self.nbytes, self.width
        lg = (nb - 1).bit_length()
        aw = (self.depth - 1).bit_length()
        wr_lo, wr_hi = _Port(aw, w, nb, "wr_lo"), _Port(aw, w, nb, "wr_hi")
        rd_lo, rd_hi = _Port(aw, w, 1, "rd_lo"), _Port(aw, w, 1, "rd_hi")
        bd_rd, bd_wr = _Port(aw, w, 1, "bd_rd"), _Port(aw, w, 1, "bd_wr")
        if self.verilog_ram:
            m.submodules.ram = Instance(
                "fpgaccl_sim_ram", p_WIDTH=w, p_AW=aw, i_clk=ClockSignal(),
                i_ra0=rd_lo.addr, i_re0=rd_lo.en, o_rd0=rd_lo.data,
                i_ra1=rd_hi.addr, i_re1=rd_hi.en, o_rd1=rd_hi.data,
                i_ra2=bd_rd.addr, o_rd2=bd_rd.data,
                i_wa0=wr_lo.addr, i_we0=wr_lo.en, i_wd0=wr_lo.data,
                i_wa1=wr_hi.addr, i_we1=wr_hi.en, i_wd1=wr_hi.data,
                i_wa2=bd_wr.addr, i_we2=bd_wr.en, i_wd2=bd_wr.data)
        else:
            m.submodules.ram = ram = memory.Memory(shape=w, depth=self.depth, init=[])
            ports = {"wr_lo": ram.write_port(granularity=8), "wr_hi": ram.write_port(granularity=8),
                     "rd_lo": ram.read_port(), "rd_hi": ram.read_port(),
                     "bd_rd": ram.read_port(), "bd_wr": ram.write_port()}
            for name, mine in (("wr_lo", wr_lo), ("wr_hi", wr_hi), ("bd_wr", bd_wr)):
                m.d.comb += [ports[name].addr.eq(mine.addr), ports[name].data.eq(mine.data),
                             ports[name].en.eq(mine.en)]
            for name, mine in (("rd_lo", rd_lo), ("rd_hi", rd_hi), ("bd_rd", bd_rd)):
                m.d.comb += [ports[name].addr.eq(mine.addr), mine.data.eq(ports[name].data)]
                if name != "bd_rd":
                    m.d.comb += ports[name].en.eq(mine.en)

        m.d.comb += [bd_rd.addr.eq(self.bd_addr), self.bd_rdata.eq(bd_rd.data),
                     bd_wr.addr.eq(self.bd_addr), bd_wr.data.eq(self.bd_wdata),
                     bd_wr.en.eq(self.bd_we)]

        # Writes: shift the beat to its byte offset and split it over two words.
        p = self.wr.payload
        off = p.addr[:lg]
        word = p.addr[lg:]
        shifted = Signal(2 * w)
        mask = Signal(2 * nb)
        m.d.comb += [shifted.eq(p.data << (off * 8)), mask.eq(p.keep << off),
                     self.wr.ready.eq(1)]
        m.d.comb += [
            wr_lo.addr.eq(word), wr_lo.data.eq(shifted[:w]),
            wr_hi.addr.eq(word + 1), wr_hi.data.eq(shifted[w:]),
        ]
        m.d.comb += [wr_lo.en.eq(mask[:nb] & self.wr.valid.replicate(nb)),
                     wr_hi.en.eq(mask[nb:] & self.wr.valid.replicate(nb))]

        # Reads: one beat per cycle; each beat reads words k and k+1 and shifts.
        addr = Signal(64)
        left = Signal(17)
        first = Signal()
        active = Signal()
        advance = Signal()
        m.d.comb += self.rd_req.ready.eq(~active)
        with m.If(self.rd_req.valid & ~active):
            m.d.sync += [addr.eq(self.rd_req.payload.addr), left.eq(self.rd_req.payload.len),
                         first.eq(1), active.eq(self.rd_req.payload.len != 0)]
        # Pipeline: stage 0 issues the RAM reads, then `latency` register stages.
        m.d.comb += [rd_lo.addr.eq(addr[lg:]), rd_hi.addr.eq(addr[lg:] + 1)]
        s_valid = Signal()
        s_off = Signal(lg)
        s_keep = Signal(nb)
        s_first = Signal()
        s_last = Signal()
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
        data_now = Signal(w)
        m.d.comb += data_now.eq(Cat(rd_lo.data, rd_hi.data) >> (s_off * 8))
        beat = Cat(data_now, s_keep, s_first, s_last)
        valid = s_valid
        for i in range(self.latency):
            r = Signal(len(beat), name=f"beat_d{i}")
            v = Signal(name=f"valid_d{i}")
            with m.If(advance):
                m.d.sync += [r.eq(beat), v.eq(valid)]
            beat, valid = r, v
        m.d.comb += [advance.eq(~valid | self.rd_resp.ready),
                     rd_lo.en.eq(advance), rd_hi.en.eq(advance),
                     self.rd_resp.valid.eq(valid), self.rd_resp.payload.eq(beat)]
        return m

