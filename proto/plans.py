"""What the host writes into an engine's registers: QP contexts, memory regions, peers,
the collective context and the program. Backends that drive real or simulated engines
apply these (address, value) lists through whatever bus they have, so the register
knowledge lives here and in :mod:`fpgaccl.proto.regmap`, nowhere else."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from fpgaccl.proto.isa import Instr, assemble
from fpgaccl.proto.reduce import DType, ReduceOp
from fpgaccl.proto.regmap import RegisterMap

Writes = list[tuple[int, int]]

QPN_BASE = 0x100
"""QP ``i`` of every engine has QPN ``QPN_BASE + i`` and talks to rank ``i``."""
BUFFERS = ("in", "out", "tmp", "tmp2")


@dataclass(frozen=True)
class Peer:
    mac: int
    ip: int
    key: int
    buffers: Sequence[int]   # addresses of the peer's IN, OUT, TMP, TMP2


def _w(rmap: RegisterMap, path: str, value: int | None = None, index: int = 0,
       **fields: int) -> tuple[int, int]:
    block, reg = path.split(".")
    r = rmap[block][reg]
    word = r.encode(**fields) if value is None else value
    return rmap.address(path, index), word


def connect_writes(rmap: RegisterMap, rank: int, peers: Sequence[Peer], *,
                   psn: callable, mem_base: int, mem_len: int) -> Writes:
    """One-time set-up: own addresses, a memory region, and a QP in RTS per peer.
    ``psn(a, b)`` is the initial PSN of traffic from rank a to rank b (both ends must
    agree: it is exchanged at rendezvous)."""
    me = peers[rank]
    out = [
        _w(rmap, "port.mac_lo", me.mac & 0xFFFFFFFF),
        _w(rmap, "port.mac_hi", mac_hi=me.mac >> 32),
        _w(rmap, "port.ip", me.ip),
        _w(rmap, "mr.base_lo", mem_base & 0xFFFFFFFF),
        _w(rmap, "mr.base_hi", mem_base >> 32),
        _w(rmap, "mr.length", mem_len),
        _w(rmap, "mr.key", me.key),
        _w(rmap, "mr.access", remote_write=1),
    ]
    for p, peer in enumerate(peers):
        if p == rank:
            continue
        out += [
            _w(rmap, "qp.state", state=0, index=p),  # RESET loads the PSNs below
            _w(rmap, "qp.local_qpn", QPN_BASE + p, index=p),
            _w(rmap, "qp.remote_qpn", QPN_BASE + rank, index=p),
            _w(rmap, "qp.next_psn", psn(rank, p), index=p),
            _w(rmap, "qp.expected_psn", psn(p, rank), index=p),
            _w(rmap, "qp.peer_ip", peer.ip, index=p),
            _w(rmap, "qp.peer_mac_lo", peer.mac & 0xFFFFFFFF, index=p),
            _w(rmap, "qp.peer_mac_hi", mac_hi=peer.mac >> 32, index=p),
            _w(rmap, "qp.state", state=3, index=p),  # RTS
        ]
        for i, b in enumerate(BUFFERS):
            out += [_w(rmap, f"peer.{b}_lo", peer.buffers[i] & 0xFFFFFFFF, index=p),
                    _w(rmap, f"peer.{b}_hi", peer.buffers[i] >> 32, index=p),
                    _w(rmap, f"peer.{b}_key", peer.key, index=p)]
    out.append(_w(rmap, "ctrl.control", enable=1))
    return out


def collective_writes(rmap: RegisterMap, program: list[Instr], *, buffers: Sequence[int],
                      count: int, dtype: DType, op: ReduceOp, digest: int = 0) -> Writes:
    """Load a program and the collective context (everything but the doorbell).
    ``digest``: the call's signature digest (:mod:`fpgaccl.proto.signature`), 0: none
    (the node then neither sends nor checks one)."""
    if not 0 <= digest < 1 << 64:
        raise ValueError(f"digest: {digest:#x} is not a 64-bit value")
    out = [_w(rmap, f"imem.word{i}", w) for i, w in enumerate(assemble(program))]
    for i, b in enumerate(BUFFERS):
        out += [_w(rmap, f"coll.{b}_lo", buffers[i] & 0xFFFFFFFF),
                _w(rmap, f"coll.{b}_hi", buffers[i] >> 32)]
    out += [_w(rmap, "coll.count", count),
            _w(rmap, "ctrl.reduce", dtype=int(dtype), op=int(op)),
            _w(rmap, "coll.sig_lo", digest & 0xFFFFFFFF),
            _w(rmap, "coll.sig_hi", digest >> 32)]
    return out


def doorbell(rmap: RegisterMap, coll_id: int, entry: int = 0) -> tuple[int, int]:
    return _w(rmap, "ctrl.doorbell", entry=entry, coll_id=coll_id)
