"""The software sequencer: runs a :mod:`fpgaccl.proto.isa` program for this rank on the
engine's queue pairs, putting on the wire exactly what the HDL node's router does.

Semantics are those of :class:`fpgaccl.sim.models.sequencer.SequencerModel` (the
reference) and of ``hw/sequencer`` + ``hw/datapath/router.py``:

* SETUP ``k``: ``cs = ceil(count / k)``; chunk ``c`` is ``[c*cs, (c+1)*cs)`` clamped to
  ``count`` in IN/OUT (offset and length clamped as the HDL sequencer clamps them), and
  unclamped ``xchunk*cs`` in the buffer the peer's data lands in.
* COPY: a local numpy copy.
* SEND: waits for the peer's next grant (per peer, in arrival order; the grant must be
  for this ``(coll_id, step)``) and posts one RDMA WRITE of ``length`` elements to
  ``peer.buffers[rbuf] + xchunk*cs*elsize`` with the peer's rkey and immediate
  ``COLLECTIVE_IMM(coll_id, grant=0, step)``; the transport segments it at the MTU.
  Later instructions, peers' WRITEs and the caller must not change what a
  retransmission carries. With the C send path the payload is read where it lies
  (``Message.borrowed``), and the engine copies whatever is still unACKed before a
  COPY, a RECV_REDUCE or a landing WRITE touches it (:meth:`Engine.protect`) and when
  the program ends; in the steady state of a ring nothing overlaps, so nothing is
  copied. Without it (Python path, a capture tap or a link shim) the span is
  snapshotted into staged rows as the SEND is posted.
* GRANT: a zero-length RDMA WRITE with ``COLLECTIVE_IMM(coll_id, grant=1, step)`` to
  ``peer.buffers[buf] + xchunk*cs*elsize`` (the HDL sequencer hands the router
  ``dst = buf`` = IN and ``xoffset = 0`` for the library's GRANTs).
* RECV / RECV_REDUCE: wait for the peer's next landed message (in arrival order; it must
  be ``(coll_id, step)``; for the library's collectives also as long as this rank's
  span, so a rank called with another count or element size gets CountMismatchError,
  not a result from stale memory); RECV_REDUCE then computes ``buf[span] = op(src[span],
  rbuf[xchunk*cs : +len])`` with :func:`reduce_into`, bit-exact with
  :func:`fpgaccl.proto.reduce.reduce_reference` (the HDL reduce unit's definition),
  vectorised over the whole span. Where the C fast path can, the reduction happens as
  the message arrives instead (``FOLD_ON_RECEIVE``, :mod:`fpgaccl.host.fold`): a
  RECV_REDUCE that waits arms a fold, the checked MIDDLEs are added straight from the
  receive buffer into ``buf[span]``, and only what landed in ``rbuf`` is reduced here.
* DONE: the program ends (sends may still be awaiting their ACKs: the transport keeps
  retransmitting them, from snapshots or the copies taken at the end).

Memory -- the choice, and its cost
----------------------------------
The HDL router reads a peer's buffer bases and rkey from ``peer`` registers written once
at set-up (:func:`fpgaccl.proto.plans.connect_writes`), so a peer's IN/OUT/TMP/TMP2
addresses cannot change per call. Every engine therefore owns one fixed
:class:`CollectiveRegion`, registered once with one rkey for every QP and advertised at
rendezvous: four equal buffers IN | OUT | TMP | TMP2 of ``stage_bytes`` each (the
:class:`fpgaccl.proto.plans.Peer` shape: one key, four addresses). Peers' WRITEs land
only there. Per call the communicator:

* passes the user's send buffer as IN directly (read-only for the library's programs; a
  program that writes or receives into IN gets it staged into the region's IN first);
* runs the program with OUT/TMP/TMP2 in the region, then copies OUT (only the part the
  caller gets: the whole vector, or chunk r for reduce_scatter) into the user's receive
  buffer: **one extra copy of the result per call** is the cost of fixed regions;
* splits a vector larger than the region into segments, one program run per segment,
  each with its own ``coll_id`` (block-structured collectives -- reduce_scatter,
  allgather, alltoall -- gather each block's slice into IN and scatter OUT back, an
  extra copy on the way in too). The segment size follows from the smallest
  ``stage_bytes`` of all ranks, exchanged at rendezvous, so every rank (software or
  HDL) cuts the same segments. Within a segment the results are bit-identical to
  ``SequencerModel`` running the same program on that segment.

Memory is allocated lazily by the OS (``np.zeros``), so an unused region costs address
space only.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Generator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from fpgaccl.errors import CollectiveMismatchError, CountMismatchError, TransportError
from fpgaccl.proto.isa import PEER_OPS, Buf, Instr, SeqOp, chunk_size
from fpgaccl.proto.reduce import (
    BITWISE_OPS,
    DType,
    ReduceOp,
    average_reference,
    average_scale,
    nan_fixup,
    reduce_reference,
)
from fpgaccl.proto.signature import (
    RECORD,
    STEP_MISMATCH,
    STEP_RECORD,
    Signature,
    difference,
    digest_only,
    digest_record,
)

from . import wire
from .fold import Fold
from .qp import ANY_QP, Arrival, Completion, MemoryRegion, Message, QueuePair

if TYPE_CHECKING:
    from .engine import Engine

N_BUFS = len(Buf)
_EMPTY = memoryview(b"")
DEFAULT_STAGE_BYTES = 64 << 20
"""Bytes of each region buffer. Pages nobody touches are never made resident (peers land
only where a program's grants say), so a large region costs address space, not memory;
what it saves is segments: a 64 MiB 4-rank ring allreduce is 6 messages a rank instead
of 24 at 16 MiB, and each message's FIRST and LAST take the engine's Python loop
(82-86 ms a call against 102-115 here, the peak RSS unchanged)."""
_ALIGN = 4096
FOLD_ON_RECEIVE = True
"""RECV_REDUCE folds its payload into the destination as it arrives, where it can
(host/fold.py). The result is the same bytes without; tests turn it off to show that."""


class ProgramError(TransportError):
    """A program broke a rule of the ISA at run time (wrong message order, bad range)."""


@dataclass(frozen=True)
class RemoteBuffers:
    """What a peer advertised at rendezvous: its four buffer addresses and their rkey."""

    bases: tuple[int, int, int, int]
    rkey: int
    stage_bytes: int


class CollectiveRegion:
    """The engine's registered IN | OUT | TMP | TMP2, written by peers' sequencers."""

    def __init__(self, engine: Engine, stage_bytes: int = DEFAULT_STAGE_BYTES) -> None:
        self.stage_bytes = max(_ALIGN, stage_bytes - stage_bytes % _ALIGN)
        mem = np.zeros(N_BUFS * self.stage_bytes + _ALIGN, np.uint8)
        skip = -mem.ctypes.data % _ALIGN
        self.mem = mem[skip:skip + N_BUFS * self.stage_bytes]
        rkey = int(engine._rng.integers(1, 1 << 32))
        while rkey in engine.mrs:
            rkey = int(engine._rng.integers(1, 1 << 32))
        self.mr = MemoryRegion(rkey, self.mem, ANY_QP)
        engine.mrs[rkey] = self.mr
        self.rkey = rkey
        self.bases = tuple(self.mr.va + i * self.stage_bytes for i in range(N_BUFS))

    def info(self) -> dict:
        """The rendezvous record (JSON)."""
        return {"key": self.rkey, "buffers": list(self.bases), "stage_bytes": self.stage_bytes}

    @staticmethod
    def remote(info: dict) -> RemoteBuffers:
        return RemoteBuffers(tuple(int(b) for b in info["buffers"]), int(info["key"]),
                             int(info["stage_bytes"]))

    def bind_out(self, out: np.ndarray | None) -> None:
        """Let ``out`` (contiguous, writable; None: nothing) stand for the first
        ``out.nbytes`` of OUT: WRITEs that land there go straight into it, as a memory
        window bound over the region would take them. The peers' addresses and key stay
        what the rendezvous gave them. The caller's result then needs no copy out of
        the region; only one program at a time may bind."""
        if out is None:
            self.mr.window = None
            return
        lo = int(Buf.OUT) * self.stage_bytes
        raw = out.reshape(-1).view(np.uint8)
        self.mr.window = (lo, lo + raw.size, MemoryRegion(self.rkey, raw, ANY_QP))

    def view(self, buf: Buf, dtype: np.dtype, count: int | None = None) -> np.ndarray:
        lo = int(buf) * self.stage_bytes
        raw = self.mem[lo:lo + self.stage_bytes]
        arr = raw[:len(raw) - len(raw) % dtype.itemsize].view(dtype)
        return arr if count is None else arr[:count]


# --------------------------------------------------------------------------- arithmetic
_UFUNC = {ReduceOp.SUM: np.add, ReduceOp.PROD: np.multiply, ReduceOp.MIN: np.minimum,
          ReduceOp.MAX: np.maximum, ReduceOp.BAND: np.bitwise_and,
          ReduceOp.BOR: np.bitwise_or, ReduceOp.BXOR: np.bitwise_xor}


def reduce_into(dtype: DType, op: ReduceOp, a: np.ndarray, b: np.ndarray,
                out: np.ndarray) -> None:
    """``out[:] = reduce_reference(dtype, op, a, b)``; ``out`` may alias ``a`` or ``b``.

    Integers and bitwise ops are one ufunc call in place. Float sum/prod compute with
    numpy's ufunc and apply the reference's NaN rule only where a NaN came out (the
    ufunc's non-NaN results are the reference's by definition). Float min/max (with the
    reference's -0 < +0 order) go through :func:`reduce_reference` itself.
    """
    if not dtype.is_float:
        with np.errstate(over="ignore"):
            _UFUNC[op](a, b, out=out)
        return
    if op in BITWISE_OPS:
        raise ValueError(f"{op.name.lower()} is not defined for {dtype.name.lower()}")
    if op is ReduceOp.SUM or op is ReduceOp.PROD:
        ufunc = _UFUNC[op]
        if out.dtype.kind != "f" or out.size <= _SMALL:
            # Short vectors: one NaN test of a temporary result beats testing both inputs.
            _reduce_with_nans(dtype, ufunc, a, b, out)
        elif out.size > _BLOCK_BYTES // out.itemsize:
            _reduce_blocks(dtype, ufunc, a, b, out)
        elif _has_nan(a) or _has_nan(b):
            _reduce_with_nans(dtype, ufunc, a, b, out)
        else:
            # NaN-free inputs (the usual case): straight into ``out``, no temporaries. A
            # NaN can then only come from inf - inf or 0 * inf, and the reference makes
            # every such one its default NaN whatever a and b were, so zeros stand in
            # for them there.
            with np.errstate(all="ignore"):
                ufunc(a, b, out=out)
            if _has_nan(out):
                nan = np.isnan(out)
                r = out[nan]
                out[nan] = nan_fixup(dtype, np.zeros_like(r), np.zeros_like(r), r)
        return
    out[...] = reduce_reference(dtype, op, a, b)


def average_into(dtype: DType, summed: np.ndarray, n: int, out: np.ndarray) -> None:
    """``out[:] = average_reference(dtype, summed, n)`` (``op="avg"``'s scaling); ``out``
    may alias ``summed``. Floats take :func:`reduce_into`'s fast PROD by the rounded
    ``1/n``, which is the reference's definition."""
    if dtype.is_float:
        scale = np.broadcast_to(average_scale(dtype, n), summed.shape)
        reduce_into(dtype, ReduceOp.PROD, summed, scale, out)
    else:
        out[...] = average_reference(dtype, summed, n)


_SMALL = 4096  # elements


def _reduce_with_nans(dtype: DType, ufunc: np.ufunc, a: np.ndarray, b: np.ndarray,
                      out: np.ndarray) -> None:
    with np.errstate(all="ignore"):
        r = ufunc(a, b)
    if _has_nan(r):
        r = nan_fixup(dtype, a, b, r)
    out[...] = r


_BLOCK_BYTES = 256 << 10  # a, b and the scratch block fit a 1 MiB L2 together
_scratch = threading.local()


def _reduce_blocks(dtype: DType, ufunc: np.ufunc, a: np.ndarray, b: np.ndarray,
                   out: np.ndarray) -> None:
    """Float sum/prod of long vectors a cache-sized block at a time, each block checked
    for NaN while it is still in cache: three passes over memory instead of the six that
    checking ``a``, ``b`` and ``out`` whole takes.

    Where ``out`` overlaps neither input (the ring's RECV_REDUCE: OUT = op(IN, TMP)) a
    block goes straight into ``out``, and one with a NaN is redone from the intact
    inputs. Otherwise it is computed into a scratch block and copied to ``out``, so the
    inputs of a block with a NaN are still there for the reference's NaN rule: one
    more pass (a 4 MiB float32 sum took 0.85 ms this way, 0.59 ms straight)."""
    step = _BLOCK_BYTES // out.itemsize
    minimum, isnan = np.minimum.reduce, np.isnan
    tmp = None
    if np.may_share_memory(out, a) or np.may_share_memory(out, b):
        tmp = getattr(_scratch, out.dtype.str, None)
        if tmp is None:
            tmp = np.empty(step, out.dtype)
            setattr(_scratch, out.dtype.str, tmp)
    with np.errstate(all="ignore"):
        for lo in range(0, out.size, step):
            hi = min(lo + step, out.size)
            r = out[lo:hi] if tmp is None else tmp[:hi - lo]
            ufunc(a[lo:hi], b[lo:hi], out=r)
            if isnan(minimum(r, axis=None)):
                r[...] = nan_fixup(dtype, a[lo:hi], b[lo:hi], r.copy())
            if tmp is not None:
                out[lo:hi] = r


def _has_nan(x: np.ndarray) -> bool:
    # minimum.reduce propagates NaN and runs vectorised: ~3x faster than isnan().any(),
    # and no temporary.
    return x.size > 0 and bool(np.isnan(np.minimum.reduce(x, axis=None)))


# --------------------------------------------------------------------------- execution
class _Head:
    """Waitable for the engine's sequencer loop: done once ``queue`` is non-empty."""

    __slots__ = ("queue",)
    error = None

    def __init__(self, queue: deque) -> None:
        self.queue = queue

    @property
    def done(self) -> bool:
        return bool(self.queue)


class _Either:
    """Waitable: done once ``queue`` is non-empty or a mismatch notice has come."""

    __slots__ = ("check", "queue")
    error = None

    def __init__(self, queue: deque | None, check: SignatureCheck) -> None:
        self.queue = queue
        self.check = check

    @property
    def done(self) -> bool:
        return bool(self.queue) or self.check.notice() is not None


ASK_S = 1.0
"""How long a rank that queried a software peer about its differing digest waits for the
answer (both records, which name the field) before it reports the two digests alone."""


class SignatureCheck:
    """One call's signature check (:mod:`fpgaccl.proto.signature`) on the engine thread.

    Every GRANT carries its sender's digest, so the check costs no message: before this
    rank sends a byte to a peer it compares the digest of that peer's GRANT with its
    own (:meth:`settle`), and a peer's data arrives only after the peer did the same
    with this rank's GRANT. A difference becomes an error on every rank:

    * from a software peer, this rank sends that peer a query (a notice whose first
      record is only the peer's digest, the second this rank's record) and waits; the
      peer, which holds both records, sends every software peer the notice with both,
      so every rank names the field that differs. Without an answer within
      :data:`ASK_S` this rank falls back to the digests;
    * from an HDL peer, only the digests are known: this rank fails, grants the node
      (if it had not) so that the node sees the difference too, and tells its software
      peers with a :func:`~fpgaccl.proto.signature.digest_record` for the node.
    """

    def __init__(self, engine: Engine, mine: Signature, program: Sequence[Instr],
                 coll_id: int, software: frozenset[int],
                 coll_ids: Sequence[int] = ()) -> None:
        self.engine = engine
        self.mine = mine
        self.coll_id = coll_id & 0xFFFF
        # The call's segments: a grant of one of them is this call's.
        self.coll_ids = frozenset(c & 0xFFFF for c in coll_ids) or {self.coll_id}
        self.software = software
        self.granted: set[int] = set()   # peers this call has sent a GRANT
        self.regrant: Callable[[int], object] | None = None
        """Sends an HDL peer a GRANT with this rank's digest (set by the executor)."""
        self.error: CollectiveMismatchError | None = None
        self.asked: tuple[float, CollectiveMismatchError] | None = None
        """A software peer was queried: until when to wait, and the digests' error."""
        self.sent: list[Completion] = []      # the notices this rank sent
        self.digest = mine.digest
        self.seen = -1     # the engine's events when this call last looked
        drain_stale(engine, self.coll_id, software)
        self.hdl = frozenset() if len(software) == len(engine.by_peer) else \
            frozenset(i.peer for i in program if i.op in PEER_OPS) - software
        # Notices are rare: rather than a receive posted per peer and call, they are
        # looked for among the messages no receive took.
        self.rings = [q for p in sorted(software) if (q := engine.by_peer.get(p))]

    def notice(self) -> CollectiveMismatchError | None:
        """The call's mismatch, once known (a notice came, or a GRANT differs)."""
        if self.error is not None:
            return self.error
        if self.asked is not None and time.monotonic() > self.asked[0]:
            self.error = self.asked[1]   # the peer never answered: digests only
            self._tell(self._digest_note(self.error))
            return self.error
        # Polled by every wait of the call: look again only once something came.
        events = self.engine.events
        if events == self.seen:
            return None
        self.seen = events
        for qp in self.rings:
            if not qp.arrived:
                continue
            if (buf := take_notice(self.engine, qp, self.coll_ids)) is not None:
                self._take_notice(buf)
                return self.error
            if (buf := take_notice(self.engine, qp, self.coll_ids, STEP_RECORD)) is not None:
                # The peer runs a host schedule for this call, this rank a program.
                theirs = Signature.unpack(buf)
                self.error = mismatch_error(self.mine, theirs)
                self._tell(memoryview(theirs.pack() + self.mine.pack()))
                return self.error
        if self.asked is None:
            self._grants()
        return self.error

    def _take_notice(self, buf: np.ndarray) -> None:
        about, second = digest_only(buf[:RECORD.size]), buf[RECORD.size:]
        if about is not None and about[1] == self.mine.rank and digest_only(second) is None:
            # A query about this rank's digest: with the asker's record and this rank's,
            # every rank can name the field.
            theirs = Signature.unpack(second)
            self.error = mismatch_error(self.mine, theirs)
            self._tell(memoryview(self.mine.pack() + theirs.pack()))
        else:
            self.error = notice_error(buf)

    def _grants(self) -> None:
        # While this rank waits, only an HDL peer's GRANT can tell it of a difference
        # (a node that stopped grants the rank it differs from); a software peer asks.
        mine = self.digest
        for p in self.hdl:
            qp = self.engine.by_peer.get(p)
            if qp is None:
                continue
            for coll, _step, digest in qp.grants:
                if coll in self.coll_ids and digest and digest != mine:
                    self._differs(p, digest)
                    return

    def _differs(self, p: int, digest: int) -> None:
        """Peer ``p``'s GRANT of this call carries ``digest``, not this rank's."""
        error = digest_mismatch_error(p, digest, self.mine.rank, self.digest)
        note = memoryview(digest_record(digest, p) + self.mine.pack())
        if p in self.software:
            self.engine.send(p, self.coll_id, STEP_MISMATCH, note)
            self.asked = (time.monotonic() + ASK_S, error)
            return
        self.error = error
        self._tell(note)
        if p not in self.granted and self.regrant is not None:
            self.regrant(p)

    @staticmethod
    def _digest_note(error: CollectiveMismatchError) -> memoryview:
        (ra, rb), (da, db) = error.ranks, error.values
        return memoryview(digest_record(int(da, 16), ra) + digest_record(int(db, 16), rb))

    def _tell(self, note: memoryview) -> None:
        self.sent += [self.engine.send(p, self.coll_id, STEP_MISMATCH, note)
                      for p in sorted(self.software)]

    def waiting(self, queue: deque | None) -> _Either:
        return _Either(queue, self)

    def unsettled(self, peer: int = -1, grants: deque | None = None) -> bool:
        """Before a byte goes to ``peer``, whose next GRANT heads ``grants``: whether
        there is a mismatch to raise or an answer to wait for (then :meth:`settle`)."""
        if grants and self.error is None and self.asked is None:
            coll, _step, digest = grants[0]
            if coll in self.coll_ids and digest and digest != self.digest:
                self._differs(peer, digest)
        return self.notice() is not None or self.asked is not None

    def settle(self) -> Generator[Any, None, None]:
        """Raise the call's mismatch, waiting for a queried peer's answer first."""
        while self.notice() is None and self.asked is not None:
            yield _Either(None, self)
        if self.error is not None:
            # Leave only once the notices are out: a rank whose process ends at once
            # would leave the others to time out instead of raising this error.
            with contextlib.suppress(Exception):
                yield self.sent
            raise self.error


def mismatch_error(a: Signature, b: Signature) -> CollectiveMismatchError:
    """The error for two records that differ, ordered by rank, so that every rank
    raises the same error from the same pair."""
    if a.rank > b.rank:
        a, b = b, a
    field, values = difference(a, b) or ("digest", ("?", "?"))
    return CollectiveMismatchError.of(field, (a.rank, b.rank), values)


def notice_error(buf: np.ndarray) -> CollectiveMismatchError:
    """The error a mismatch notice (two records) names: the field, where both records
    are whole; else the two digests (a :func:`~fpgaccl.proto.signature.digest_record`
    stands for a rank whose record was never seen)."""
    first, second = buf[:RECORD.size], buf[RECORD.size:]
    a, b = digest_only(first), digest_only(second)
    if a is None and b is None:
        return mismatch_error(Signature.unpack(first), Signature.unpack(second))
    if a is None:
        a = (Signature.unpack(first).digest, Signature.unpack(first).rank)
    if b is None:
        b = (Signature.unpack(second).digest, Signature.unpack(second).rank)
    return digest_mismatch_error(a[1], a[0], b[1], b[0])


def digest_mismatch_error(rank_a: int, digest_a: int, rank_b: int,
                          digest_b: int) -> CollectiveMismatchError:
    """The error where only the two ranks' digests are known (an HDL node's, from its
    GRANT or its registers), ordered by rank like :func:`mismatch_error`."""
    (ra, da), (rb, db) = sorted(((rank_a, digest_a), (rank_b, digest_b)))
    return CollectiveMismatchError.of("digest", (ra, rb), (f"{da:#x}", f"{db:#x}"))


def take_notice(engine: Engine, qp: QueuePair, coll_ids: Collection[int],
                step: int = STEP_MISMATCH) -> np.ndarray | None:
    """The first slot of a ring message of ``step`` (a mismatch notice, or a host
    schedule's record) for one of ``coll_ids`` that no receive took, taken off ``qp``'s
    arrivals (its slot given back); None if none came."""
    for a in qp.arrived:
        if a.coll_id in coll_ids and a.step & ~wire.STEP_FINAL == step:
            qp.arrived.remove(a)
            start = a.slot * engine.matcher.slot_bytes
            buf = np.frombuffer(bytes(qp.ring.buf[start:start + a.length]), np.uint8)
            qp.give_back(a.slot)
            least = 2 * RECORD.size if step == STEP_MISMATCH else RECORD.size
            return buf if len(buf) >= least else None
    return None


def drain_stale(engine: Engine, coll_id: int, software: frozenset[int]) -> None:
    """Give back the ring slots of notices and schedule records of calls before
    ``coll_id`` that no receive took (a peer set that differed, a notice after the call
    ended, a schedule's record to a rank that ran a program)."""
    def stale(a: Arrival) -> bool:
        return a.step & ~wire.STEP_FINAL in (STEP_MISMATCH, STEP_RECORD) and \
            0 < (coll_id - a.coll_id) & 0xFFFF < 0x8000

    for p in software:
        qp = engine.by_peer.get(p)
        if qp is not None and qp.arrived:
            qp.give_back_arrived(stale)


def setup_chunks(program: Sequence[Instr]) -> int:
    """The largest chunk count any SETUP of ``program`` asks for (1 without SETUP)."""
    return _facts(program)[1]


def writes_in(program: Sequence[Instr]) -> bool:
    """Whether the program writes IN locally or waits for data landed in IN."""
    return _facts(program)[2]


_FACTS: dict[int, tuple[Sequence[Instr], int, bool]] = {}


def _facts(program: Sequence[Instr]) -> tuple[Sequence[Instr], int, bool]:
    """(program, setup_chunks, writes_in). A tuple (the communicator's cached library
    programs) is looked at once; the entry holds the tuple, so its id stays its own."""
    if isinstance(program, tuple):
        got = _FACTS.get(id(program))
        if got is not None and got[0] is program:
            return got
    nch = max((i.step for i in program if i.op is SeqOp.SETUP), default=1)
    w_in = any((i.op in (SeqOp.COPY, SeqOp.RECV) and i.buf is Buf.IN)
               or (i.op is SeqOp.RECV_REDUCE and Buf.IN in (i.buf, i.rbuf)) for i in program)
    got = (program, nch, w_in)
    if isinstance(program, tuple):
        if len(_FACTS) >= 512:
            _FACTS.clear()
        _FACTS[id(program)] = got
    return got


def execute(engine: Engine, region: CollectiveRegion, remotes: dict[int, RemoteBuffers],
            program: Sequence[Instr], *, rank: int, coll_id: int, count: int, dtype: DType,
            op: ReduceOp, inbuf: np.ndarray, outbuf: np.ndarray | None = None,
            check_lengths: bool = False,
            signatures: SignatureCheck | None = None) -> Generator[Any, None, None]:
    """Run ``program`` on this rank (a generator for :meth:`Engine.submit`).

    ``inbuf``: at least ``count`` elements of the user's input (IN); ``outbuf``: the
    user's ``count`` result elements to serve as OUT (bound over the region's OUT while
    the program runs: peers' WRITEs to OUT land in it), or None for the region's OUT.
    TMP/TMP2 are the region's. Yields waitables while a grant or message is outstanding.
    ``check_lengths``: every landed message must be as long as the span of the RECV or
    RECV_REDUCE that takes it, else CountMismatchError (the ISA itself, like the HDL,
    reads only the tag of a RECV: the library's programs keep their spans exact, so for
    them a different length means a rank called with another count or element size).
    ``signatures``: the call's :class:`SignatureCheck`; a peer's record is checked before
    this rank sends to it, takes a message from it or (``outbuf`` bound) grants it.
    """
    region.bind_out(outbuf)
    try:
        yield from _execute(engine, region, remotes, program, rank=rank, coll_id=coll_id,
                            count=count, dtype=dtype, op=op, inbuf=inbuf, outbuf=outbuf,
                            check_lengths=check_lengths, sig=signatures)
    finally:
        # Every WRITE to OUT was RECVed before DONE, so none can still be landing.
        region.bind_out(None)
        # The caller gets its buffers back, and the next program reuses the region: SENDs
        # still unACKed keep copies of what they may have to resend.
        engine.protect_all()


def _execute(engine: Engine, region: CollectiveRegion, remotes: dict[int, RemoteBuffers],
             program: Sequence[Instr], *, rank: int, coll_id: int, count: int, dtype: DType,
             op: ReduceOp, inbuf: np.ndarray, outbuf: np.ndarray | None,
             check_lengths: bool, sig: SignatureCheck | None) -> Generator[Any, None, None]:
    nt = dtype.numpy_dtype()
    isz = nt.itemsize
    coll_id &= 0xFFFF
    if writes_in(program):
        staged = region.view(Buf.IN, nt, len(inbuf))
        if not np.shares_memory(staged, inbuf):
            staged[...] = inbuf
        inbuf = staged
    bufs = [inbuf, region.view(Buf.OUT, nt, count) if outbuf is None else outbuf,
            region.view(Buf.TMP, nt), region.view(Buf.TMP2, nt)]
    cap = region.stage_bytes // isz
    nchunks, cs = 1, count
    by_peer = engine.by_peer
    mtu = engine.mtu
    post_grant = wire.collective_imm
    digest = 0 if sig is None else sig.digest
    engine.dead_colls.discard(coll_id)   # an id reused after 2**16 calls
    if sig is not None:
        sig.regrant = functools.partial(_regrant, engine, remotes, coll_id, digest)
    for pc, ins in enumerate(program):
        o = ins.op
        if o is SeqOp.SETUP:
            if ins.step == 0:
                raise ProgramError(f"rank {rank} pc {pc}: SETUP of zero chunks")
            nchunks, cs = ins.step, chunk_size(count, ins.step)
            if nchunks * cs > cap:
                raise ProgramError(f"rank {rank}: {nchunks} chunks of {cs} elements exceed "
                                   f"the {region.stage_bytes}-byte region")
            continue
        if o is SeqOp.DONE:
            return
        if o is SeqOp.NOP:
            continue
        if o is not SeqOp.GRANT and o is not SeqOp.RECV and ins.chunk + ins.count > nchunks:
            raise ProgramError(f"rank {rank} pc {pc}: chunks [{ins.chunk}, "
                               f"{ins.chunk + ins.count}) beyond {nchunks}")
        first = min(ins.chunk * cs, count)
        last = min((ins.chunk + ins.count) * cs, count)
        if o is SeqOp.COPY:
            dst = bufs[ins.buf][first:last]
            if engine.borrowed:
                _protect(engine, dst)
            dst[...] = bufs[ins.src][first:last]
            continue
        qp = by_peer.get(ins.peer)
        if qp is None:
            raise ProgramError(f"rank {rank} pc {pc}: no queue pair to rank {ins.peer}")
        remote = remotes[ins.peer]
        xoff = ins.xchunk * cs
        if o is SeqOp.GRANT:
            # The VA is not validated (zero length): it carries the digest, 0 for none.
            qp.post_direct(Message(_EMPTY, post_grant(coll_id, True, ins.step), None,
                                   va=digest, rkey=remote.rkey))
            if sig is not None:
                sig.granted.add(ins.peer)
            continue
        if o is SeqOp.SEND:
            q = qp.grants
            if not q:
                yield _Head(q) if sig is None else sig.waiting(q)
            if sig is not None and sig.unsettled(ins.peer, q):   # before a byte goes
                yield from sig.settle()
            _take(q, coll_id, ins, rank, "grant")
            nbytes = (last - first) * isz
            if (xoff * isz + nbytes > remote.stage_bytes):
                raise ProgramError(f"rank {rank} pc {pc}: SEND of {nbytes} bytes at element "
                                   f"{xoff} overruns rank {ins.peer}'s region")
            imm = post_grant(coll_id, False, ins.step)
            va = remote.bases[ins.rbuf] + xoff * isz
            if nbytes > 2 * mtu and engine.zero_copy:
                # No snapshot: the payload is read where it lies, and the engine copies
                # what is still unACKed before anything writes there (Engine.protect).
                msg = Message.borrowed(bufs[ins.src][first:last], imm, va=va,
                                       rkey=remote.rkey)
                engine.borrowed[id(msg)] = msg
            elif nbytes > 2 * mtu:
                # The snapshot, staged as the datagrams of its MIDDLE packets.
                msg = Message.staged(bufs[ins.src][first:last], mtu, imm, va=va,
                                     rkey=remote.rkey, pool=engine.row_pool)
            else:
                msg = Message(memoryview(bufs[ins.src][first:last].tobytes()), imm, None,
                              va=va, rkey=remote.rkey)  # the snapshot
            qp.post_direct(msg)
            continue
        if o is SeqOp.RECV or o is SeqOp.RECV_REDUCE:
            q = qp.landed
            fold = None
            if not q:
                if (o is SeqOp.RECV_REDUCE and FOLD_ON_RECEIVE and engine.fastpath is not None
                        and (last - first) * isz > 2 * mtu):  # else FIRST and LAST alone
                    n = last - first
                    dst = bufs[ins.buf][first:last]
                    fold = Fold.make(dtype, op, bufs[ins.src][first:last],
                                     bufs[ins.rbuf][xoff:xoff + n], dst)
                    if fold is not None:
                        if engine.borrowed:
                            _protect(engine, dst)  # written from the first packet on
                        qp.arm_fold(fold)
                try:
                    yield _Head(q) if sig is None else sig.waiting(q)
                    if sig is not None and sig.unsettled():
                        yield from sig.settle()
                finally:
                    if fold is not None:
                        qp.disarm_fold()
            got = _take(q, coll_id, ins, rank, "message")
            if check_lengths and got[2] != (last - first) * isz:
                raise CountMismatchError(
                    "sendbuf", f"rank {ins.peer} sent {got[2]} bytes for step {ins.step} "
                    f"where rank {rank} expects {(last - first) * isz} ({last - first} "
                    f"x {dtype.name.lower()}): every rank must pass the same count and "
                    "dtype")
            if o is SeqOp.RECV_REDUCE:
                n = last - first
                # Elements folded as they arrived are done; the rest landed in memory.
                k = 0 if fold is None else fold.done // isz
                if k < n:
                    dst = bufs[ins.buf][first + k:last]
                    if engine.borrowed:
                        _protect(engine, dst)
                    reduce_into(dtype, op, bufs[ins.src][first + k:last],
                                bufs[ins.rbuf][xoff + k:xoff + n], dst)
            continue
        raise ProgramError(f"rank {rank} pc {pc}: unknown op {o!r}")
    raise ProgramError(f"rank {rank}: program ran off its end without DONE")


def _regrant(engine: Engine, remotes: dict[int, RemoteBuffers], coll_id: int, digest: int,
             peer: int) -> None:
    engine.by_peer[peer].post_direct(Message(_EMPTY, wire.collective_imm(coll_id, True, 0),
                                             None, va=digest, rkey=remotes[peer].rkey))


def _protect(engine: Engine, dst: np.ndarray) -> None:
    lo = dst.__array_interface__["data"][0]
    engine.protect(lo, lo + dst.nbytes)


def _take(q: deque, coll_id: int, ins: Instr, rank: int, what: str) -> tuple:
    got = q.popleft()
    if got[0] != coll_id or got[1] != ins.step & wire.IMM_STEP_MASK:
        raise ProgramError(f"rank {rank} waits for {what} (coll {coll_id}, step {ins.step}) "
                           f"from rank {ins.peer}, but (coll {got[0]}, step {got[1]}) "
                           "arrived first")
    return got


__all__ = ["DEFAULT_STAGE_BYTES", "CollectiveRegion", "ProgramError", "RemoteBuffers",
           "SignatureCheck", "average_into", "digest_mismatch_error", "execute",
           "mismatch_error", "reduce_into", "setup_chunks", "writes_in"]
