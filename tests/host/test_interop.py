"""Frame-level interop between the software executor and the HDL node's conventions.

Rank 0 is a real software engine running ``ring_allreduce(0, 2)``; rank 1 is played by
hand the way ``hw/node.py`` + ``hw/datapath/router.py`` behave: frames built with
:func:`fpgaccl.proto.build_frame` from UDP source port ``0xC000 + qp``, QPN
``QPN_BASE + rank``, one rkey and four buffer bases as :class:`fpgaccl.proto.plans.Peer` holds them,
``COLLECTIVE_IMM`` immediates; every frame rank 0 sends is decoded by the HDL path's
reference parser :func:`fpgaccl.proto.parse_frame` (ICRC included) and checked against
those conventions. The run only completes if rank 0 accepts the HDL-style frames.
"""

from __future__ import annotations

import socket
import time

import numpy as np

from fpgaccl.host import wire
from fpgaccl.host.engine import Engine
from fpgaccl.host.executor import CollectiveRegion, RemoteBuffers, execute
from fpgaccl.host.pcap import frame
from fpgaccl.proto import COLLECTIVE_IMM, build_frame, parse_frame
from fpgaccl.proto.drops import DropReason
from fpgaccl.proto.isa import Buf, SeqOp, chunk_size
from fpgaccl.proto.opcodes import ACK_CREDIT_INVALID, AethKind, Opcode, aeth_syndrome
from fpgaccl.proto.plans import QPN_BASE
from fpgaccl.proto.programs import ring_allreduce
from fpgaccl.proto.reduce import DType, ReduceOp, reduce_reference

SW_IP, HW_IP = "127.78.1.1", "127.78.1.2"
HW_SPORT = 0xC000  # the HDL port's default udp_sport; it sends from udp_sport + qp
HW_KEY = 0x5EED
HW_BASES = (0x1000_0000, 0x1010_0000, 0x1020_0000, 0x1030_0000)  # IN, OUT, TMP, TMP2
N = 1001  # two unequal chunks: 501 + 500


class HdlRank:
    """Rank 1 as the HDL node runs ring_allreduce(1, 2), frame by frame."""

    def __init__(self, sw: Engine, region: CollectiveRegion, x: np.ndarray) -> None:
        self.rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.rx.bind((HW_IP, wire.ROCEV2_UDP_PORT))
        self.rx.settimeout(5)
        self.tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.tx.bind((HW_IP, HW_SPORT + 0))  # QP 0 talks to rank 0
        self.sw, self.region = sw, region
        self.bufs = {Buf.IN: x.copy(), Buf.OUT: np.zeros_like(x), Buf.TMP: np.zeros(N + 1, x.dtype)}
        self.psn, self.epsn = 500, 900
        self.seen: list = []  # every frame rank 0 sent, parsed
        self.banked: dict[bool, list] = {}  # grant?: frames taken but not yet consumed

    def _send(self, opcode: Opcode, *, va: int = 0, payload: bytes = b"", imm: int | None = None,
              psn: int | None = None, aeth: int | None = None) -> None:
        ext = {}
        if opcode == Opcode.ACKNOWLEDGE:
            ext["aeth"] = {"syndrome": aeth, "msn": 0}
        else:
            ext["reth"] = {"va": va, "rkey": self.region.rkey, "dlen": len(payload)}
            ext["immdt"] = {"imm": imm}
        f = build_frame(ip={"src": wire.ip_to_int(HW_IP), "dst": wire.ip_to_int(SW_IP)},
                        udp={"sport": HW_SPORT + 0},
                        bth={"opcode": opcode, "dqpn": QPN_BASE + 1, "ackreq": 1,
                             "psn": self.psn if psn is None else psn}, payload=payload, **ext)
        if psn is None:
            self.psn += 1
        self.tx.sendto(f[14 + 28:], self.sw.addr)

    def _next(self):
        """The next new (non-duplicate) request frame from rank 0, ACKed as the HDL does."""
        while True:
            dg, src = self.rx.recvfrom(65536)
            f = parse_frame(frame(src[0], HW_IP, dg, sport=src[1]))  # checks the ICRC
            assert f.udp["dport"] == wire.ROCEV2_UDP_PORT
            if f.bth["opcode"] == Opcode.ACKNOWLEDGE:
                continue
            assert f.bth["dqpn"] == QPN_BASE + 0, "rank 0 must address QP 0x100 + its rank"
            if f.bth["psn"] != self.epsn:
                continue  # a retransmission
            self.epsn += 1
            self._send(Opcode.ACKNOWLEDGE, psn=f.bth["psn"],
                       aeth=aeth_syndrome(AethKind.ACK, ACK_CREDIT_INVALID))
            self.seen.append(f)
            return f

    def _expect(self, grant: bool, step: int, buf: Buf, xoff: int, n: int):
        """The next grant (or the next data message) from rank 0. Grants and data are two
        in-order streams, as the sequencer's per-peer counters see them: a grant that
        comes ahead of the data waited for (a program may grant early) is kept."""
        banked = self.banked.setdefault(grant, [])
        while not banked:
            f = self._next()
            assert f.bth["opcode"] == Opcode.RDMA_WRITE_ONLY_WITH_IMMEDIATE
            is_grant = bool(COLLECTIVE_IMM.from_int(f.immdt["imm"])["grant"])
            self.banked.setdefault(is_grant, []).append(f)
        f = banked.pop(0)
        imm = COLLECTIVE_IMM.from_int(f.immdt["imm"])
        assert imm == {"coll_id": 7, "grant": int(grant), "step": step}, imm
        assert f.reth["rkey"] == HW_KEY
        # A grant's VA is the call's signature digest: none here.
        assert f.reth["va"] == (0 if grant else HW_BASES[buf] + 4 * xoff)
        assert f.reth["dlen"] == 4 * n == len(f.payload)
        return f

    def run(self, program) -> np.ndarray:
        cs = N
        for ins in program:
            if ins.op is SeqOp.SETUP:
                cs = chunk_size(N, ins.step)
                continue
            lo, hi = min(ins.chunk * cs, N), min((ins.chunk + ins.count) * cs, N)
            sw_va = self.region.bases[ins.rbuf] + 4 * ins.xchunk * cs
            if ins.op is SeqOp.COPY:
                self.bufs[ins.buf][lo:hi] = self.bufs[ins.src][lo:hi]
            elif ins.op is SeqOp.GRANT:  # router: length 0, VA = the digest (none)
                self._send(Opcode.RDMA_WRITE_ONLY_WITH_IMMEDIATE, va=0,
                           imm=COLLECTIVE_IMM.to_int(coll_id=7, grant=1, step=ins.step))
            elif ins.op is SeqOp.SEND:
                self._expect(True, ins.step, Buf.IN, 0, 0)  # rank 0's grant
                self._send(Opcode.RDMA_WRITE_ONLY_WITH_IMMEDIATE, va=sw_va,
                           payload=self.bufs[ins.src][lo:hi].tobytes(),
                           imm=COLLECTIVE_IMM.to_int(coll_id=7, grant=0, step=ins.step))
            elif ins.op in (SeqOp.RECV, SeqOp.RECV_REDUCE):
                land = ins.buf if ins.op is SeqOp.RECV else ins.rbuf
                f = self._expect(False, ins.step, land, ins.xchunk * cs, hi - lo)
                got = np.frombuffer(f.payload, np.float32)
                if ins.op is SeqOp.RECV:
                    self.bufs[ins.buf][lo:hi] = got
                else:
                    self.bufs[ins.buf][lo:hi] = reduce_reference(
                        DType.FLOAT32, ReduceOp.SUM, self.bufs[ins.src][lo:hi], got)
            elif ins.op is SeqOp.DONE:
                return self.bufs[Buf.OUT]
        raise AssertionError("no DONE")


def test_software_rank_and_hdl_rank_run_one_allreduce() -> None:
    rng = np.random.default_rng(5)
    xs = [rng.standard_normal(N).astype(np.float32) for _ in range(2)]
    eng = Engine(0, SW_IP)
    region = CollectiveRegion(eng, 1 << 16)
    qp = eng.create_qp(1)
    assert qp.qpn == QPN_BASE + 1
    qp.connect(remote_qpn=QPN_BASE + 0, addr=(HW_IP, wire.ROCEV2_UDP_PORT), local_ip=SW_IP,
               send_psn=900, recv_psn=500, remote_va=0, remote_rkey=0)
    hw = HdlRank(eng, region, xs[1])
    try:
        eng.start()
        remotes = {1: RemoteBuffers(HW_BASES, HW_KEY, 1 << 20)}
        job = eng.submit("allreduce", execute(eng, region, remotes, ring_allreduce(0, 2),
                                              rank=0, coll_id=7, count=N,
                                              dtype=DType.FLOAT32, op=ReduceOp.SUM,
                                              inbuf=xs[0]), 10.0)
        hw_out = hw.run(ring_allreduce(1, 2))
        assert job.event.wait(10) and job.error is None, job.error
        sw_out = region.view(Buf.OUT, np.dtype(np.float32), N).copy()
        assert sw_out.tobytes() == hw_out.tobytes()  # both ranks hold identical bits
        assert np.allclose(sw_out, xs[0] + xs[1])
        deadline = time.monotonic() + 2
        while eng.by_peer[1].outstanding and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not eng.by_peer[1].outstanding, "rank 0 saw no ACK from the HDL-style peer"
        assert eng.drops[DropReason.BAD_ICRC] == 0  # frames from sport 0xC000 verify
        assert sum(eng.drops) == 0, eng.drops
        assert [f.udp["sport"] for f in hw.seen] == [wire.ROCEV2_UDP_PORT] * len(hw.seen)
    finally:
        eng.stop()
        hw.rx.close()
        hw.tx.close()


def test_a_frame_from_the_hdl_port_with_a_bad_icrc_is_dropped() -> None:
    eng = Engine(0, "127.78.2.1")
    region = CollectiveRegion(eng, 1 << 16)
    qp = eng.create_qp(1)
    qp.connect(remote_qpn=QPN_BASE, addr=("127.78.2.2", wire.ROCEV2_UDP_PORT),
               local_ip=eng.addr[0], send_psn=0, recv_psn=0, remote_va=0, remote_rkey=0)
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    tx.bind(("127.78.2.2", HW_SPORT + 0))
    try:
        eng.start()
        # ICRC computed for source port 4791 but sent from 0xC000: must not verify.
        f = build_frame(ip={"src": wire.ip_to_int("127.78.2.2"),
                            "dst": wire.ip_to_int(eng.addr[0])},
                        udp={"sport": wire.ROCEV2_UDP_PORT},
                        bth={"opcode": Opcode.RDMA_WRITE_ONLY_WITH_IMMEDIATE,
                             "dqpn": QPN_BASE + 1, "psn": 0, "ackreq": 1},
                        reth={"va": region.bases[Buf.IN], "rkey": region.rkey, "dlen": 0},
                        immdt={"imm": COLLECTIVE_IMM.to_int(coll_id=1, grant=1, step=0)})
        tx.sendto(f[42:], eng.addr)
        deadline = time.monotonic() + 5
        while not eng.drops[DropReason.BAD_ICRC] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert eng.drops[DropReason.BAD_ICRC] == 1
        assert not qp.grants
    finally:
        eng.stop()
        tx.close()
