"""EthNode on Amaranth's simulator, with the whole (smallest) Node behind it: the MAC's
verdict counts read over the control port as the ``drops`` registers they stand for,
clear-on-write like the bank's own, and HELLO carrying a board's overrides."""

import random

from amaranth.sim import Simulator

from fpgaccl.hw.eth.symbols import RxDrop
from fpgaccl.hw.eth_node import MAC_COUNTERS, EthNode
from fpgaccl.proto import control as ctl
from fpgaccl.proto.reduce import DType, ReduceOp
from fpgaccl.proto.regmap import REGMAP
from tests.hw.eth_wire import collect_frames, send_frames
from tests.hw.test_eth_arp_icmp import OUR_IP, OUR_MAC, ip_int, mac_int
from tests.hw.test_eth_control import KEY, request

WIDTH = 64
NODE = {"qps": 2, "regions": 2, "imem_words": 64, "dtypes": (DType.FLOAT32,),
        "ops": (ReduceOp.SUM,)}


def test_mac_drops_and_hello_info_over_the_control_port():
    dut = EthNode(WIDTH, key=KEY, mem_log2=16, mac_counters=True,
                  info={"clock_ps": 10_000}, **NODE)
    first = REGMAP["drops"]["bad_fcs"].offset + REGMAP["drops"].base
    assert [REGMAP["drops"][n].offset for n in MAC_COUNTERS.values()] == [
        REGMAP["drops"]["bad_fcs"].offset + 4 * i for i in range(4)]
    counts = {RxDrop.NONE: 50, RxDrop.BAD_FCS: 7, RxDrop.RUNT: 3, RxDrop.PHY_ERROR: 2,
              RxDrop.OVERFLOW: 1, RxDrop.OVERSIZE: 9}
    got: list[bytes] = []

    def set_counts(ctx):
        for v, n in counts.items():
            ctx.set(dut.mac_frames[v.value], n)

    async def ask(ctx, msg, settle=0):
        want = len(got) + 1
        await send_frames(ctx, dut.rx, [request(msg)], WIDTH)
        for _ in range(2000):
            await ctx.tick()
            if len(got) >= want:
                break
        assert len(got) == want, f"no answer to {msg}"
        return ctl.decode(got[-1][42:])

    answers = {}

    async def host(ctx):
        ctx.set(dut.mac, mac_int(OUR_MAC))
        ctx.set(dut.ip, ip_int(OUR_IP))
        ctx.set(dut.wr.ready, 1)
        set_counts(ctx)
        await ctx.tick().repeat(5)
        answers["hello"] = await ask(ctx, ctl.hello(1, KEY))
        answers["before"] = await ask(ctx, ctl.csr_read(2, KEY, first, 4))
        await ask(ctx, ctl.csr_write(3, KEY, [(first, 0), (first + 8, 0)]))
        counts[RxDrop.BAD_FCS] = 12
        set_counts(ctx)
        await ctx.tick()
        answers["after"] = await ask(ctx, ctl.csr_read(4, KEY, first, 4))

    async def sink(ctx):
        await collect_frames(ctx, dut.tx, WIDTH, got, 1 << 30, random.Random(1))

    sim = Simulator(dut)
    sim.add_clock(1e-8)
    sim.add_testbench(host)
    sim.add_testbench(sink, background=True)
    sim.run()

    info = ctl.INFO.unpack(answers["hello"].body)
    assert info["clock_ps"] == 10_000 and info["mem_log2"] == 16
    assert info["ip"] == ip_int(OUR_IP) and info["mac"] == mac_int(OUR_MAC)
    assert ctl.words(answers["before"].body) == [7, 3, 2, 1]
    # bad_fcs and phy_error cleared by the write; bad_fcs counted 5 more since.
    assert ctl.words(answers["after"].body) == [5, 3, 0, 1]


def test_frames_a_busy_responder_ignored_are_counted_as_service_busy():
    # Two who-has back to back while the MAC takes nothing: the ARP responder still
    # holds its first answer when the second arrives, ignores it and counts it.
    from scapy.compat import raw
    from scapy.layers.l2 import ARP, Ether

    from tests.hw.test_eth_arp_icmp import A_IP, A_MAC
    dut = EthNode(WIDTH, key=KEY, mem_log2=16, **NODE)
    who_has = raw(Ether(dst="ff:ff:ff:ff:ff:ff", src=A_MAC) / ARP(
        hwsrc=A_MAC, psrc=A_IP, pdst=OUR_IP))
    addr = REGMAP["drops"].base + REGMAP["drops"]["service_busy"].offset
    got: list[bytes] = []
    read = {}

    async def host(ctx):
        ctx.set(dut.mac, mac_int(OUR_MAC))
        ctx.set(dut.ip, ip_int(OUR_IP))
        ctx.set(dut.wr.ready, 1)
        await ctx.tick().repeat(5)
        await send_frames(ctx, dut.rx, [who_has, who_has], WIDTH)
        await ctx.tick().repeat(50)
        read["tx_held"] = len(got)
        read["go"] = True
        await send_frames(ctx, dut.rx, [request(ctl.csr_read(1, KEY, addr))], WIDTH)
        for _ in range(2000):
            await ctx.tick()
            if len(got) == 2:
                break

    async def sink(ctx):
        while not read.get("go"):
            ctx.set(dut.tx.ready, 0)
            await ctx.tick()
        await collect_frames(ctx, dut.tx, WIDTH, got, 1 << 30)

    sim = Simulator(dut)
    sim.add_clock(1e-8)
    sim.add_testbench(host)
    sim.add_testbench(sink, background=True)
    sim.run()
    assert read["tx_held"] == 0 and len(got) == 2
    assert Ether(got[0])[ARP].op == 2                    # the first who-has, answered
    assert ctl.words(ctl.decode(got[1][42:]).body) == [1]
