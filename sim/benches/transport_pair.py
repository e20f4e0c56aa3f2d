"""Two HDL transports back to back through a seeded lossy / reordering / duplicating
link: random-size RDMA WRITEs in both directions on two QP pairs, PSNs starting just
below the 2^24 wrap; every destination byte is compared with its source, and nothing
outside the written ranges may change."""

from __future__ import annotations

import random

import cocotb
from cocotb.clock import Clock
from cocotb.triggers import ClockCycles, FallingEdge, RisingEdge

from fpgaccl.hw.transport.layouts import QPState, Status
from fpgaccl.proto import DropReason
from fpgaccl.proto.opcodes import Opcode
from fpgaccl.sim import bench_params
from fpgaccl.sim.tb.transport_harness import Link, NodeIO
from fpgaccl.sim.tb.transport_model import from_frame, to_frame

SRC = 0x1000_0000
DST = 0x2000_0000
DST_LEN = 1 << 20
QPN = ((0x000101, 0x000102), (0x000201, 0x000202))  # [node][qp]
IPS = (0x0A000001, 0x0A000002)
STRANGER = 0x0A000063
KEYS = (0x1111_0001, 0x2222_0002)


class TB:
    def __init__(self, dut, *, seed: int, loss=0.0, dup=0.0, reorder=0.0,
                 npsn=(0xFFFFF0, 0x7FFFFE), start_clock: bool = True) -> None:
        self.dut = dut
        prm = bench_params()
        self.width = prm["width"]
        self.nqp, self.nmr = prm["nqp"], prm["nmr"]
        self.rng = random.Random(seed)
        self.cycle = 0
        self.nodes = [NodeIO(dut, i, width=self.width, nqp=self.nqp, nmr=self.nmr, ip=IPS[i],
                             rng=random.Random(self.rng.random()),
                             read_latency=prm.get("read_latency", 8),
                             wr_stall=prm.get("wr_stall", 0.0)) for i in range(2)]
        self.links = [Link(random.Random(self.rng.random()), loss=loss, dup=dup,
                           reorder=reorder, latency=prm.get("latency", 20)) for _ in range(2)]
        for i, node in enumerate(self.nodes):
            link, peer = self.links[i], self.nodes[1 - i]
            node.out = link.send
            for q in range(2):
                node.peer_ip[q] = IPS[1 - i]
                # PSNs: what this side sends starts at npsn[i]; the peer expects that.
                node.set_qp(q, local_qpn=QPN[i][q], remote_qpn=QPN[1 - i][q],
                            next_psn=npsn[i] + q, expected_psn=npsn[1 - i] + q,
                            state=QPState.RESET)
            node.set_mr(1, base=DST, length=DST_LEN, key=KEYS[i])
            del peer
        if start_clock:
            Clock(dut.clk, 10, unit="ns", impl="gpi").start()

    async def reset(self) -> None:
        self.dut.rst.value = 1
        await ClockCycles(self.dut.clk, 3)
        self.dut.rst.value = 0
        # A few cycles out of reset in state RESET: the contexts load their PSNs.
        await ClockCycles(self.dut.clk, 3)
        for node in self.nodes:
            for q in range(2):
                node.set_qp(q, state=QPState.RTS)
        await ClockCycles(self.dut.clk, 1)

    async def run(self, done, max_cycles: int) -> None:
        clk = self.dut.clk
        stop = self.cycle + max_cycles
        while not done():
            assert self.cycle < stop, f"not done after {max_cycles} cycles"
            await FallingEdge(clk)
            for node in self.nodes:
                node.sample(self.cycle)
            for i, link in enumerate(self.links):
                for frame in link.due(self.cycle):
                    self.nodes[1 - i].deliver(frame)
            await RisingEdge(clk)
            for node in self.nodes:
                node.drive(self.cycle)
            self.cycle += 1


async def transfers(dut, *, seed, loss, dup, reorder, count, max_len, max_cycles,
                    forged=None):
    """``forged``: a list that counts, once each, the copies of node 0's frames sent to
    node 1 from ``STRANGER`` (its ICRC sealed anew) right behind the real ones."""
    tb = TB(dut, seed=seed, loss=loss, dup=dup, reorder=reorder)
    if forged is not None:
        send = tb.nodes[0].out

        def forge(frame: bytes, cycle: int) -> None:
            send(frame, cycle)
            h, payload = from_frame(frame)
            send(to_frame(h, payload, src_ip=STRANGER, dst_ip=IPS[1]), cycle)
            forged.append(h["bth"]["opcode"])

        tb.nodes[0].out = forge
    await tb.reset()
    rng = tb.rng
    expect = []  # (dst node, va, bytes)
    for i, node in enumerate(tb.nodes):
        src_off = 0
        dst_off = [0, DST_LEN // 2]
        for k in range(count):
            q = k % 2
            n = rng.choice((0, 1, rng.randint(1, max_len), max_len, 256, 257))
            data = rng.randbytes(n)
            node.mem.write(SRC + src_off, data)
            va = DST + dst_off[q] + rng.randint(0, 7)
            node.post(qp=q, laddr=SRC + src_off, raddr=va, rkey=KEYS[1 - i], length=n,
                      imm=(i << 24) | k)
            expect.append((1 - i, va, data))
            src_off += n + 64
            dst_off[q] += n + 16
    want = count
    await tb.run(lambda: all(len(nd.completions) >= want for nd in tb.nodes), max_cycles)
    for i, node in enumerate(tb.nodes):
        # In order per QP; the two QPs interleave freely.
        assert sorted(node.completions) == sorted((k % 2, Status.OK) for k in range(count)), (
            node.completions)
        assert len(node.received) == count, (i, len(node.received))
    for dst, va, data in expect:
        got = tb.nodes[dst].mem.read(va, len(data))
        assert got == data, f"node {dst} va {va:#x}: {len(data)} bytes differ"
    # Guard bytes: everything else in the destination windows is untouched (zero).
    for dst in (0, 1):
        mem = tb.nodes[dst].mem
        written = set()
        for d, va, data in expect:
            if d == dst:
                written.update(range(va, va + len(data)))
        for page, buf in mem.pages.items():
            for off, b in enumerate(buf):
                if b and page * 4096 + off not in written and page * 4096 + off >= DST:
                    raise AssertionError(f"node {dst}: stray byte at {page * 4096 + off:#x}")
    summary = {f"n{i}": {c: nd.counter(c) for c in ("tx_packets", "retransmits", "timeouts",
                                                    "naks_rx", "acks_tx", "naks_tx")}
               for i, nd in enumerate(tb.nodes)}
    dut._log.info("cycles %d links %s counters %s drops %s", tb.cycle,
                  [lk.stats for lk in tb.links], summary, [nd.drops() for nd in tb.nodes])
    return tb


@cocotb.test()
async def clean_link(dut) -> None:
    tb = await transfers(dut, seed=1, loss=0, dup=0, reorder=0, count=12, max_len=1500,
                         max_cycles=60_000)
    for node in tb.nodes:
        assert node.counter("retransmits") == 0 and node.drops() == {}


@cocotb.test()
@cocotb.parametrize(seed=[2, 3])
async def lossy_reordering_duplicating_link(dut, seed: int) -> None:
    tb = await transfers(dut, seed=seed, loss=0.03, dup=0.03, reorder=0.03, count=12,
                         max_len=1500, max_cycles=400_000)
    assert sum(nd.counter("retransmits") for nd in tb.nodes) > 0


@cocotb.test()
async def frames_from_another_address_are_dropped(dut) -> None:
    """Issue 34: only a QP's peer speaks for it. Every data packet and ACK node 0 sends
    reaches node 1 twice, the copy from another IPv4 address: each copy is dropped as
    WRONG_SOURCE (ACKs by the requester, the rest by the responder), and the transfers
    are exact with no resend."""
    forged: list[int] = []
    tb = await transfers(dut, seed=4, loss=0, dup=0, reorder=0, count=8, max_len=1500,
                         max_cycles=60_000, forged=forged)
    end = tb.cycle + 500  # what is still on the link arrives
    await tb.run(lambda: tb.cycle >= end, 1000)
    acks = sum(op == Opcode.ACKNOWLEDGE for op in forged)
    assert acks and len(forged) > acks
    assert tb.nodes[1].drops() == {DropReason.WRONG_SOURCE: len(forged)}
    assert tb.nodes[0].drops() == {}
    assert all(nd.counter("retransmits") == 0 for nd in tb.nodes)


@cocotb.test()
async def bad_rkey_fails_write_and_writes_nothing(dut) -> None:
    tb = TB(dut, seed=9)
    await tb.reset()
    a, b = tb.nodes
    a.mem.write(SRC, b"\xAA" * 600)
    a.post(qp=0, laddr=SRC, raddr=DST, rkey=KEYS[1] ^ 1, length=600, imm=1)
    a.post(qp=0, laddr=SRC, raddr=DST, rkey=KEYS[1], length=600, imm=2)  # flushed
    a.post(qp=1, laddr=SRC, raddr=DST + DST_LEN - 100, rkey=KEYS[1], length=600, imm=3)
    await tb.run(lambda: len(a.completions) == 3, 20_000)
    assert a.completions == [(0, Status.REMOTE_ACCESS), (0, Status.FLUSHED),
                             (1, Status.REMOTE_ACCESS)]
    assert b.mem.pages == {} and b.received == []
    drops = b.drops()
    assert drops[DropReason.BAD_RKEY] == 1 and drops[DropReason.OUT_OF_BOUNDS] == 1
    assert a.counter("qp_error") == 0b11
