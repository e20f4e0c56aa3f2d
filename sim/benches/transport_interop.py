"""An HDL transport against the runtime's software transport (:mod:`fpgaccl.host.qp`),
frame by frame through Python: WRITEs in both directions at once, over a lossy link,
so each side's go-back-N, ACK coalescing and duplicate handling meet the other's.

The software QP runs unmodified; only its engine is replaced by a stub that hands its
datagrams to the bench instead of a UDP socket, and the bench feeds it what the HDL sent
the way ``Engine._receive`` does (BTH decode, ICRC check, ``on_ack``/``on_write``).
The software side's clock is the simulation's: one cycle counts as one microsecond.
"""

from __future__ import annotations

import random
from collections import Counter

import cocotb
import numpy as np

from fpgaccl.host import wire
from fpgaccl.host.qp import Completion, MemoryRegion, Message, QueuePair
from fpgaccl.hw.transport.layouts import QPState, Status
from fpgaccl.proto import ETH, IPV4, UDP, DropReason, ipv4_checksum, parse_frame
from fpgaccl.proto.opcodes import ETHERTYPE_IPV4, ROCEV2_UDP_PORT, Opcode

from .transport_pair import TB

HDL_IP, SW_IP = "10.0.0.1", "10.0.0.2"
HDL_QPN, SW_QPN = 0x000101, 0x000A01
DST, DST_LEN, KEY = 0x2000_0000, 1 << 20, 0x1111_0001
SRC = 0x1000_0000
CYCLE_S = 1e-6


class StubEngine:
    """The parts of :class:`fpgaccl.host.engine.Engine` a QueuePair calls."""

    def __init__(self, mtu: int, window: int) -> None:
        self.mtu = mtu
        self.window = window
        self.stats: Counter[str] = Counter()
        self.drops = [0] * len(DropReason)
        self.mrs: dict[int, MemoryRegion] = {}
        self.arrivals_dirty = False
        self.events = 0      # GRANTs and ring messages taken (Engine.events)
        self.dead_colls: set[int] = set()   # calls that failed their check (Engine)
        self.failed: BaseException | None = None
        self.borrowed: dict = {}  # no borrowed SENDs here: every message owns its bytes
        self.outbox: list[bytes] = []
        # The socket address a real engine is bound to: its port enters the ICRC.
        self.addr = (SW_IP, ROCEV2_UDP_PORT)

    def transmit(self, parts, addr) -> None:
        self.outbox.append(b"".join(bytes(p) for p in parts))

    # The engine's batched sends (GSO runs on a real socket), one datagram at a time here.
    def transmit_many(self, datagrams, addr) -> None:
        for parts in datagrams:
            self.transmit(parts, addr)

    def transmit_run(self, flat, k: int, seg: int, addr) -> None:
        for i in range(0, 3 * k, 3):
            self.transmit(tuple(flat[i:i + 3]), addr)

    def drop(self, reason) -> None:
        self.drops[reason] += 1

    def qp_failed(self, qp, error) -> None:
        self.failed = error


def datagram_to_frame(dg: bytes, src: int, dst: int) -> bytes:
    """What the kernel puts around a datagram the software engine sends."""
    udp_len = UDP.size + len(dg)
    ip = IPV4.pack(len=IPV4.size + udp_len, src=src, dst=dst)
    ip = IPV4.pack(len=IPV4.size + udp_len, src=src, dst=dst, chksum=ipv4_checksum(ip))
    udp = UDP.pack(sport=ROCEV2_UDP_PORT, dport=ROCEV2_UDP_PORT, len=udp_len)
    return ETH.pack(type=ETHERTYPE_IPV4) + ip + udp + dg


class SoftwareSide:
    def __init__(self, tb: TB, *, mtu: int, slot_bytes: int, slots: int) -> None:
        self.eng = StubEngine(mtu, window=16)
        self.ring = np.zeros(slot_bytes * slots, np.uint8)
        self.mr = MemoryRegion(0x5EED_0001, self.ring, SW_QPN)
        self.eng.mrs[self.mr.rkey] = self.mr
        self.qp = QueuePair(self.eng, peer=0, qpn=SW_QPN, slot_bytes=slot_bytes, slots=slots,
                            ring=self.mr)
        self.tb = tb
        self.rejected: Counter[str] = Counter()

    def receive(self, frame: bytes) -> None:
        """``Engine._receive`` for one frame the HDL sent."""
        f = parse_frame(frame, check_icrc_=False)  # the engine checks the ICRC itself
        dg = frame[ETH.size + IPV4.size + UDP.size:ETH.size + f.ip["len"]]
        n = len(dg)
        opcode, _b1, pkey, dqpn, w2 = wire.BTH_FMT.unpack_from(dg)
        qp = self.qp
        assert dqpn & wire.QPN_MASK == qp.qpn, f"HDL sent to QPN {dqpn:#x}"
        assert pkey == wire.PKEY, f"HDL sent P_Key {pkey:#x}"
        psn, ackreq = w2 & wire.PSN_MASK, bool(w2 & wire.ACKREQ)
        # The HDL side sends from port 4791 here (see below), so the ICRC covers it.
        seed = wire.icrc_seed(qp.dst_ip, qp.src_ip, ROCEV2_UDP_PORT, ROCEV2_UDP_PORT, 8 + n)
        want = wire.datagram_icrc(seed, wire.received_bth_masked(dg),
                                  dg[wire.BTH_LEN:n - wire.ICRC_LEN])
        if want != dg[n - wire.ICRC_LEN:]:
            self.rejected["icrc"] += 1
            return
        now = self.tb.cycle * CYCLE_S
        if opcode == Opcode.ACKNOWLEDGE:
            (aeth,) = wire.AETH_FMT.unpack_from(dg, wire.BTH_LEN)
            qp.on_ack(psn, aeth >> wire.SYNDROME_SHIFT, now)
        else:
            qp.on_write(opcode, psn, ackreq, memoryview(dg), n)

    def step(self, send) -> None:
        now = self.tb.cycle * CYCLE_S
        qp = self.qp
        qp.flush_ack()
        if qp.has_work():
            qp.pump(now)
        qp.check_timer(now, 3000 * CYCLE_S)
        for dg in self.eng.outbox:
            send(datagram_to_frame(dg, wire.ip_to_int(SW_IP), wire.ip_to_int(HDL_IP)),
                 self.tb.cycle)
        self.eng.outbox.clear()


@cocotb.test()
@cocotb.parametrize(loss=[0.0, 0.1])
async def hdl_and_software_both_directions(dut, loss: float) -> None:
    tb = TB(dut, seed=11 + int(loss * 100), loss=loss, dup=loss, reorder=loss)
    hdl = tb.nodes[0]
    mtu = 256
    sw = SoftwareSide(tb, mtu=mtu, slot_bytes=4 * mtu, slots=8)
    hdl_ip, sw_ip = wire.ip_to_int(HDL_IP), wire.ip_to_int(SW_IP)
    hdl.ip = hdl_ip
    hdl.peer_ip[0] = sw_ip
    hdl.set_qp(0, local_qpn=HDL_QPN, remote_qpn=SW_QPN, next_psn=0xFFFFF8,
               expected_psn=0x123456, state=QPState.RESET)
    hdl.set_qp(1, state=QPState.RESET)
    hdl.set_mr(1, base=DST, length=DST_LEN, key=KEY)
    sw.qp.connect(remote_qpn=HDL_QPN, addr=(HDL_IP, ROCEV2_UDP_PORT), local_ip=SW_IP,
                  send_psn=0x123456, recv_psn=0xFFFFF8, remote_va=DST, remote_rkey=KEY)
    await tb.reset()
    hdl.set_qp(1, state=QPState.RESET)
    _to_sw, to_hdl = tb.links

    # Link 0 (HDL -> node 1) now ends in the software side; link 1 feeds the HDL.
    tb.nodes[1].deliver = sw.receive
    # Frames go through this bench, not a socket: both sides use port 4791, which the
    # software queue pair's ICRC (local and peer port) and the HDL's must agree on.
    hdl.udp_sport = ROCEV2_UDP_PORT
    rng = random.Random(5)

    # HDL -> software: WRITEs into slots of the software ring, as a peer engine would.
    hdl_msgs = []
    for k in range(6):
        n = rng.choice((0, 1, 255, 256, 700, 4 * mtu))
        data = rng.randbytes(n)
        hdl.mem.write(SRC + k * 8192, data)
        slot = k % 8
        imm = wire.pack_imm(k, 3)
        hdl.post(qp=0, laddr=SRC + k * 8192, raddr=sw.mr.va + slot * 4 * mtu, rkey=sw.mr.rkey,
                 length=n, imm=imm)
        hdl_msgs.append((slot, data, imm))
    # Software -> HDL: messages into the HDL's region, through the QP's own slot logic.
    sw_msgs = []
    for k in range(6):
        data = rng.randbytes(rng.choice((1, 100, 256, 600, 4 * mtu)))
        comp = Completion(1)
        sw.qp.post(Message(memoryview(data), wire.pack_imm(k, 5), comp))
        sw_msgs.append((data, comp))

    # The HDL completes one message at a time per QP; the software ring must not be
    # overwritten before it was checked, so check each arrival as it lands.
    got = {}

    def check_arrivals():
        while sw.qp.arrived:
            a = sw.qp.arrived.popleft()
            got[a.coll_id] = bytes(sw.ring[a.slot * 4 * mtu:a.slot * 4 * mtu + a.length])

    def done():
        check_arrivals()
        return (len(hdl.completions) == len(hdl_msgs) and all(c.done for _, c in sw_msgs)
                and len(got) == len(hdl_msgs))

    # Run the software side every few cycles, from the bench loop.
    orig_sample = hdl.sample

    def sample(cycle):
        orig_sample(cycle)
        if cycle % 4 == 0:
            sw.step(to_hdl.send)

    hdl.sample = sample
    try:
        await tb.run(done, 100_000)
    finally:
        dut._log.info("hdl completions %s received %s; sw done %s got %s rejected %s "
                      "sw stats %s sw drops %s hdl drops %s links %s sw free slots %s "
                      "sw outstanding %d sw error %s", hdl.completions,
                      [r["imm"] for r in hdl.received], [c.done for _, c in sw_msgs],
                      sorted(got), dict(sw.rejected), dict(sw.eng.stats),
                      {DropReason(i).name: n for i, n in enumerate(sw.eng.drops) if n},
                      hdl.drops(), [lk.stats for lk in tb.links], list(sw.qp.free_slots),
                      len(sw.qp.outstanding), sw.qp.error)

    assert sw.rejected == {}, sw.rejected
    if loss:
        assert sum(lk.stats["lost"] for lk in tb.links) > 0
    assert hdl.completions == [(0, Status.OK)] * len(hdl_msgs)
    for k, (_slot, data, _imm) in enumerate(hdl_msgs):
        assert got[k] == data, f"HDL->software message {k} differs"
    assert [r["imm"] for r in hdl.received] == [wire.pack_imm(k, 5) for k in range(6)]
    for (data, comp), r in zip(sw_msgs, hdl.received, strict=True):
        assert comp.error is None
        assert hdl.mem.read(r["va"], r["len"]) == data
    dut._log.info("cycles %d links %s sw stats %s sw drops %s hdl drops %s hdl retransmits %d",
                  tb.cycle, [lk.stats for lk in tb.links], dict(sw.eng.stats),
                  {DropReason(i).name: n for i, n in enumerate(sw.eng.drops) if n},
                  hdl.drops(), hdl.counter("retransmits"))
