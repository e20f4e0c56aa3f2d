"""PeerResolver on Amaranth's simulator, against a model of the ARP table: each queue
pair's destination MAC is its static register, else what the table learnt for its peer,
and the unresolved ones ask, in turn."""

from amaranth.sim import Simulator

from fpgaccl.hw.eth.resolver import ASK_EVERY_LOG2, PeerResolver

QPS = 4
IPS = [0x0A000001, 0x0A000002, 0x0A000003, 0]   # QP 3 is not connected
STATIC = 0x02AA000000AA


def test_static_mac_wins_learnt_ones_follow_the_table_and_the_rest_ask():
    dut = PeerResolver(QPS)
    table = {IPS[1]: 0x020000000002}       # what ARP has learnt so far
    asked: list[int] = []
    seen = {}

    async def arp(ctx):                     # the table: answered within the cycle
        async for _, _, ask, ask_ip in ctx.tick().sample(dut.ask, dut.ask_ip):
            ip = ctx.get(dut.lookup_ip)
            ctx.set(dut.lookup_hit, int(ip in table))
            ctx.set(dut.lookup_mac, table.get(ip, 0))
            ctx.set(dut.ask_taken, ctx.get(dut.ask))     # the ARP responder is free
            if ask:
                asked.append(ask_ip)

    def dst(ctx):
        return [ctx.get(dut.dst[i]) for i in range(QPS)]

    async def host(ctx):
        for i, ip in enumerate(IPS):
            ctx.set(dut.peer_ip[i], ip)
        ctx.set(dut.static_mac[0], STATIC)
        await ctx.tick().repeat(2 * QPS + 4)
        seen["first"] = dst(ctx)
        # QP 2's peer answers a who-has: the table learns it.
        await ctx.tick().repeat(3 << ASK_EVERY_LOG2)
        seen["asked"] = sorted(set(asked))
        table[IPS[2]] = 0x020000000003
        await ctx.tick().repeat(2 * QPS + 4)
        seen["learnt"] = dst(ctx)
        n = len(asked)
        await ctx.tick().repeat(3 << ASK_EVERY_LOG2)
        seen["asked_after"] = len(asked) - n
        # The host moves QP 1 to another peer: the old peer's MAC is not used for it.
        ctx.set(dut.peer_ip[1], 0x0A000009)
        await ctx.tick().repeat(4)
        seen["moved"] = dst(ctx)

    sim = Simulator(dut)
    sim.add_clock(1e-8)
    sim.add_testbench(host)
    sim.add_testbench(arp, background=True)
    sim.run()

    assert seen["first"] == [STATIC, 0x020000000002, 0, 0]
    assert seen["asked"] == [IPS[2]]        # only the connected QP without a MAC asks
    assert seen["learnt"] == [STATIC, 0x020000000002, 0x020000000003, 0]
    assert seen["asked_after"] == 0         # resolved: no more who-has
    assert seen["moved"][1] == 0
