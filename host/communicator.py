"""The API users program against: a communicator of ``world_size`` ranks.

Every call validates its arguments on the calling rank (typed errors naming the
argument), picks a sequencer program from :mod:`fpgaccl.proto.programs` -- the very
programs the HDL sequencer runs --, cuts the vector into segments the engine's region
holds and numbers them, and hands that to the rank's backend
(:mod:`fpgaccl.host.backends`): the software engine, a simulated HDL node or a board.
What the library has no program for (send/recv, the ``tree`` algorithms and
alltoallv's ``direct`` one) runs as a host schedule from :mod:`fpgaccl.host.algorithms`
on a backend that has them; alltoallv's ``padded`` algorithm is made of library
programs and runs on every backend. Synchronous calls wait; with ``async_op=True`` they return a
:class:`Handle`.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import math
import operator
import os
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from fpgaccl.errors import (
    AbortedError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    CountMismatchError,
    DtypeMismatchError,
    InvalidArgumentError,
    UnsupportedError,
)
from fpgaccl.proto import programs as lib
from fpgaccl.proto.isa import Buf, Instr, checked_program
from fpgaccl.proto.reduce import DType, ReduceOp
from fpgaccl.proto.signature import (
    Kind,
    Signature,
    counts_difference,
    program_digest,
    tag_value,
)

from . import algorithms as alg
from .backends import Backend, open_backend
from .backends.base import Finished, Pending, Program, ProgramRun, Segment
from .buffers import AVG, UserBuffer, as_buffer, resolve_op
from .executor import average_into, setup_chunks
from .flight import Entry, FlightRecorder

ALGOS = {
    "allreduce": ("ring", "rhd", "rd", "tree"),
    "reduce": ("chain", "tree"),
    "broadcast": ("tree", "chain"),
    "reduce_scatter": ("ring",),
    "allgather": ("ring",),
    "alltoall": ("direct",),
    "alltoallv": ("direct", "padded"),
}
RD_MAX_BYTES = 256 << 10
"""allreduce: recursive doubling up to here (fewest steps: a step costs far more than its
bytes on the software backend), then halving-doubling."""
RHD_MAX_BYTES = 1 << 20
"""allreduce in a world that is not a power of two: halving-doubling up to here, the
ring beyond, since there halving-doubling first folds the extra ranks' whole vectors
into their neighbours. A world of 2^k ranks pays no such fold and sends fewer messages
than the ring (2k against 2(2^k - 1)), so it uses halving-doubling at every size
(measurements: bench/README.md)."""


def _allreduce_default(nbytes: int, world: int) -> str:
    """The allreduce program for ``nbytes`` in a world of ``world`` ranks (see
    :data:`RD_MAX_BYTES` and :data:`RHD_MAX_BYTES`)."""
    if nbytes <= RD_MAX_BYTES:
        return "rd"
    if nbytes <= RHD_MAX_BYTES or world & (world - 1) == 0:
        return "rhd"
    return "ring"


_ALLREDUCE_PROGRAMS = {"ring": lib.ring_allreduce, "rhd": lib.rhd_allreduce,
                       "rd": lib.rd_allreduce}
BIND_MIN_BYTES = 64 << 10
"""allreduce: results larger than this are written straight into the caller's array
(bound over the region's OUT); below it, copying OUT out is cheaper than the binding."""
CHAIN_SEGMENT_BYTES = 64 * 1024
"""chain broadcast/reduce: pipeline segments of about this size (4 to 64 of them)."""


@functools.lru_cache(maxsize=256)
def _library(gen: Any, *args: Any) -> tuple[Instr, ...]:
    """A library program, built once per (generator, arguments): building one costs
    ~50 us, a sizeable part of a small collective. Instructions are frozen; the tuple
    cannot be changed by whoever runs it."""
    return tuple(gen(*args))


# numpy's dtype.name is Python-level and slow (~20 us a call): look each up once.
_dtype_of = functools.lru_cache(maxsize=64)(DType.from_numpy)
_op_of = functools.lru_cache(maxsize=64)(ReduceOp.from_name)


def _tag(tag: Any) -> int:
    """The signature's tag: an int of 32 bits or a str (its CRC-32); None: no tag."""
    if tag is None or isinstance(tag, str):
        return tag_value(tag)
    if isinstance(tag, int | np.integer) and not isinstance(tag, bool) and \
            0 <= tag < 1 << 32:
        return tag_value(int(tag))
    raise InvalidArgumentError("tag", f"{tag!r} must be a str or an int in 0..2**32-1")


def _discard(out: np.ndarray, lo: int, hi: int) -> None:
    """put_out of a rank that gets no result (a gather's non-root)."""


def chain_segments(nbytes: int) -> int:
    return max(4, min(64, nbytes // CHAIN_SEGMENT_BYTES))


def _same_dtype(s: UserBuffer, r: UserBuffer) -> None:
    if r.array.dtype != s.array.dtype:
        raise DtypeMismatchError("recvbuf", f"{r.array.dtype} differs from sendbuf's "
                                 f"{s.array.dtype}")


class Handle:
    """An in-flight collective: ``wait()`` returns its result, ``test()`` polls it."""

    def __init__(self, job: Pending, result: Any, keep: Sequence[UserBuffer],
                 rank: int, flight: tuple[FlightRecorder, Entry] | None = None) -> None:
        self._job = job
        self._result = result
        self._keep = keep  # buffers must outlive the transfer
        self._rank = rank
        self._finished = False
        self._flight = flight

    def test(self) -> bool:
        done = self._job.event.is_set()
        if done:
            self._complete()
        return done

    def wait(self, timeout: float | None = None) -> Any:
        """The call's result; with ``timeout``, CollectiveTimeoutError if it is still
        running then. Without one it waits for the backend: the deadline bounds a wait
        without progress, so a healthy call may run far longer, and the engine ends every
        job itself (a dead engine thread fails them all)."""
        if not self.ready(timeout):
            raise CollectiveTimeoutError(self._job.name, self._rank, timeout,
                                         "still running at wait(timeout)")
        self._complete()
        return self._result

    def is_ready(self) -> bool:
        """Whether the call is over (neither waits nor raises)."""
        return self._job.event.is_set()

    def ready(self, timeout: float | None = None, *, drive: bool = True) -> bool:
        """Whether the call is over within ``timeout`` seconds (None: waits until it is),
        without its result or error (:meth:`wait` then gives them at once). ``drive``
        False: never run the engine on this thread, only wait for whichever thread
        does."""
        event = self._job.event
        wait = event.wait if drive else getattr(event, "wait_set", event.wait)
        if timeout is not None:
            return wait(min(max(timeout, 0.0), threading.TIMEOUT_MAX))
        while not wait(min(3600.0, threading.TIMEOUT_MAX)):
            pass
        return True

    def _complete(self) -> None:
        if self._job.error is not None:
            if self._flight is not None:
                self._flight[0].failed(self._flight[1], self._job.error)
            raise self._job.error
        if not self._finished:
            self._finished = True
            for ub in self._keep:
                if ub.finish is not None:
                    ub.finish()


def check_world(rank: int, world_size: int, deadline_s: float) -> None:
    """The arguments every backend takes, checked alike."""
    if not isinstance(world_size, int) or world_size < 1:
        raise InvalidArgumentError("world_size", f"{world_size!r} must be a positive int")
    if not isinstance(rank, int):
        raise InvalidArgumentError("rank", f"must be an int, not {type(rank).__name__}")
    if not 0 <= rank < world_size:
        raise InvalidArgumentError("rank", f"{rank!r} is outside 0..{world_size - 1}")
    # Every wait below adds a margin to the deadline and hands it to a lock: it must be
    # a finite number of seconds.
    if (isinstance(deadline_s, bool) or not isinstance(deadline_s, (int, float))
            or not math.isfinite(deadline_s) or deadline_s <= 0):
        raise InvalidArgumentError("deadline_s", f"{deadline_s!r} must be a finite number "
                                   "of seconds > 0")


class Communicator:
    """``world_size`` ranks running collectives on one engine each.

    ``backend`` names the engine (:mod:`fpgaccl.host.backends`): ``"software"`` (the
    default: RoCEv2 over UDP from this process), ``"sim"`` (a node of the
    Verilator-simulated cluster) or ``"board"`` (a DMA-capable engine driven through its
    registers and queues). Keyword options go to the backend: the software engine's are
    ``master_addr``, ``master_port``, ``bind_ip``, ``mtu``, ``rto_s``, ``impair``,
    ``pcap``, ``slot_bytes``, ``slots``, ``initial_psn``, ``rendezvous_timeout_s``,
    ``stage_bytes``, ``socket_buffer_bytes``, ``peer_timeout_s`` and ``retry_limit``; the
    others take what applies to them.

    ``deadline_s`` (default: the backend's, 60 s for the software one) bounds how long a
    call may wait without progress, not how long it may take: on the software backend
    the call fails with :class:`~fpgaccl.errors.RanksTimeoutError` (a
    ``CollectiveTimeoutError``; ``ranks`` names whom it waited on) once neither it nor
    the transport has moved for ``deadline_s``, so a large call on a slow link completes
    however long it runs. A dead peer is the transport's to find, sooner: one that ACKs
    nothing outstanding (or answers no probe while a call waits) for ``peer_timeout_s``
    (1.25 s), or lets ``retry_limit`` (7) retransmissions go unACKed, fails every call
    with :class:`~fpgaccl.errors.PeerDeadError` (a ``TransportError`` and a
    ``CollectiveTimeoutError``; ``peer`` names it) and leaves the communicator unusable.

    ``check_calls`` (default on; FPGACCL_CHECK_CALLS=0 in the environment turns it off)
    makes every rank compare each collective's signature with its peers'
    (:mod:`fpgaccl.proto.signature`: the digest travels in every GRANT, so it costs no
    message) and raise :class:`~fpgaccl.errors.CollectiveMismatchError` on all of them
    where they disagree, before a byte of the call is written.

    :meth:`split` makes sub-communicators (MPI_Comm_split), :meth:`abort` fails every
    pending call at once from any thread, and :meth:`flight_record` returns the last
    calls (:mod:`fpgaccl.host.flight`).
    """

    def __init__(self, rank: int, world_size: int, backend: str = "software", *,
                 deadline_s: float | None = None, check_calls: bool | None = None,
                 **options: Any) -> None:
        opener, default_deadline = open_backend(backend)
        deadline_s = default_deadline if deadline_s is None else deadline_s
        check_world(rank, world_size, deadline_s)
        if check_calls is None:
            check_calls = os.environ.get("FPGACCL_CHECK_CALLS", "1") not in ("0", "false", "no")
        self._setup(rank, world_size, backend, deadline_s, bool(check_calls), "world")
        self.impl: Backend = opener(rank, world_size, **options)
        """The backend's object (:class:`fpgaccl.host.backends.Backend`)."""

    def _setup(self, rank: int, world_size: int, backend: str, deadline_s: float,
               check_calls: bool, label: str) -> None:
        self.rank = rank
        self.world_size = world_size
        self.backend = backend
        self.deadline_s = deadline_s
        self.check_calls = check_calls
        self.label = label
        """Which communicator this is: ``world``, or its parent's label and
        ``.split<N>`` (the N-th split of the parent)."""
        self._coll = 0
        self._calls = 0  # the signature's sequence number
        self._splits = itertools.count(1)
        self._p2p_send = [0] * world_size
        self._p2p_recv = [0] * world_size
        self._lock = threading.Lock()
        self._closed = False
        self._aborted = False
        self._subs: weakref.WeakSet[Communicator] = weakref.WeakSet()  # abort() reaches them
        self.flight = FlightRecorder(label, rank, world_size)

    @property
    def stage_bytes(self) -> int:
        """Bytes of the engine's region every rank cuts its segments from."""
        return self.impl.stage_bytes

    @property
    def clock_mhz(self) -> float | None:
        """The engine's clock where times are counted in its cycles (simulation)."""
        return self.impl.clock_mhz

    # ------------------------------------------------------------------ plumbing
    def _start(self, fields: tuple, start: Callable[[], Pending]) -> tuple[Pending, Entry]:
        """Record the call in the flight recorder (``fields``: what it shows of the
        call), then ``start()`` it: a blocking call may run to its end, or hang, in
        there, and the record shows it meanwhile."""
        entry = self.flight.record(None, fields)
        try:
            job = start()
        except BaseException as e:
            self.flight.failed(entry, e)
            raise
        entry.job = job
        return job, entry

    def _handle(self, job: Pending, result: Any, keep: list[UserBuffer],
                async_op: bool, fields: tuple, entry: Entry | None = None) -> Any:
        """Wrap ``job`` in a Handle, recorded in the flight recorder (``fields``) unless
        :meth:`_start` recorded it as ``entry``."""
        flight = self.flight
        if entry is None:
            entry = flight.record(job, fields)
        handle = Handle(job, result, keep, self.rank, (flight, entry))
        return handle if async_op else handle.wait()

    def _schedule(self, name: str, body: Callable[[alg.Ctx], Program], result: Any,
                  keep: list[UserBuffer], async_op: bool, count: int, *, kind: Kind,
                  dt: np.dtype, op: str | None = None, root: int | None = None,
                  algo: tuple = (), tag: Any = None,
                  counts: tuple[list[int], list[int]] | None = None) -> Any:
        """Run a host schedule (no sequencer program) as the next collective; ``kind``
        to ``tag`` make its signature as :meth:`_program`'s, ``counts`` (sendcounts,
        recvcounts) add all-to-all-v's."""
        tagv = _tag(tag)
        coll, call = self._next_coll()
        dtype, rop = _dtype_of(dt), _op_of(op) if op else None
        sig = self._signature(call, kind, count, dtype, rop, root, algo, tagv)
        shown = count if counts is None else sum(counts[0])
        fields = (call, name, shown, dtype, rop, root, algo, tagv)
        job, entry = self._start(fields, lambda: self.impl.schedule(
            name, body, coll, self.deadline_s, sig, counts, blocking=not async_op))
        return self._handle(job, result, keep, async_op, fields, entry)

    def _signature(self, call: int, kind: Kind, count: int, dtype: DType,
                   op: ReduceOp | None, root: int | None, algo: tuple,
                   tagv: int) -> Signature | None:
        """The call's signature; None with ``check_calls`` off."""
        if not self.check_calls:
            return None
        return Signature(call, kind, count, dtype, op, root,
                         program_digest(*algo) if algo else 0, tagv, self.rank)

    def _need_schedules(self, argument: str, what: str) -> None:
        if not self.impl.host_schedules:
            raise UnsupportedError(argument, f"{what} has no sequencer program, and the "
                                   f"{self.backend} backend runs sequencer programs only")

    def _segment_elements(self, nchunks: int, dt: np.dtype) -> int:
        """Elements of ``dt`` one program run holds with ``nchunks`` chunks: the region,
        less the rounding up of the chunks' size (``nchunks * ceil(n / nchunks)`` must fit)."""
        return self.impl.stage_bytes // dt.itemsize - (nchunks - 1)

    def _segments(self, program: Sequence[Instr], *, m: int, blocks: int,
                  dt: np.dtype) -> tuple[int, int, int, int]:
        """Elements per segment, segment count, the first coll_id of a program run
        over ``blocks`` blocks of ``m`` elements, and the call's sequence number (taken
        under the same lock: another thread's call may take the next one at once).
        Every backend cuts and numbers segments here, so engines of different backends
        agree on the wire."""
        nch = setup_chunks(program)
        seg = self._segment_elements(nch, dt) // blocks
        if seg < 1:
            raise InvalidArgumentError("stage_bytes", f"{self.impl.stage_bytes} bytes cannot hold "
                                       f"{nch} chunks of {dt}")
        nseg = -(-m // seg)
        with self._lock:
            c0 = self._coll
            self._coll = (self._coll + nseg) & 0xFFFF
            self._calls += 1
            call = self._calls
        return seg, nseg, c0, call

    def _program(self, name: str, program: Sequence[Instr], *, m: int, blocks: int,
                 dt: np.dtype, op: str | None, get_in: Any, put_out: Any, result: Any,
                 keep: list[UserBuffer], async_op: bool, out: np.ndarray | None = None,
                 check_lengths: bool = True, kind: Kind, root: int | None = None,
                 algo: tuple = (), tag: Any = None) -> Any:
        """Run ``program`` over ``blocks`` blocks of ``m`` elements, in as many segments
        (program runs, one coll_id each) as the collective region needs.

        ``get_in(lo, hi)`` gives IN for elements ``[lo, hi)`` of every block;
        ``put_out(out, lo, hi)`` stores the region's OUT after that segment. With
        ``out`` (one block only: the caller's result array), OUT is ``out[lo:hi]``
        itself, bound over the region's OUT, and nothing is copied out. ``kind``,
        ``root``, ``algo`` (the program's rank-independent name and parameters; empty: a
        user program, not compared) and ``tag`` make the call's signature.
        """
        tagv = _tag(tag)
        seg, nseg, c0, call = self._segments(program, m=m, blocks=blocks, dt=dt)
        segments = [Segment((c0 + 1 + k) & 0xFFFF, k * seg, min(m, (k + 1) * seg),
                            blocks * (min(m, (k + 1) * seg) - k * seg)) for k in range(nseg)]
        dtype, rop = _dtype_of(dt), _op_of(op) if op else None
        sig = self._signature(call, kind, m, dtype, rop, root, algo, tagv)
        run = ProgramRun(name, program, dtype, dt, rop or ReduceOp.SUM, segments, get_in,
                         put_out, out, check_lengths, sig, blocking=not async_op)
        fields = (call, name, m, dtype, rop, root, algo, tagv)
        job, entry = self._start(fields, lambda: self.impl.run(run, self.deadline_s))
        return self._handle(job, result, keep, async_op, fields, entry)

    def _gather_in(self, full: np.ndarray, m: int, blocks: int, whole: bool) -> Any:
        """get_in for block-structured IN: the user's buffer itself when one segment
        covers it (``whole``), else block slices gathered into the region's IN."""
        region = self.impl.staging

        def get_in(lo: int, hi: int) -> np.ndarray:
            if whole and lo == 0 and hi == m:
                return full
            s = hi - lo
            staged = region.view(Buf.IN, full.dtype, blocks * s)
            for j in range(blocks):
                staged[j * s:(j + 1) * s] = full[j * m + lo:j * m + hi]
            return staged

        return get_in

    @staticmethod
    def _scatter_out(dest: np.ndarray, m: int, blocks: int) -> Any:
        def put_out(out: np.ndarray, lo: int, hi: int) -> None:
            if lo == 0 and hi == m:
                dest[:blocks * m] = out
                return
            s = hi - lo
            for j in range(blocks):
                dest[j * m + lo:j * m + hi] = out[j * s:(j + 1) * s]

        return put_out

    def _next_coll(self) -> tuple[int, int]:
        """The coll_id and sequence number of a call that runs one program or schedule,
        not segments."""
        with self._lock:
            self._coll = (self._coll + 1) & 0xFFFF
            self._calls += 1
            return self._coll, self._calls

    def _check_open(self) -> None:
        if self._aborted:
            raise AbortedError("call", self.rank)
        if self._closed:
            raise InvalidArgumentError("comm", "communicator is closed")

    def _pair(self, sendbuf: Any, recvbuf: Any) -> tuple[UserBuffer, UserBuffer, bool]:
        """(send, recv, in_place); recvbuf None or the same memory means in place."""
        self._check_open()
        s = as_buffer(sendbuf, "sendbuf", writable=recvbuf is None)
        if recvbuf is None or recvbuf is sendbuf:
            return s, s, True
        r = as_buffer(recvbuf, "recvbuf", writable=True)
        _same_dtype(s, r)
        same = s.array.ctypes.data == r.array.ctypes.data and s.array.nbytes == r.array.nbytes
        return s, r, same

    def _root(self, root: int) -> int:
        if not isinstance(root, int | np.integer) or not 0 <= root < self.world_size:
            raise InvalidArgumentError("root", f"{root!r} is outside 0..{self.world_size - 1}")
        return int(root)

    def _algo(self, coll: str, algo: str | None, default: str) -> str:
        if algo is None:
            return default
        if algo not in ALGOS[coll]:
            raise UnsupportedError("algo", f"{coll} has no algorithm {algo!r}; "
                                   f"choose from {ALGOS[coll]}")
        return algo

    @staticmethod
    def _out(ub: UserBuffer, original: Any) -> Any:
        return original if not isinstance(original, np.ndarray) else ub.array.reshape(
            original.shape)

    def _finisher(self, op: str, dt: np.dtype) -> tuple[str, Callable | None, tuple]:
        """(the engine's op, the scaling that follows it or None, what the op adds to
        the signature's algorithm): avg runs as sum and is scaled once per result
        element (:data:`fpgaccl.proto.reduce.AVG`)."""
        if op != AVG:
            return op, None, ()
        dtype, n = _dtype_of(dt), self.world_size

        def scale(summed: np.ndarray, out: np.ndarray) -> None:
            average_into(dtype, summed, n, out)

        return "sum", scale, (AVG,)

    # ------------------------------------------------------------------ collectives
    def allreduce(self, sendbuf: Any, recvbuf: Any = None, op: str = "sum", *,
                  algo: str | None = None, async_op: bool = False, tag: Any = None) -> Any:
        """Reduce across ranks; every rank receives identical bytes. ``op``: sum, prod,
        min, max, band/bor/bxor (integers), or avg (a sum, then each element scaled once
        as :func:`fpgaccl.proto.reduce.average_reference` defines: floats times 1/n
        rounded to the dtype, integers divided toward zero); reduce and reduce_scatter
        take the same."""
        s, r, inplace = self._pair(sendbuf, recvbuf)
        if r.array.size != s.array.size:
            raise CountMismatchError("recvbuf", f"{r.array.size} elements, sendbuf has "
                                     f"{s.array.size}")
        ufunc = resolve_op(op, s.array.dtype)
        op, scale, avg = self._finisher(op, s.array.dtype)
        nbytes = s.array.nbytes
        algo = self._algo("allreduce", algo, _allreduce_default(nbytes, self.world_size))
        result = self._out(r, sendbuf if inplace else recvbuf)
        work = r.array
        sa = s.array
        if algo == "tree":  # no sequencer program: a host schedule
            self._need_schedules("algo", "allreduce algo='tree'")

            def body(ctx: alg.Ctx) -> Program:
                # Reduced apart: the user's buffers change only once every rank agreed.
                acc = sa.copy()
                yield from alg.allreduce_tree(ctx, acc, ufunc)
                if scale is not None:
                    scale(acc, work)
                else:
                    work[:] = acc

            return self._schedule("allreduce", body, result, [s, r], async_op, sa.size,
                                  kind=Kind.ALLREDUCE, dt=sa.dtype, op=op,
                                  algo=("allreduce", algo, *avg), tag=tag)
        gen = _ALLREDUCE_PROGRAMS[algo]
        prog = _library(gen, self.rank, self.world_size)

        def put_out(out: np.ndarray, lo: int, hi: int) -> None:
            if scale is None:
                work[lo:hi] = out
            else:
                scale(out, work[lo:hi])

        # A bound result skips put_out: avg's scaling needs it.
        bind = nbytes > BIND_MIN_BYTES and scale is None
        return self._program("allreduce", prog, m=sa.size, blocks=1, dt=sa.dtype, op=op,
                             get_in=lambda lo, hi: sa[lo:hi], put_out=put_out, result=result,
                             keep=[s, r], async_op=async_op, out=work if bind else None,
                             kind=Kind.ALLREDUCE, algo=("allreduce", algo, *avg), tag=tag)

    def reduce(self, sendbuf: Any, recvbuf: Any = None, op: str = "sum", root: int = 0, *,
               algo: str | None = None, async_op: bool = False, tag: Any = None) -> Any:
        """Reduce to ``root``; ``recvbuf`` matters on the root only."""
        root = self._root(root)
        self._check_open()
        is_root = self.rank == root
        r: UserBuffer | None = None
        inplace = False
        if is_root:
            s, r, inplace = self._pair(sendbuf, recvbuf)
        else:
            s = as_buffer(sendbuf, "sendbuf")
        if r is not None and r.array.size != s.array.size:
            raise CountMismatchError("recvbuf", f"{r.array.size} elements, sendbuf has "
                                     f"{s.array.size}")
        ufunc = resolve_op(op, s.array.dtype)
        op, scale, avg = self._finisher(op, s.array.dtype)
        algo = self._algo("reduce", algo, "chain")
        sa = s.array
        result = self._out(r, sendbuf if inplace else recvbuf) if is_root else None
        if algo == "chain":
            prog = _library(lib.chain_reduce, self.rank, self.world_size, root,
                            chain_segments(sa.nbytes))
            dest = r.array if is_root else None

            def put_out(out: np.ndarray, lo: int, hi: int) -> None:
                if dest is None:
                    return
                if scale is None:
                    dest[lo:hi] = out
                else:
                    scale(out, dest[lo:hi])

            return self._program("reduce", prog, m=sa.size, blocks=1, dt=sa.dtype, op=op,
                                 get_in=lambda lo, hi: sa[lo:hi], put_out=put_out,
                                 result=result, keep=[s] + ([r] if r else []),
                                 async_op=async_op, kind=Kind.REDUCE, root=root,
                                 algo=("reduce", algo, chain_segments(sa.nbytes), *avg),
                                 tag=tag)
        self._need_schedules("algo", "reduce algo='tree'")

        def body(ctx: alg.Ctx) -> Program:
            work = sa.copy()  # the tree reduces into it; the user's buffers stay intact
            yield from alg.reduce_tree(ctx, work, ufunc, root, 0)
            if is_root:
                if scale is not None:
                    scale(work, r.array)
                else:
                    r.array[:] = work

        return self._schedule("reduce", body, result, [s] + ([r] if r else []), async_op,
                              sa.size, kind=Kind.REDUCE, dt=sa.dtype, op=op, root=root,
                              algo=("reduce", algo, *avg), tag=tag)

    def broadcast(self, buf: Any, root: int = 0, *, algo: str | None = None,
                  async_op: bool = False, tag: Any = None) -> Any:
        root = self._root(root)
        self._check_open()
        b = as_buffer(buf, "buf", writable=self.rank != root)
        algo = self._algo("broadcast", algo, "chain")
        work = b.array
        if algo == "chain":
            prog = _library(lib.chain_broadcast, self.rank, self.world_size, root,
                            chain_segments(work.nbytes))
            is_root = self.rank == root

            def put_out(out: np.ndarray, lo: int, hi: int) -> None:
                if not is_root:
                    work[lo:hi] = out

            return self._program("broadcast", prog, m=work.size, blocks=1, dt=work.dtype,
                                 op=None, get_in=lambda lo, hi: work[lo:hi], put_out=put_out,
                                 result=self._out(b, buf), keep=[b], async_op=async_op,
                                 kind=Kind.BROADCAST, root=root,
                                 algo=("broadcast", algo, chain_segments(work.nbytes)),
                                 tag=tag)
        self._need_schedules("algo", "broadcast algo='tree'")

        def body(ctx: alg.Ctx) -> Program:
            yield from alg.bcast_tree(ctx, work, root, 0)

        return self._schedule("broadcast", body, self._out(b, buf), [b], async_op, work.size,
                              kind=Kind.BROADCAST, dt=work.dtype, root=root,
                              algo=("broadcast", algo), tag=tag)

    def reduce_scatter(self, sendbuf: Any, recvbuf: Any = None, op: str = "sum", *,
                       algo: str | None = None, async_op: bool = False,
                       tag: Any = None) -> Any:
        """``sendbuf`` holds world_size*n elements; rank r gets chunk r reduced.

        In place (``recvbuf`` None) the result lands in chunk r of ``sendbuf``.
        """
        self._check_open()
        p = self.world_size
        s = as_buffer(sendbuf, "sendbuf", writable=recvbuf is None)
        if s.array.size % p:
            raise CountMismatchError("sendbuf", f"{s.array.size} elements is not a multiple "
                                     f"of world_size {p}")
        n = s.array.size // p
        if recvbuf is None:
            r = s
            out = s.array[self.rank * n:(self.rank + 1) * n]
        else:
            r = as_buffer(recvbuf, "recvbuf", writable=True)
            _same_dtype(s, r)
            if r.array.size != n:
                raise CountMismatchError("recvbuf", f"{r.array.size} elements, expected "
                                         f"sendbuf size / world_size = {n}")
            out = r.array
        resolve_op(op, s.array.dtype)
        op, scale, avg = self._finisher(op, s.array.dtype)
        self._algo("reduce_scatter", algo, "ring")
        sa = s.array
        me = self.rank

        def put_out(res: np.ndarray, lo: int, hi: int) -> None:
            k = hi - lo
            if scale is None:
                out[lo:hi] = res[me * k:(me + 1) * k]
            else:
                scale(res[me * k:(me + 1) * k], out[lo:hi])

        result = self._out(r, recvbuf) if recvbuf is not None else out
        return self._program("reduce_scatter", _library(lib.ring_reduce_scatter, me, p), m=n,
                             blocks=p, dt=sa.dtype, op=op, get_in=self._gather_in(sa, n, p, True),
                             put_out=put_out, result=result, keep=[s, r], async_op=async_op,
                             kind=Kind.REDUCE_SCATTER, algo=("reduce_scatter", "ring", *avg),
                             tag=tag)

    def allgather(self, sendbuf: Any, recvbuf: Any = None, *, algo: str | None = None,
                  async_op: bool = False, tag: Any = None) -> Any:
        """Concatenate every rank's ``sendbuf``. In place: ``sendbuf`` is the full
        world_size*n buffer with this rank's part already at chunk r."""
        self._check_open()
        p = self.world_size
        if recvbuf is None:
            r = as_buffer(sendbuf, "sendbuf", writable=True)
            if r.array.size % p:
                raise CountMismatchError("sendbuf", f"in-place allgather needs a multiple of "
                                         f"world_size {p} elements, got {r.array.size}")
            n = r.array.size // p
            s = r
            mine = None
        else:
            s = as_buffer(sendbuf, "sendbuf")
            r = as_buffer(recvbuf, "recvbuf", writable=True)
            _same_dtype(s, r)
            n = s.array.size
            if r.array.size != n * p:
                raise CountMismatchError("recvbuf", f"{r.array.size} elements, expected "
                                         f"{n} x {p}")
            mine = s.array
        self._algo("allgather", algo, "ring")
        out = r.array
        me = self.rank
        region = self.impl.staging

        if mine is None:
            get_in = self._gather_in(out, n, p, True)
        else:
            def get_in(lo: int, hi: int) -> np.ndarray:
                k = hi - lo  # only block `me` of IN is read
                staged = region.view(Buf.IN, out.dtype, p * k)
                staged[me * k:(me + 1) * k] = mine[lo:hi]
                return staged

        return self._program("allgather", _library(lib.ring_allgather, me, p), m=n, blocks=p,
                             dt=out.dtype, op=None, get_in=get_in,
                             put_out=self._scatter_out(out, n, p),
                             result=self._out(r, recvbuf if recvbuf is not None else sendbuf),
                             keep=[s, r], async_op=async_op, kind=Kind.ALLGATHER,
                             algo=("allgather", "ring"), tag=tag)

    def alltoall(self, sendbuf: Any, recvbuf: Any = None, *, algo: str | None = None,
                 async_op: bool = False, tag: Any = None) -> Any:
        """Block j of ``sendbuf`` goes to rank j; block i of the result came from rank i."""
        self._check_open()
        p = self.world_size
        s = as_buffer(sendbuf, "sendbuf", writable=recvbuf is None)
        if s.array.size % p:
            raise CountMismatchError("sendbuf", f"{s.array.size} elements is not a multiple "
                                     f"of world_size {p}")
        n = s.array.size // p
        if recvbuf is None:
            r = s
        else:
            r = as_buffer(recvbuf, "recvbuf", writable=True)
            _same_dtype(s, r)
            if r.array.size < s.array.size:
                raise CountMismatchError("recvbuf", f"{r.array.size} elements cannot hold the "
                                         "blocks")
        self._algo("alltoall", algo, "direct")
        sa = s.array
        return self._program("alltoall", _library(lib.alltoall, self.rank, p), m=n, blocks=p,
                             dt=sa.dtype, op=None, get_in=self._gather_in(sa, n, p, True),
                             put_out=self._scatter_out(r.array, n, p),
                             result=self._out(r, recvbuf if recvbuf is not None else sendbuf),
                             keep=[s, r], async_op=async_op, kind=Kind.ALLTOALL,
                             algo=("alltoall", "direct"), tag=tag)

    def gather(self, sendbuf: Any, recvbuf: Any = None, root: int = 0, *,
               async_op: bool = False, tag: Any = None) -> Any:
        """Every rank's ``sendbuf`` (n elements) to ``root``, whose ``recvbuf`` (n x
        world_size elements, rank i's at block i) it returns; other ranks return None
        and need no ``recvbuf``."""
        root = self._root(root)
        self._check_open()
        p, me = self.world_size, self.rank
        s = as_buffer(sendbuf, "sendbuf")
        n = s.array.size
        r: UserBuffer | None = None
        if me == root:
            if recvbuf is None:
                raise InvalidArgumentError("recvbuf", "the root of a gather needs a receive "
                                           f"buffer of {n} x {p} elements")
            r = as_buffer(recvbuf, "recvbuf", writable=True)
            _same_dtype(s, r)
            if r.array.size != n * p:
                raise CountMismatchError("recvbuf", f"{r.array.size} elements, expected "
                                         f"{n} x {p}")
        mine = s.array
        region = self.impl.staging

        def get_in(lo: int, hi: int) -> np.ndarray:
            k = hi - lo  # only block `me` of IN is read
            staged = region.view(Buf.IN, mine.dtype, p * k)
            staged[me * k:(me + 1) * k] = mine[lo:hi]
            return staged

        put_out = self._scatter_out(r.array, n, p) if r is not None else _discard
        return self._program("gather", _library(lib.gather, me, p, root), m=n, blocks=p,
                             dt=mine.dtype, op=None, get_in=get_in, put_out=put_out,
                             result=self._out(r, recvbuf) if r is not None else None,
                             keep=[s] + ([r] if r is not None else []), async_op=async_op,
                             kind=Kind.GATHER, root=root, algo=("gather", "direct"), tag=tag)

    def scatter(self, sendbuf: Any, recvbuf: Any, root: int = 0, *, async_op: bool = False,
                tag: Any = None) -> Any:
        """Block i of the root's ``sendbuf`` (n x world_size elements) to rank i's
        ``recvbuf`` (n elements), which every rank returns; ``sendbuf`` matters on the
        root only (None elsewhere)."""
        root = self._root(root)
        self._check_open()
        p, me = self.world_size, self.rank
        r = as_buffer(recvbuf, "recvbuf", writable=True)
        n = r.array.size
        s: UserBuffer | None = None
        if me == root:
            s = as_buffer(sendbuf, "sendbuf")
            _same_dtype(s, r)
            if s.array.size != n * p:
                raise CountMismatchError("sendbuf", f"{s.array.size} elements, expected "
                                         f"recvbuf's {n} x {p}")
            get_in = self._gather_in(s.array, n, p, True)
        else:
            region, dt = self.impl.staging, r.array.dtype

            def get_in(lo: int, hi: int) -> np.ndarray:
                return region.view(Buf.IN, dt, p * (hi - lo))  # not read off the root

        out = r.array

        def put_out(res: np.ndarray, lo: int, hi: int) -> None:
            k = hi - lo
            out[lo:hi] = res[me * k:(me + 1) * k]

        return self._program("scatter", _library(lib.scatter, me, p, root), m=n, blocks=p,
                             dt=out.dtype, op=None, get_in=get_in, put_out=put_out,
                             result=self._out(r, recvbuf), keep=[r] + ([s] if s else []),
                             async_op=async_op, kind=Kind.SCATTER, root=root,
                             algo=("scatter", "direct"), tag=tag)

    def alltoallv(self, sendbuf: Any, sendcounts: Sequence[int], recvbuf: Any,
                  recvcounts: Sequence[int], sdispls: Sequence[int] | None = None,
                  rdispls: Sequence[int] | None = None, *, algo: str | None = None,
                  async_op: bool = False, tag: Any = None) -> Any:
        """Per-peer counts (elements), e.g. MoE token dispatch and combine.

        ``algo``: ``"direct"`` (the default where the backend runs host schedules: each
        block goes as its own message, no padding) or ``"padded"`` (the default on the
        sim and board backends, and what a world mixing backends must ask for on every
        rank): a one-element allreduce (max) agrees on the largest block, then the
        library's alltoall program moves every block padded to it.

        Rank i's ``sendcounts[j]`` must equal rank j's ``recvcounts[i]``: with
        ``check_calls``, every rank sees every rank's counts before any block lands, so a
        pair that disagrees fails every rank with a CollectiveCountMismatchError (field
        ``counts``)."""
        self._check_open()
        s = as_buffer(sendbuf, "sendbuf")
        sc = self._counts(sendcounts, "sendcounts")
        rc = self._counts(recvcounts, "recvcounts")
        sd = self._displs(sdispls, sc, "sdispls")
        rd = self._displs(rdispls, rc, "rdispls")
        me = self.rank
        if sc[me] != rc[me]:
            raise CountMismatchError("recvcounts", f"recvcounts[{me}] is {rc[me]} but this "
                                     f"rank sends itself sendcounts[{me}] = {sc[me]}")
        if max(d + c for d, c in zip(sd, sc, strict=True)) > s.array.size:
            raise CountMismatchError("sendcounts", f"exceed sendbuf's {s.array.size} elements")
        if recvbuf is None:
            raise InvalidArgumentError("recvbuf", "alltoallv needs a separate receive buffer")
        default = "direct" if self.impl.host_schedules else "padded"
        if self._algo("alltoallv", algo, default) == "padded":
            return self._alltoallv_padded(s, recvbuf, sc, sd, rc, rd, async_op, tag)
        self._need_schedules("algo", "alltoallv algo='direct'")
        return self._alltoallv("alltoallv", s, recvbuf, sc, sd, rc, rd, algo, async_op, recvbuf,
                               tag)

    def _alltoallv_padded(self, s: UserBuffer, recvbuf: Any, sc: list[int], sd: list[int],
                          rc: list[int], rd: list[int], async_op: bool, tag: Any) -> Any:
        r = as_buffer(recvbuf, "recvbuf", writable=True)
        _same_dtype(s, r)
        if max(d + c for d, c in zip(rd, rc, strict=True)) > r.array.size:
            raise CountMismatchError("recvcounts", f"{r.array.size} elements cannot hold "
                                     "the blocks")
        p, sa, ra = self.world_size, s.array, r.array
        # Every rank's counts (an allgather: the calls below are checked like any), so
        # that every rank pads to the same block and sees a pair that disagrees.
        rows = np.empty((p, 2 * p), np.int64)
        self.allgather(np.array([*sc, *rc], np.int64), rows.reshape(-1), tag=tag)
        if self.check_calls:
            differs = counts_difference({i: (row[:p].tolist(), row[p:].tolist())
                                         for i, row in enumerate(rows)})
            if differs is not None:
                raise CollectiveMismatchError.of("counts", *differs)
        blk = int(rows.max())
        if blk:
            send = np.zeros(p * blk, sa.dtype)
            for j in range(p):
                send[j * blk:j * blk + sc[j]] = sa[sd[j]:sd[j] + sc[j]]
            got = self.alltoall(send, np.empty_like(send), tag=tag)
            for i in range(p):
                ra[rd[i]:rd[i] + rc[i]] = got[i * blk:i * blk + rc[i]]
        # Done before it returns (the programs above waited): async_op gets a finished handle.
        return self._handle(Finished("alltoallv", self.deadline_s), self._out(r, recvbuf), [r],
                            async_op, (self._calls, "alltoallv", sum(rc)))

    def _counts(self, counts: Sequence[int], name: str) -> list[int]:
        try:
            out = [operator.index(c) for c in counts]  # 1.5 is not a count
        except TypeError:
            raise InvalidArgumentError(name, "must be a sequence of ints") from None
        if len(out) != self.world_size:
            raise CountMismatchError(name, f"{len(out)} entries, world_size is {self.world_size}")
        if any(c < 0 for c in out):
            raise InvalidArgumentError(name, "counts must be >= 0")
        return out

    def _displs(self, displs: Sequence[int] | None, counts: list[int], name: str) -> list[int]:
        if displs is None:
            return [int(x) for x in np.concatenate([[0], np.cumsum(counts)[:-1]])]
        out = self._counts(displs, name)
        return out

    def _alltoallv(self, name: str, s: UserBuffer, recvbuf: Any, sc: list[int], sd: list[int],
                   rc: list[int], rd: list[int], algo: str | None, async_op: bool,
                   result_of: Any, tag: Any) -> Any:
        if recvbuf is None:
            r, inplace = s, True
        else:
            r = as_buffer(recvbuf, "recvbuf", writable=True)
            inplace = np.shares_memory(r.array, s.array)
            _same_dtype(s, r)
        if max(d + c for d, c in zip(rd, rc, strict=True)) > r.array.size:
            raise CountMismatchError("recvbuf" if name == "alltoall" else "recvcounts",
                                     f"{r.array.size} elements cannot hold the blocks")
        self._algo(name, algo, "direct")
        sa, ra = s.array, r.array

        def body(ctx: alg.Ctx) -> Program:
            src = sa.copy() if inplace else sa  # in place, blocks would be overwritten unsent
            yield from alg.alltoallv_direct(ctx, src, sd, sc, ra, rd, rc)

        # The signature's count is 0: the counts are compared whole, with every rank's.
        return self._schedule(name, body, self._out(r, result_of), [s, r], async_op, 0,
                              kind=Kind.ALLTOALLV, dt=s.array.dtype,
                              algo=("alltoallv", "direct"), tag=tag, counts=(sc, rc))

    def run_program(self, program: Sequence[Instr], sendbuf: Any, op: str = "sum", *,
                    async_op: bool = False, tag: Any = None) -> Any:
        """Run one rank's sequencer ``program`` (e.g. from :data:`fpgaccl.proto.programs.
        LIBRARY`, or a new one) over ``sendbuf`` as IN; returns a copy of OUT.

        Every rank must call it with its own program for the same element count. The
        whole vector must fit the collective region (no segmenting: the program's
        buffer structure is its own).
        """
        self._check_open()
        s = as_buffer(sendbuf, "sendbuf")
        sa = s.array
        if op is not None:
            resolve_op(op, sa.dtype)
        try:
            program = checked_program(program, self.rank, self.world_size)
        except (TypeError, ValueError) as e:
            raise InvalidArgumentError("program", str(e)) from None
        nch = setup_chunks(program)
        most = self._segment_elements(nch, sa.dtype)
        if sa.size > most:
            raise CountMismatchError("sendbuf", f"{sa.size} elements do not fit the "
                                     f"{self.impl.stage_bytes}-byte collective region in one "
                                     f"piece: at most {max(most, 0)} of {sa.dtype} with "
                                     f"{nch} chunks")
        out = np.empty_like(sa)

        def put_out(res: np.ndarray, lo: int, hi: int) -> None:
            out[lo:hi] = res

        # A RECV's span is the program's own business here (the HDL reads only its tag):
        # message lengths are checked for the library's collectives alone.
        return self._program("program", program, m=sa.size, blocks=1, dt=sa.dtype, op=op,
                             get_in=lambda lo, hi: sa[lo:hi], put_out=put_out, result=out,
                             keep=[s], async_op=async_op, check_lengths=False,
                             kind=Kind.PROGRAM, tag=tag)

    def barrier(self, *, async_op: bool = False) -> Any:
        """Returns once every rank has entered: the library's dissemination program
        (:func:`fpgaccl.proto.programs.barrier`) on every backend, so worlds that mix
        backends share it too."""
        self._check_open()
        n = lib.barrier_elements(self.world_size)
        token = np.zeros(n, np.uint64)   # values do not matter; whole 64-bit words
        return self._program("barrier", _library(lib.barrier, self.rank, self.world_size),
                             m=n, blocks=1, dt=token.dtype, op=None,
                             get_in=lambda lo, hi: token[lo:hi], put_out=_discard, result=None,
                             keep=[], async_op=async_op, kind=Kind.BARRIER,
                             algo=("barrier", "dissemination"))

    # ------------------------------------------------------------------ sub-communicators
    def split(self, color: int | None, key: int = 0) -> Communicator | None:
        """MPI_Comm_split: a new communicator of the ranks that pass the same ``color``,
        ranked by ``(key, rank here)``; a rank that passes None or a negative color is in
        none and gets None. Every rank of this communicator must call it (a collective).

        Each sub-communicator has an engine of its own (software backend: its own UDP
        port on this rank's address, queue pairs, memory keys, PSNs and call sequence),
        so its traffic never meets this one's or a sibling's, and calls on different
        communicators may be issued in any order. On the sim backend it is a connection
        of its own to the same simulated node, with its own call sequence: the server
        starts each of its collectives once every member has made it and their nodes
        are free (a node runs one program at a time, over its queue pairs to the nodes
        of the world). The ranks agree on the split with an allgather of (color, key)
        here, and exchange the new engines' connection records with two more allgathers
        here instead of a TCP rendezvous. The board backend, and the simulated ranks of
        a world that mixes backends, cannot open one: every rank then raises
        UnsupportedError.
        """
        self._check_open()
        p = self.world_size
        c = self._int(color, "color", none_ok=True)
        k = self._int(key, "key")
        c = -1 if c is None or c < 0 else c
        can = hasattr(self.impl, "split_backend")
        table = np.empty(3 * p, np.int64)
        self.allgather(np.array([c, k, int(can)], np.int64), table)
        t = table.reshape(p, 3)
        cannot = [r for r in range(p) if not t[r, 2]]
        if cannot:
            raise UnsupportedError("color", f"split: rank(s) {cannot} run a backend without "
                                   f"sub-communicators (this rank: {self.backend}); a board, "
                                   "or a simulated node in a world that mixes backends, has "
                                   "one queue pair per peer of its world")
        n = next(self._splits)
        if c < 0:
            self._allgather_bytes(b"")  # the members' rendezvous, which every rank joins
            return None
        members = [r for _, r in sorted((int(t[r, 1]), r) for r in range(p) if t[r, 0] == c)]
        called = False

        def rendezvous(info: dict) -> list[dict]:
            nonlocal called
            called = True
            blobs = self._allgather_bytes(json.dumps(info).encode())
            records = [json.loads(blobs[r]) for r in members]
            failed = [(r, rec["error"]) for r, rec in zip(members, records, strict=True)
                      if "error" in rec]
            if failed:
                raise InvalidArgumentError("color", f"split: rank(s) could not open their "
                                           f"engines: {failed}")
            return records

        try:
            return self.open_sub(members.index(self.rank), len(members), rendezvous,
                                 f"{self.label}.split{n}")
        except BaseException as e:
            if not called:  # the others wait for this rank's record: tell them why not
                self._allgather_bytes(json.dumps(
                    {"error": f"rank {self.rank}: {type(e).__name__}: {e}"}).encode())
            raise

    def open_sub(self, rank: int, world_size: int,
                 rendezvous: Callable[[dict], list[dict]], label: str | None = None
                 ) -> Communicator:
        """A sub-communicator of which this process is ``rank`` of ``world_size``, on an
        engine of its own that this communicator's backend opens; ``rendezvous(record)``
        returns every member's record in the new ranks' order. :meth:`split` agrees on
        members and exchanges records through this communicator; a framework whose groups
        are formed by their members alone (torch's ``new_group``) exchanges them its own
        way. UnsupportedError where the backend cannot open another engine."""
        self._check_open()
        check_world(rank, world_size, self.deadline_s)
        opener = getattr(self.impl, "split_backend", None)
        if opener is None:
            raise UnsupportedError("backend", f"the {self.backend} backend has no "
                                   "sub-communicators (an HDL node has one queue pair per "
                                   "peer of its world)")
        label = label or f"{self.label}.split{next(self._splits)}"
        impl = opener(rank, world_size, rendezvous)
        sub = Communicator.__new__(Communicator)
        sub._setup(rank, world_size, self.backend, self.deadline_s, self.check_calls, label)
        sub.impl = impl
        self._subs.add(sub)
        return sub

    def _allgather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank's ``data`` (of any length), by rank."""
        p = self.world_size
        sizes = np.empty(p, np.int64)
        self.allgather(np.array([len(data)], np.int64), sizes)
        width = max(1, int(sizes.max()))
        mine = np.zeros(width, np.uint8)
        mine[:len(data)] = np.frombuffer(data, np.uint8)
        table = np.empty(width * p, np.uint8)
        self.allgather(mine, table)
        return [table[r * width:r * width + int(sizes[r])].tobytes() for r in range(p)]

    @staticmethod
    def _int(value: Any, name: str, *, none_ok: bool = False) -> int | None:
        if value is None and none_ok:
            return None
        if isinstance(value, bool) or not isinstance(value, int | np.integer) or \
                not -(1 << 62) <= value < 1 << 62:
            raise InvalidArgumentError(name, f"{value!r} must be an int"
                                       + (" or None" if none_ok else ""))
        return int(value)

    # ------------------------------------------------------------------ failure
    def abort(self) -> None:
        """Fail every pending call of this communicator at once with
        :class:`~fpgaccl.errors.AbortedError`, from any thread, and free its engine's
        ports; later calls raise it too, and the same holds for every sub-communicator
        split from it (recursively). Peers are not told: their calls fail on their own
        deadline or peer timeout (or abort there too). A new communicator can be built
        in this process afterwards (a new rendezvous). UnsupportedError on a backend that
        cannot stop a call in flight."""
        abort = getattr(self.impl, "abort", None)
        if abort is None:
            raise UnsupportedError("backend", f"the {self.backend} backend cannot stop a call "
                                   "in flight")
        with self._lock:
            if self._aborted:
                return
            self._aborted = self._closed = True
        rank = self.rank
        abort(lambda name: AbortedError(name, rank))
        for sub in list(self._subs):
            sub.abort()

    def flight_record(self) -> list[dict[str, Any]]:
        """The last calls of this communicator, oldest first (:mod:`fpgaccl.host.flight`):
        ``seq``, ``name`` and the signature's fields, ``start`` and ``end`` (wall clock,
        seconds), ``state`` (``pending``, ``done`` or ``failed``) and ``error``."""
        return self.flight.entries()

    # ------------------------------------------------------------------ point to point
    def _peer(self, peer: int, name: str) -> int:
        if not isinstance(peer, int | np.integer) or not 0 <= peer < self.world_size \
                or peer == self.rank:
            raise InvalidArgumentError(name, f"{peer!r} is not another rank of "
                                       f"0..{self.world_size - 1}")
        return int(peer)

    def send(self, buf: Any, dst: int, *, async_op: bool = False) -> Any:
        """``buf`` to rank ``dst``'s matching :meth:`recv` (same element count and dtype).

        On the software backend a send is buffered by the receiver's ring and may
        complete first; on the sim and board backends it is the ``p2p_send`` program,
        which waits for the receiver's grant: it completes only once ``dst`` receives
        (order exchanges so that one side receives first)."""
        self._check_open()
        dst = self._peer(dst, "dst")
        b = as_buffer(buf, "buf")
        seq = self._p2p_next(self._p2p_send, dst)
        if not self.impl.host_schedules:
            self._need_p2p_programs("dst")
            return self._p2p_program("send", lib.p2p_send, dst, seq, b, None, async_op)
        fields = (seq, "send", b.array.size, None, None, None, (), 0, dst)
        job, entry = self._start(fields, lambda: self.impl.send(
            dst, seq, b.array, self.deadline_s, blocking=not async_op))
        return self._handle(job, None, [b], async_op, fields, entry)

    def recv(self, buf: Any, src: int, *, async_op: bool = False) -> Any:
        """Rank ``src``'s matching :meth:`send` into ``buf``."""
        self._check_open()
        src = self._peer(src, "src")
        b = as_buffer(buf, "buf", writable=True)
        seq = self._p2p_next(self._p2p_recv, src)
        if not self.impl.host_schedules:
            self._need_p2p_programs("src")
            return self._p2p_program("recv", lib.p2p_recv, src, seq, b, self._out(b, buf),
                                     async_op)
        fields = (seq, "recv", b.array.size, None, None, None, (), 0, src)
        job, entry = self._start(fields, lambda: self.impl.recv(
            src, seq, b.array, self.deadline_s, blocking=not async_op))
        return self._handle(job, self._out(b, buf), [b], async_op, fields, entry)

    def _need_p2p_programs(self, argument: str) -> None:
        if not getattr(self.impl, "p2p_programs", False):
            raise UnsupportedError(argument, f"the {self.backend} backend runs neither host "
                                   "schedules nor programs of two ranks (send/recv)")

    def _p2p_program(self, name: str, gen: Any, peer: int, seq: int, b: UserBuffer,
                     result: Any, async_op: bool) -> Any:
        """send/recv as a two-rank program, in segments the region holds. The ranks
        not involved run nothing, so the world's coll_id sequence is left alone: the
        segments are numbered from the pair's own sequence (the HDL matches a peer's
        messages by order, not by coll_id)."""
        arr = b.array
        m = arr.size
        seg = self._segment_elements(1, arr.dtype)
        sending = name == "send"
        segments = [Segment(((seq << 6) + k) & 0xFFFF, lo, min(m, lo + seg), min(m, lo + seg) - lo)
                    for k, lo in enumerate(range(0, m, seg))]

        def get_in(lo: int, hi: int) -> np.ndarray:
            return arr[lo:hi] if sending else self.impl.staging.view(Buf.IN, arr.dtype, hi - lo)

        def put_out(out: np.ndarray, lo: int, hi: int) -> None:
            if not sending:
                arr[lo:hi] = out

        lo_rank, hi_rank = sorted((self.rank, peer))
        run = ProgramRun(name, _library(gen, self.rank, self.world_size, peer),
                         _dtype_of(arr.dtype), arr.dtype, ReduceOp.SUM, segments, get_in,
                         put_out, peers=(lo_rank, hi_rank))
        return self._handle(self.impl.run(run, self.deadline_s), result, [b], async_op,
                            (seq, name, m, _dtype_of(arr.dtype), None, None, (), 0, peer))

    def _p2p_next(self, counters: list[int], peer: int) -> int:
        # One counter per direction and peer: sends to j pair with j's receives from us.
        with self._lock:
            counters[peer] = (counters[peer] + 1) & 0xFFFF
            return counters[peer]

    # ------------------------------------------------------------------ introspection
    def drop_counters(self) -> dict[str, int]:
        """Per-reason drop counters (the CSR ``drops`` block of the hardware)."""
        return self.impl.drop_counters()

    def stats(self) -> dict[str, int]:
        return self.impl.stats()

    def close(self, *, linger_s: float | None = None) -> None:
        """Leave the world: a last barrier where the backend needs one, then the backend
        closes (the software engine keeps answering retransmissions briefly)."""
        if self._closed:
            return  # also after abort(): the engine is stopped already
        if self.world_size > 1 and self.impl.barrier_at_close:
            with contextlib.suppress(Exception):
                self.barrier()
        self._closed = True
        self.impl.close(linger_s)

    def __enter__(self) -> Communicator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
