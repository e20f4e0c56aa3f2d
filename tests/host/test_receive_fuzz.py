"""Fuzz of the software engine's receive paths (issue 34): datagrams with a valid ICRC
for whatever they hold -- every opcode the engine knows and others, every length from
nothing to past the MTU, from the peer and from elsewhere, mixed with well-formed WRITEs
and ACKs so that the deeper checks are reached -- go through the per-packet path, the
Python GRO-run path and the C batch path (``fp_take_runs``). The engine never raises,
writes nothing outside the one region a WRITE may reach, and every datagram is either
accepted or counted under a drop reason."""

from __future__ import annotations

import socket
import struct
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fpgaccl.errors import RemoteAccessError
from fpgaccl.host import native, wire
from fpgaccl.host.engine import Engine
from fpgaccl.host.qp import MemoryRegion
from fpgaccl.proto.opcodes import SUPPORTED_OPCODES, AethKind, NakCode, Opcode, aeth_syndrome

from .test_transport import sealed

HERE, PEER, OTHER = "127.77.40.1", "127.77.40.2", "127.77.40.3"
MTU = 256
GUARD = 64
CANARY = 0xA5
RECV_PSN, SEND_PSN = 0xFFFFF0, 50  # the receive PSN wraps within a few WRITEs

_OPS = sorted(SUPPORTED_OPCODES)
_CUT = [int(o) for o in _OPS if wire.HEADERS_LEN[o] > wire.BTH_LEN + wire.ICRC_LEN]
_SYN = [wire.ACK_SYNDROME, aeth_syndrome(AethKind.NAK, NakCode.PSN_SEQUENCE_ERROR),
        aeth_syndrome(AethKind.NAK, NakCode.REMOTE_ACCESS_ERROR),
        aeth_syndrome(AethKind.NAK, NakCode.INVALID_REQUEST), aeth_syndrome(AethKind.RNR_NAK, 3)]

# One datagram: (kind, opcode, PSN offset from the expected one, QPN choice, RETH choice,
# source choice, body length, seed for the rest of its bytes). Kinds: "raw" (bytes as
# drawn, shorter than a BTH + ICRC), "good" (the next packet of a valid WRITE to QP 1
# from the peer), "write" (a WRITE packet of the expected form, fields as drawn), "cut"
# (one from the peer at the expected PSN, cut inside the headers its opcode needs),
# "ack" (an ACK/NAK around the outstanding PSNs), "any" (an opcode and a body sealed
# with a valid ICRC, whatever the opcode needs).
_frame = st.tuples(
    st.sampled_from(["raw", "good", "good", "write", "write", "ack", "any", "cut"]),
    st.one_of(st.sampled_from(_OPS), st.integers(0, 255)),
    st.sampled_from([0, 0, 0, 1, -1, 5, -200, 1 << 23]),
    st.sampled_from(["qp", "qp", "qp", "other_qp", "random"]),
    st.sampled_from(["ring", "ring", "end", "past", "other_key", "huge"]),
    st.sampled_from(["peer", "peer", "peer", "hdl_port", "port", "ip"]),
    st.one_of(st.integers(0, 40), st.integers(0, MTU + 64)),  # short ones cut headers
    st.integers(0, 2**32 - 1),
)


class Bed:
    """An engine (thread not started) with QPs to peers 1 and 2 at PEER, their rings
    inside guard bytes (the only memory a WRITE may reach), QP 1 with packets
    outstanding; the peer's socket takes what the engine sends."""

    def __init__(self, native_path: bool) -> None:
        self.peer = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.peer.bind((PEER, wire.ROCEV2_UDP_PORT))
        self.peer.setblocking(False)
        eng = self.eng = Engine(0, HERE, mtu=MTU, slot_bytes=4 * MTU, slots=4,
                                native_path=native_path)
        self.qp = eng.create_qp(1)
        self.qp2 = eng.create_qp(2)
        self.mems = []
        for qp, remote in ((self.qp, 0x4242), (self.qp2, 0x4343)):
            # Each ring re-made inside canaries: a write past either end shows there.
            old = qp.ring
            mem = np.full(old.buf.size + 2 * GUARD, CANARY, np.uint8)
            mem[GUARD:-GUARD] = 0
            ring = MemoryRegion(old.rkey, mem[GUARD:-GUARD], qp.qpn)
            eng.mrs[old.rkey] = qp.ring = qp.w_mr = ring
            self.mems.append(mem)
            qp.connect(remote_qpn=remote, addr=(PEER, wire.ROCEV2_UDP_PORT), local_ip=HERE,
                       send_psn=SEND_PSN, recv_psn=RECV_PSN, remote_va=0, remote_rkey=7)
        # Peer 2 is a software engine: its early packets are all held, some kept aside.
        self.qp2.selective = True
        eng.send(1, 1, 1, memoryview(np.arange(5 * MTU, dtype=np.uint8)))
        self.qp.pump(time.monotonic())
        self.others = {}  # (ip, port) -> socket, for sources that are not the peer

    def close(self) -> None:
        self.eng.stop()
        self.peer.close()
        for s in self.others.values():
            s.close()

    def source(self, choice: str) -> tuple[str, int]:
        return {"peer": (PEER, wire.ROCEV2_UDP_PORT),
                "hdl_port": (PEER, wire.hdl_sport(self.qp.remote_qpn)),
                "port": (PEER, 40000), "ip": (OTHER, wire.ROCEV2_UDP_PORT)}[choice]

    def build(self, f: tuple) -> list[tuple[bytes, str, int]]:
        """Frame ``f``'s datagrams, from the state now: one, or (a WRITE in progress) a
        run of MIDDLEs of consecutive PSNs that GRO would join."""
        kind, op, dpsn, qpn_c, reth_c, src_c, blen, seed = f
        rng = np.random.default_rng(seed)
        ip, port = self.source(src_c)
        qp = self.qp
        if kind == "good":
            kind, dpsn, qpn_c, reth_c, src_c = "write", 0, "qp", "ring", "peer"
            ip, port = self.source(src_c)
        elif kind == "cut":
            kind, dpsn, qpn_c, src_c = "any", 0, "qp", "peer"
            ip, port = self.source(src_c)
            op = _CUT[seed % len(_CUT)]
            blen %= wire.HEADERS_LEN[op] - wire.BTH_LEN - wire.ICRC_LEN
        qpn = {"qp": qp.qpn, "other_qp": self.qp2.qpn,
               "random": int(rng.integers(0, 1 << 24))}[qpn_c]
        if kind == "raw":
            return [(rng.bytes(blen % (wire.BTH_LEN + wire.ICRC_LEN)), ip, port)]
        if kind == "ack":
            oldest = (qp.next_psn - qp.inflight) & wire.PSN_MASK
            psn = (oldest + dpsn + int(rng.integers(0, 4))) & wire.PSN_MASK
            body = struct.pack(">I", _SYN[seed % len(_SYN)] << wire.SYNDROME_SHIFT)
            return [(sealed(Opcode.ACKNOWLEDGE, psn, qpn, body, ip, HERE, port), ip, port)]
        psn = (qp.epsn + dpsn) & wire.PSN_MASK
        if kind == "write":
            if qp.w_off < 0:
                op = int(rng.choice([Opcode.RDMA_WRITE_FIRST, Opcode.RDMA_WRITE_ONLY,
                                     Opcode.RDMA_WRITE_ONLY_WITH_IMMEDIATE]))
            elif seed % 3:
                k = 1 + seed % 7
                return [(sealed(Opcode.RDMA_WRITE_MIDDLE, (psn + i) & wire.PSN_MASK, qpn,
                                rng.bytes(MTU), ip, HERE, port, ackreq=i == k - 1), ip, port)
                        for i in range(k)]
            else:
                op = int(rng.choice([Opcode.RDMA_WRITE_LAST,
                                     Opcode.RDMA_WRITE_LAST_WITH_IMMEDIATE]))
        size = qp.ring.buf.size
        va, rkey, dlen = {
            "ring": (qp.ring.va, qp.ring.rkey, 3 * MTU),
            "end": (qp.ring.va + size - 2 * MTU, qp.ring.rkey, 2 * MTU),
            "past": (qp.ring.va + size - MTU, qp.ring.rkey, 2 * MTU),
            "other_key": (self.qp2.ring.va, self.qp2.ring.rkey, MTU),
            "huge": (qp.ring.va, qp.ring.rkey, 1 << 31),
        }[reth_c]
        head = b""
        if op in (Opcode.RDMA_WRITE_FIRST, Opcode.RDMA_WRITE_ONLY,
                  Opcode.RDMA_WRITE_ONLY_WITH_IMMEDIATE):
            head = wire.RETH_FMT.pack(va, rkey, dlen)
        if op in (Opcode.RDMA_WRITE_LAST_WITH_IMMEDIATE,
                  Opcode.RDMA_WRITE_ONLY_WITH_IMMEDIATE, Opcode.SEND_LAST_WITH_IMMEDIATE,
                  Opcode.SEND_ONLY_WITH_IMMEDIATE):
            head += wire.IMM_FMT.pack(int(rng.integers(0, 1 << 32)))
        if op == Opcode.ACKNOWLEDGE:
            head = struct.pack(">I", int(rng.integers(0, 1 << 32)))
        # "any": the body cut anywhere, headers included; "write": whole headers.
        body = (head + rng.bytes(blen))[:blen] if kind == "any" else head + rng.bytes(blen)
        return [(sealed(op, psn, qpn, body, ip, HERE, port, ackreq=bool(seed & 1)), ip, port)]

    def accepted(self) -> int:
        """ACKs and NAKs taken (those of a kind acted on, and those that are not)."""
        return self.eng.stats["acks_rx"]


def _feed(bed: Bed, mode: str, frames: list[tuple]) -> int:
    """Hand the datagrams to the engine the ``mode`` way; returns the WRITE packets
    accepted (each moves its QP's expected PSN on by one)."""
    qps = (bed.qp, bed.qp2)
    accepted = 0
    stats = bed.eng.stats
    for f in frames:
        group = bed.build(f)
        epsns, acks = [qp.epsn for qp in qps], stats["acks_rx"]
        if mode == "packet":
            for dg in group:
                _take(bed, mode, [dg])
        else:
            _take(bed, mode, group)
        took = sum((qp.epsn - e) & wire.PSN_MASK for qp, e in zip(qps, epsns, strict=True))
        if f[0] != "good" and f[5] in ("port", "ip"):  # not the peer: nothing is taken
            assert not took and stats["acks_rx"] == acks, f
        accepted += took
        stats["fuzz_writes"] += took
    return accepted


def _take(bed: Bed, mode: str, group: list[tuple[bytes, str, int]]) -> None:
    rx = bed.eng.receiver
    data = b"".join(d for d, _, _ in group)
    n, seg = len(data), len(group[0][0])
    src, sport = wire.ip_to_int(group[0][1]), group[0][2]
    now = time.monotonic()
    rx._rxarr[:n] = np.frombuffer(data, np.uint8)
    if mode == "packet" or (mode == "python" and len(group) == 1):
        rx.packet(rx._rxview[:n], n, src, sport, now)
    elif mode == "python":
        rx.coalesced(n, seg, src, sport, now)
    else:
        rx._rxmeta[:, 0] = (n, seg if len(group) > 1 else n, socket.htonl(src), sport)
        rx._dispatch(1, 0, 0, now)


@pytest.mark.parametrize("mode", ["packet", "python", "native"])
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(frames=st.lists(_frame, min_size=1, max_size=24))
def test_receive_paths_survive_anything_and_count_every_datagram(mode: str, frames) -> None:
    if mode == "native" and native.load() is None:
        pytest.skip("no C fast path here")
    bed = Bed(native_path=mode == "native")
    try:
        accepted = _feed(bed, mode, frames)
        eng = bed.eng
        # Only a NAK from the peer for a PSN it was sent may fail the queue pair.
        assert eng.failed is None or eng.failed is bed.qp.error, eng.failed
        assert eng.failed is None or isinstance(eng.failed, RemoteAccessError)
        for mem in bed.mems:
            assert (mem[:GUARD] == CANARY).all() and (mem[-GUARD:] == CANARY).all()
        # An early MIDDLE is written where it belongs and held: the expected PSN passes it
        # once the gap fills (counted then), or its WRITE ends without it (discarded);
        # another early packet from a software peer is kept aside until the gap fills.
        held = sum(len(qp.held) + len(qp.early) for qp in (bed.qp, bed.qp2))
        assert eng.stats["rx_packets"] == (accepted + held + eng.stats["rx_held_discarded"]
                                           + bed.accepted() + sum(eng.drops)), (
            dict(eng.stats), eng.drops)
    finally:
        bed.close()
