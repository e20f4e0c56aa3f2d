"""The board-side adapters and the interim core, end to end on Amaranth's simulator:
bytes in over the UART reach the CSR bank, nibbles in on the link come back out reduced
with the local buffer."""

from __future__ import annotations

import pytest
from amaranth.hdl import Module
from amaranth.lib import wiring
from amaranth.sim import Simulator

from fpgaccl.boards.links import NibbleLink, UARTBridge
from fpgaccl.boards.top import SMALL, EngineCore
from fpgaccl.proto.regmap import ENGINE_ID

DIV = 8  # UART bit time in cycles: short, so the simulation is quick


class _Board(wiring.Component):
    """BoardTop without a platform: the same three blocks, wired the same way."""

    def __init__(self, config):
        self.config = config
        super().__init__({
            "uart_rx": wiring.In(1), "uart_tx": wiring.Out(1, init=1),
            "rxd": wiring.In(4), "rx_dv": wiring.In(1),
            "txd": wiring.Out(4), "tx_en": wiring.Out(1),
        })

    def elaborate(self, platform):
        m = Module()
        m.submodules.core = core = EngineCore(self.config)
        m.submodules.uart = uart = UARTBridge(DIV, baud=1)
        m.submodules.link = link = NibbleLink(self.config.width)
        wiring.connect(m, uart.bus, core.csr)
        wiring.connect(m, link.rx, core.rx)
        wiring.connect(m, core.tx, link.tx)
        m.d.comb += [uart.rx.eq(self.uart_rx), self.uart_tx.eq(uart.tx),
                     link.rxd.eq(self.rxd), link.rx_dv.eq(self.rx_dv),
                     self.txd.eq(link.txd), self.tx_en.eq(link.tx_en)]
        return m


async def _send_byte(ctx, pin, byte):
    for bit in [0, *((byte >> i) & 1 for i in range(8)), 1]:
        ctx.set(pin, bit)
        await ctx.tick().repeat(DIV)


async def _recv_byte(ctx, pin, timeout=2000):
    for _ in range(timeout):
        if not ctx.get(pin):
            break
        await ctx.tick()
    else:
        raise AssertionError("no start bit")
    await ctx.tick().repeat(DIV + DIV // 2)
    value = 0
    for i in range(8):
        value |= ctx.get(pin) << i
        await ctx.tick().repeat(DIV)
    assert ctx.get(pin) == 1, "stop bit"
    return value


def _run(dut, bench):
    sim = Simulator(dut)
    sim.add_clock(1e-8)
    sim.add_testbench(bench)
    sim.run()  # until the testbench returns: the clock alone does not keep it going


def test_uart_bridge_reads_and_writes_the_csr_bank():
    dut = _Board(SMALL)
    regmap = SMALL.regmap()
    done = []

    async def bench(ctx):
        async def read(addr):
            for b in (ord("R"), addr >> 8, addr & 0xFF):
                await _send_byte(ctx, dut.uart_rx, b)
            word = 0
            for _ in range(4):
                word = (word << 8) | await _recv_byte(ctx, dut.uart_tx)
            return word

        async def write(addr, value):
            for b in (ord("W"), addr >> 8, addr & 0xFF, *value.to_bytes(4, "big")):
                await _send_byte(ctx, dut.uart_rx, b)
            assert await _recv_byte(ctx, dut.uart_tx) == ord("K")

        ctx.set(dut.uart_rx, 1)
        await ctx.tick().repeat(4)
        assert await read(regmap.address("ctrl.id")) == ENGINE_ID
        await write(regmap.address("ctrl.scratch"), 0x12345678)
        assert await read(regmap.address("ctrl.scratch")) == 0x12345678
        # Program memory goes through the bank's RAM port, not flip-flops.
        await write(regmap.address("imem.word3"), 0xCAFEF00D)
        assert await read(regmap.address("imem.word3")) == 0xCAFEF00D
        done.append(True)

    _run(dut, bench)
    assert done


def test_frames_come_back_reduced_with_the_local_buffer():
    """Two frames through pins -> link -> core -> link -> pins. The local buffer starts
    at zero and accumulates, so frame 1 comes back as sent and frame 2 as the int32
    element-wise sum of both."""
    dut = _Board(SMALL)
    f1 = bytes(range(1, 21))                   # 5 beats of 32 bits
    f2 = bytes((7 * i + 3) & 0xFF for i in range(20))
    got: list[bytes] = []

    async def sender(ctx):
        await ctx.tick().repeat(4)
        for frame in (f1, f2):
            for byte in frame:
                for nib in (byte & 0xF, byte >> 4):
                    ctx.set(dut.rxd, nib)
                    ctx.set(dut.rx_dv, 1)
                    await ctx.tick()
            ctx.set(dut.rx_dv, 0)
            await ctx.tick().repeat(40)

    async def receiver(ctx):
        frame, nibs = bytearray(), []
        seen = 0
        async for _clk, _rst, en, d in ctx.tick().sample(dut.tx_en, dut.txd):
            seen = seen + 1
            if en:
                nibs.append(d)
                if len(nibs) == 2:
                    frame.append(nibs[0] | nibs[1] << 4)
                    nibs = []
            elif frame:
                got.append(bytes(frame))
                frame = bytearray()
            if len(got) == 2 or seen > 2000:
                return

    sim = Simulator(dut)
    sim.add_clock(1e-8)
    sim.add_testbench(sender)
    sim.add_testbench(receiver)
    sim.run_until(3e-5)
    assert got[0] == f1
    want = bytearray()
    for i in range(0, 20, 4):
        s = (int.from_bytes(f1[i:i + 4], "little") + int.from_bytes(f2[i:i + 4], "little"))
        want += (s & 0xFFFFFFFF).to_bytes(4, "little")
    assert got[1] == bytes(want)


def test_on_chip_memory_writes_then_reads_back_with_a_partial_last_beat():
    from amaranth.lib import data

    from fpgaccl.boards.links import OnChipMemory

    wr_layout = data.StructLayout({"addr": 64, "data": 64, "keep": 8, "last": 1})
    rd_layout = data.StructLayout({"addr": 64, "len": 16})
    dut = OnChipMemory(64, 16, wr_layout, rd_layout)
    words = [0x0807060504030201, 0x1817161514131211, 0x2827262524232221]
    got = []

    async def bench(ctx):
        for i, w in enumerate(words):
            ctx.set(dut.wr.payload, {"addr": 0x40 + 8 * i, "data": w, "keep": 0xFF,
                                     "last": i == 2})
            ctx.set(dut.wr.valid, 1)
            await ctx.tick()
        ctx.set(dut.wr.valid, 0)
        ctx.set(dut.rd_req.payload, {"addr": 0x40, "len": 20})
        ctx.set(dut.rd_req.valid, 1)
        await ctx.tick()
        ctx.set(dut.rd_req.valid, 0)
        ctx.set(dut.rd_resp.ready, 1)
        for _ in range(10):
            await ctx.tick()
            if ctx.get(dut.rd_resp.valid):
                p = ctx.get(dut.rd_resp.payload)
                got.append((p.data, p.keep, p.first, p.last))
                if p.last:
                    break

    _run(dut, bench)
    assert got == [(words[0], 0xFF, 1, 0), (words[1], 0xFF, 0, 0), (words[2], 0x0F, 0, 1)]


@pytest.mark.parametrize("width", [32, 64])
def test_on_chip_memory_unaligned_against_a_byte_model(width):
    """Writes and reads at any byte, any length, with the reader stalling at random:
    every read returns what a byte array written the same way holds (SimMemory's port
    semantics; a collective's chunks start at odd 4-byte offsets)."""
    import random

    from amaranth.lib import data

    from fpgaccl.boards.links import OnChipMemory

    nb, depth = width // 8, 32
    size = depth * nb
    wr_layout = data.StructLayout({"addr": 64, "data": width, "keep": nb, "last": 1})
    rd_layout = data.StructLayout({"addr": 64, "len": 16})
    dut = OnChipMemory(width, depth, wr_layout, rd_layout)
    rng = random.Random(width)
    model = bytearray(size)
    reads = []     # (addr, len, expected bytes)
    got = []

    async def bench(ctx):
        for _ in range(40):
            if rng.random() < 0.5:
                a, n = rng.randrange(size), rng.randrange(1, 3 * nb)
                payload = rng.randbytes(n)
                for i in range(0, n, nb):
                    chunk = payload[i:i + nb]
                    keep = (1 << len(chunk)) - 1
                    if rng.random() < 0.3:
                        keep &= rng.getrandbits(nb)
                    for j, b in enumerate(chunk):
                        if keep >> j & 1:
                            model[(a + i + j) % size] = b
                    ctx.set(dut.wr.payload, {"addr": a + i, "keep": keep,
                                             "data": int.from_bytes(chunk, "little"),
                                             "last": i + nb >= n})
                    ctx.set(dut.wr.valid, 1)
                    await ctx.tick()
                ctx.set(dut.wr.valid, 0)
            else:
                a, n = rng.randrange(size - 3 * nb), rng.randrange(1, 3 * nb)
                reads.append((a, n, bytes(model[a:a + n])))
                ctx.set(dut.rd_req.payload, {"addr": a, "len": n})
                ctx.set(dut.rd_req.valid, 1)
                while True:
                    _, _, ready = await ctx.tick().sample(dut.rd_req.ready)
                    if ready:
                        break
                ctx.set(dut.rd_req.valid, 0)
                want = len(got) + 1
                for _ in range(200):
                    if len(got) == want:
                        break
                    await ctx.tick()
        assert len(got) == len(reads)

    async def sink(ctx):
        cur = bytearray()
        while True:
            ready = int(rng.random() < 0.6)
            ctx.set(dut.rd_resp.ready, ready)
            _, _, valid, p = await ctx.tick().sample(dut.rd_resp.valid, dut.rd_resp.payload)
            if valid and ready:
                assert p.first == (not cur)
                keep = p.keep
                cur += bytes(b for j, b in enumerate(p.data.to_bytes(nb, "little"))
                             if keep >> j & 1)
                if p.last:
                    got.append(bytes(cur))
                    cur = bytearray()

    sim = Simulator(dut)
    sim.add_clock(1e-8)
    sim.add_testbench(bench)
    sim.add_testbench(sink, background=True)
    sim.run()
    assert got == [want for _, _, want in reads]
