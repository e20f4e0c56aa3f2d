"""The CSR bank generated from the register map, on Amaranth's simulator."""

import pytest
from amaranth.sim import Simulator

from fpgaccl.hw.csr.bank import CSRBank
from fpgaccl.proto.regmap import ENGINE_ID, REGMAP, default_map


def _sim(bank, bench):
    sim = Simulator(bank)
    sim.add_clock(1e-8)
    sim.add_testbench(bench)
    sim.run()


async def _write(ctx, bus, addr, value):
    ctx.set(bus.addr, addr)
    ctx.set(bus.w_data, value)
    ctx.set(bus.w_stb, 1)
    await ctx.tick()
    ctx.set(bus.w_stb, 0)


async def _read(ctx, bus, addr):
    ctx.set(bus.addr, addr)
    ctx.set(bus.r_stb, 1)
    await ctx.tick()
    ctx.set(bus.r_stb, 0)
    return ctx.get(bus.r_data)


@pytest.mark.parametrize("read_parts", [1, 16])
def test_rw_ro_wo_rc_and_memory_registers(read_parts):
    rmap = default_map(qps=2, regions=2, imem_words=16)
    bank = CSRBank(rmap, read_parts=read_parts)
    addr = rmap.address

    async def bench(ctx):
        bus = bank.bus
        ctx.set(bank.ctrl_sts.id.value, ENGINE_ID)
        assert await _read(ctx, bus, addr("ctrl.id")) == ENGINE_ID
        # RW: write then read back; reset value from the map.
        assert ctx.get(bank.port_ctl.udp_sport.sport) == 0xC000
        await _write(ctx, bus, addr("ctrl.scratch"), 0xDEADBEEF)
        assert await _read(ctx, bus, addr("ctrl.scratch")) == 0xDEADBEEF
        ctrl = rmap["ctrl"]["control"]
        await _write(ctx, bus, addr("ctrl.control"), ctrl.encode(enable=1))
        assert ctx.get(bank.ctrl_ctl.control.enable) == 1
        await _write(ctx, bus, addr("port.udp_sport"), 4791)
        assert ctx.get(bank.port_ctl.udp_sport.sport) == 4791
        # Repeated blocks: copy 1 is independent of copy 0.
        await _write(ctx, bus, addr("qp.next_psn", 1), 0xFFFFFE)
        assert ctx.get(bank.qp_ctl[1].next_psn.value) == 0xFFFFFE
        assert ctx.get(bank.qp_ctl[0].next_psn.value) == 0
        # WO: a doorbell write pulses its strobe for exactly one cycle.
        await _write(ctx, bus, addr("ctrl.doorbell"),
                     rmap["ctrl"]["doorbell"].encode(entry=5, coll_id=7))
        assert ctx.get(bank.ctrl_wstb.doorbell) == 1
        assert ctx.get(bank.ctrl_ctl.doorbell.entry) == 5
        await ctx.tick()
        assert ctx.get(bank.ctrl_wstb.doorbell) == 0
        assert await _read(ctx, bus, addr("ctrl.doorbell")) == 0
        # RC: hardware value readable, write pulses clear.
        ctx.set(bank.drops_sts.bad_icrc.value, 42)
        assert await _read(ctx, bus, addr("drops.bad_icrc")) == 42
        await _write(ctx, bus, addr("drops.bad_icrc"), 0)
        assert ctx.get(bank.drops_clr.bad_icrc) == 1
        # Memory block: bus writes, consumer and bus both read.
        for i in range(16):
            await _write(ctx, bus, addr(f"imem.word{i}"), 0x1000 + i)
        assert await _read(ctx, bus, addr("imem.word9")) == 0x1009
        ctx.set(bank.imem_raddr, 3)
        await ctx.tick()
        assert ctx.get(bank.imem_rdata) == 0x1003
        # Unmapped addresses read as zero.
        assert await _read(ctx, bus, 0x7FFC) == 0

    _sim(bank, bench)


def test_default_map_is_consistent():
    seen = set()
    for address, _block, _i, _reg in REGMAP.flat():
        assert address % 4 == 0 and address not in seen
        seen.add(address)
    assert REGMAP.address("drops.bad_icrc") == 0x100 + 4 * 12


def _field_mask(reg):
    return (1 << sum(f.bits for f in reg.fields)) - 1


@pytest.mark.parametrize("read_parts", [1, 7, 16])
def test_readback_reaches_every_register(read_parts):
    """The AND-OR read-back tree: every RW register reads back what was written, every
    RO/RC register what the hardware drives, each at its own address (distinct values,
    so a decode that selects a neighbour or ORs two registers shows). With the tree cut
    into registered parts (the node's bank) too: no group left out or read twice."""
    from fpgaccl.proto.regmap import Access
    rmap = default_map(qps=2, regions=2, imem_words=4, dma_host_windows=2, gpu_pages=4)
    bank = CSRBank(rmap, read_parts=read_parts)
    rows = [(a, b, i, r) for a, b, i, r in rmap.flat() if not b.memory]

    def value_for(addr, reg):
        return (addr * 0x9E3779B1 + 0x1234567) & 0xFFFF_FFFF & _field_mask(reg)

    async def bench(ctx):
        bus = bank.bus
        for addr, b, i, reg in rows:
            v = value_for(addr, reg)
            if reg.access is Access.RW:
                await _write(ctx, bus, addr, v)
            elif reg.access in (Access.RO, Access.RC):
                sts = getattr(bank, f"{b.name}_sts")
                view = sts[i] if b.count > 1 else sts
                ctx.set(view[reg.name].as_value(), v)
        for addr, _, _, reg in rows:
            want = 0 if reg.access is Access.WO else value_for(addr, reg)
            assert await _read(ctx, bus, addr) == want, f"{addr:#x} {reg.name}"

    _sim(bank, bench)


def test_map_without_dma_blocks_keeps_every_other_address():
    from fpgaccl.proto.regmap import DMA_BLOCKS, config_fields, config_word, features_word
    full, lean = default_map(), default_map(dma=False)
    assert {b.name for b in full} - {b.name for b in lean} == set(DMA_BLOCKS)
    assert [(a, r.name) for a, b, _, r in full.flat() if b.name not in DMA_BLOCKS] == \
        [(a, r.name) for a, _, _, r in lean.flat()]
    CSRBank(lean)   # elaborates with no dma_* ports
    assert not hasattr(CSRBank(lean), "dma_ctl")
    from fpgaccl.proto.reduce import DType, ReduceOp
    feats = REGMAP["ctrl"]["features"].decode(
        features_word(dma=False, dtypes=[DType.INT32, DType.FLOAT32], ops=[ReduceOp.SUM]))
    assert feats == {"dma": 0, "dtypes": (1 << 2) | (1 << 10), "ops": 1}
    cfg = REGMAP["ctrl"]["config"].decode(config_word(qps=8, regions=4, imem_words=256,
                                                      width=512, mtu=1024))
    assert cfg == {"qps": 8, "regions": 4, "imem_log2": 8, "beat_log2": 6, "mtu_log2": 10}
    params = {"qps": 8, "regions": 4, "imem_words": 256, "width": 512, "mtu": 1024}
    assert config_fields(config_word(**params)) == params
    with pytest.raises(ValueError):
        config_word(qps=8, regions=4, imem_words=256, width=512, mtu=1000)


def test_reduce_register_is_as_wide_as_the_unit_decodes():
    # ctrl.reduce feeds the reduction unit's context: a field wider than the unit reads
    # would let a dtype or op out of range alias another silently; encode refuses it.
    from amaranth.hdl import Value

    from fpgaccl.proto.reduce import DTYPE_BITS, OP_BITS
    bank = CSRBank(default_map(qps=2, regions=2, imem_words=16))
    reduce = bank.ctrl_ctl.reduce
    assert len(Value.cast(reduce.dtype)) == DTYPE_BITS
    assert len(Value.cast(reduce.op)) == OP_BITS
    with pytest.raises(ValueError, match="does not fit"):
        REGMAP["ctrl"]["reduce"].encode(dtype=1 << DTYPE_BITS, op=0)
