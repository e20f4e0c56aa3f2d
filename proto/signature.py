"""The call signature: what every rank of a collective must agree on, defined once.

A record (:class:`Signature`) holds the per-communicator call sequence number, the
collective kind, the element count (per block), dtype, op, root, a digest of the
algorithm (program family and its parameters, the same on every rank) and an optional
user tag. Its 64-bit ``digest`` covers all of them but the sender's rank: two ranks
agree on a call iff their digests are equal, a fixed-width compare an HDL node can do at
line rate. Digest 0 means "no signature" (a peer that does not send one yet: an HDL
node); a computed 0 becomes 1.

Record on the wire (:data:`RECORD`, 32 bytes, big-endian)::

    bytes  0..7   digest    u64  blake2b-64 of bytes 8..29 with ``rank`` zeroed
    bytes  8..15  count     u64  elements per block
    bytes 16..19  tag       u32  user tag (an int, or the CRC-32 of a str); 0: none
    bytes 20..23  program   u32  CRC-32 of the algorithm name and parameters; 0: none
    bytes 24..25  seq       u16  per-communicator call number, mod 2^16
    bytes 26..27  root      u16  root rank; 0xFFFF: none
    bytes 28..29  rank      u16  the sender (not covered by the digest)
    byte  30      kind      u8   :class:`Kind`
    byte  31      dtype<<4 | op  u8   :class:`DType` (4 bits), :class:`ReduceOp` (4 bits, 15: none)

Where it travels: only its digest, in every GRANT (below), so checking costs no
message. The whole record travels only once ranks differ, in a mismatch notice: a ring
message ``RING_IMM(coll_id, final=1, step=STEP_MISMATCH)`` of two records (64 bytes,
``coll_id`` the call's first segment's). A software rank whose peer's GRANT differs
sends that peer a query: a notice whose first record is a :func:`digest_record` of the
peer's digest, the second its own record. The peer, which has both records, answers
every software peer with both (its own first), so every rank names the field that
differs; a rank that receives a notice fails its call with that error.

Where the digest travels (every rank, software and HDL): in every GRANT. A GRANT is a
zero-length RDMA WRITE, whose R_Key and RETH VA (64 bits) a responder does not validate
(IBTA: zero DMA length), so the granting rank puts its digest in the VA (0: none). A
rank that takes a GRANT compares its VA with its own digest before it sends a byte to
the granting rank; both non-zero and different is a mismatch:

* an HDL node (``coll.sig_lo/hi``, written by
  :func:`fpgaccl.proto.plans.collective_writes`) sends nothing more to that peer,
  latches it and its digest (``coll.mismatch_peer``, ``coll.peer_sig_lo/hi``) and
  stops the program with ``ctrl.status.cause``
  :attr:`~fpgaccl.proto.regmap.StopCause.SIGNATURE`; the host that drives it raises
  the error. The node tells a GRANT's call by its ImmDt ``coll_id``: one for a later
  program (a peer ahead of our doorbell) is compared when that program starts, one
  for an earlier program (what is left of a failed call) is dropped, and nothing of
  a failed call counts for the next;
* a software rank fails its call, grants the node (if it had not) so that the node
  sees its digest too, and sends ``STEP_MISMATCH`` to its software peers with a
  :func:`digest_record` for the node in place of the record it never got.

Where only digests are known, the error names the field ``digest``.

Host schedules (the software engine's ``tree`` algorithms and all-to-all-v, which run
no program and send no GRANT) check with records instead (:func:`schedule_record`: the
32-byte record, then ``2 * world`` u64 counts, the sender's ``sendcounts`` and
``recvcounts``, zero outside all-to-all-v, then a u64 ``data``: how many bytes of the
sender's first data message to this peer follow, :data:`NO_DATA` if none). The first
message a rank sends a peer in a call is ``RING_IMM(coll_id, final=1,
step=STEP_RECORD)``: its record, with its first data message to that peer appended
where both fit one ring slot (else that data follows as its own message); a rank that
receives from a peer before it sends it anything sends its record alone. A rank lands a
peer's data only once that peer's record agrees, so the check costs no round trip and,
where data flows both ways, no message. With the counts of every rank (all-to-all-v
talks to all), every rank checks the whole count matrix (:func:`counts_difference`)
before it takes a byte, so a pair that disagrees fails every rank alike.
"""

from __future__ import annotations

import functools
import hashlib
import struct
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from enum import IntEnum

import numpy as np

from .reduce import DType, ReduceOp

RECORD = struct.Struct(">QQIIHHHBB")
assert RECORD.size == 32
NONE_ROOT = 0xFFFF
NONE_OP = 0xF
STEP_MISMATCH = 0x7FFC
"""RING_IMM step of a mismatch notice: the offending record, then the detector's."""
STEP_RECORD = 0x7FFD
"""RING_IMM step of a host schedule's record (:func:`schedule_record`)."""
COUNT = struct.Struct(">Q")
NO_DATA = (1 << 64) - 1
"""A schedule record's ``data``: no data message follows it in the same message."""


class Kind(IntEnum):
    ALLREDUCE = 1
    REDUCE = 2
    BROADCAST = 3
    REDUCE_SCATTER = 4
    ALLGATHER = 5
    ALLTOALL = 6
    PROGRAM = 7
    GATHER = 8
    SCATTER = 9
    BARRIER = 10
    ALLTOALLV = 11


@functools.lru_cache(maxsize=256)
def program_digest(name: str, *params: object) -> int:
    """The rank-independent digest of an algorithm: its name and parameters."""
    return zlib.crc32(repr((name, *params)).encode()) or 1


def tag_value(tag: int | str | None) -> int:
    if tag is None:
        return 0
    if isinstance(tag, str):
        return zlib.crc32(tag.encode()) or 1
    return int(tag) & 0xFFFFFFFF


@dataclass(frozen=True)
class Signature:
    seq: int
    kind: Kind
    count: int
    dtype: DType
    op: ReduceOp | None
    root: int | None
    program: int
    tag: int = 0
    rank: int = 0

    def pack(self) -> bytes:
        return RECORD.pack(self.digest, *self._fields(self.rank))

    @functools.cached_property
    def digest(self) -> int:
        return _digest(self._body(0))

    def _fields(self, rank: int) -> tuple:
        return (self.count, self.tag & 0xFFFFFFFF, self.program & 0xFFFFFFFF,
                self.seq & 0xFFFF, NONE_ROOT if self.root is None else self.root,
                rank, int(self.kind),
                (int(self.dtype) << 4) | (NONE_OP if self.op is None else int(self.op)))

    def _body(self, rank: int) -> bytes:
        return RECORD.pack(0, *self._fields(rank))[8:]

    @classmethod
    def unpack(cls, data: bytes | memoryview) -> Signature:
        _, count, tag, prog, seq, root, rank, kind, dop = RECORD.unpack_from(data)
        op = dop & 0xF
        return cls(seq, Kind(kind), count, DType(dop >> 4),
                   None if op == NONE_OP else ReduceOp(op),
                   None if root == NONE_ROOT else root, prog, tag, rank)


def _digest(body: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(body, digest_size=8).digest(), "big") or 1


def _show(field: str, value: object) -> str:
    if value is None:
        return "none"
    if isinstance(value, IntEnum):
        return value.name.lower()
    if field in ("program", "tag"):
        return f"{value:#x}"
    return str(value)


FIELDS = ("kind", "seq", "count", "dtype", "op", "root", "program", "tag")
"""In the order a difference is reported: the first that differs names it."""


def difference(a: Signature, b: Signature) -> tuple[str, tuple[str, str]] | None:
    """The first field in which ``a`` and ``b`` differ, and both values as text."""
    if a.digest == b.digest:
        return None
    for f in FIELDS:
        va, vb = getattr(a, f), getattr(b, f)
        if va != vb:
            return f, (_show(f, va), _show(f, vb))
    return "digest", (f"{a.digest:#x}", f"{b.digest:#x}")


def with_rank(sig: Signature, rank: int) -> Signature:
    return replace(sig, rank=rank)


def digest_record(digest: int, rank: int) -> bytes:
    """A record that knows only ``rank``'s digest (from an HDL node's GRANT): kind 0,
    which no :class:`Kind` is, marks it."""
    return RECORD.pack(digest, 0, 0, 0, 0, NONE_ROOT, rank, 0, 0)


def digest_only(data: bytes | memoryview) -> tuple[int, int] | None:
    """(digest, rank) of a :func:`digest_record`; None for a full record."""
    digest, *_, rank, kind, _ = RECORD.unpack_from(data)
    return (digest, rank) if kind == 0 else None


def schedule_record(sig: Signature, world: int, sendcounts: Sequence[int] | None = None,
                    recvcounts: Sequence[int] | None = None, data: int | None = None) -> bytes:
    """A host schedule's record: ``sig``, then ``world`` sendcounts and ``world``
    recvcounts (u64; zeros where the call has none), then ``data``: the bytes of data
    that follow it in the same message (None: :data:`NO_DATA`)."""
    counts = [0] * (2 * world) if sendcounts is None else [*sendcounts, *recvcounts]
    return sig.pack() + struct.pack(f">{2 * world + 1}Q", *counts,
                                    NO_DATA if data is None else data)


def schedule_record_bytes(world: int) -> int:
    return RECORD.size + (2 * world + 1) * COUNT.size


def schedule_data(record: bytes | memoryview | np.ndarray, world: int) -> int | None:
    """How many bytes of data follow a :func:`schedule_record`; None: no data message."""
    (n,) = COUNT.unpack_from(record, RECORD.size + 2 * world * COUNT.size)
    return None if n == NO_DATA else n


def schedule_counts(data: bytes | memoryview, world: int) -> tuple[tuple[int, ...],
                                                                    tuple[int, ...]]:
    """(sendcounts, recvcounts) of a :func:`schedule_record`."""
    counts = struct.unpack_from(f">{2 * world}Q", data, RECORD.size)
    return counts[:world], counts[world:]


def counts_difference(rows: Mapping[int, tuple[Sequence[int], Sequence[int]]]
                      ) -> tuple[tuple[int, int], tuple[str, str]] | None:
    """The first pair of ranks whose per-peer counts disagree (rank i's sendcounts[j]
    against rank j's recvcounts[i]), from every rank's (sendcounts, recvcounts), in rank
    order so that every rank names the same pair: ((i, j), what each passed)."""
    for i in sorted(rows):
        for j in sorted(rows):
            sent, expected = rows[i][0][j], rows[j][1][i]
            if i != j and sent != expected:
                return (i, j), (f"sends {sent} to rank {j}", f"expects {expected} from rank {i}")
    return None


__all__ = ["COUNT", "FIELDS", "NONE_OP", "NONE_ROOT", "NO_DATA", "RECORD", "STEP_MISMATCH",
           "STEP_RECORD", "Kind", "Signature", "counts_difference", "difference",
           "digest_only", "digest_record", "program_digest", "schedule_counts",
           "schedule_data", "schedule_record", "schedule_record_bytes", "tag_value",
           "with_rank"]
