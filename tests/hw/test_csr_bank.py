"""The CSR bank generated from the register map, on Amaranth's simulator."""

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


def test_rw_ro_wo_rc_and_memory_registers():
    rmap = default_map(qps=2, regions=2, imem_words=16)
    bank = CSRBank(rmap)
    addr = rmap.address

    async def bench(ctx):
        bus = bank.bus
        ctx.set(bank.ctrl_sts.id.value, ENGINE_ID)
        assert await _read(ctx, bus, addr("ctrl.id")) == ENGINE_ID
        # RW: write then read back; reset value from the map.
        assert ctx.get(bank.ctrl_ctl.control.mtu_log2) == 12
        await _write(ctx, bus, addr("ctrl.scratch"), 0xDEADBEEF)
        assert await _read(ctx, bus, addr("ctrl.scratch")) == 0xDEADBEEF
        ctrl = rmap["ctrl"]["control"]
        await _write(ctx, bus, addr("ctrl.control"), ctrl.encode(enable=1, mtu_log2=10))
        assert ctx.get(bank.ctrl_ctl.control.enable) == 1
        assert ctx.get(bank.ctrl_ctl.control.mtu_log2) == 10
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
