"""The boundary between the :class:`~fpgaccl.host.communicator.Communicator` and an
engine: the :class:`Backend` protocol and the few plain types that cross it.

The Communicator validates arguments, chooses the algorithm, cuts the vector into
segments and numbers them, and wraps what a backend returns in a handle. A backend
runs a sequencer program over those segments, runs a host schedule where it has one,
and answers barrier, stats, drop counters and close. Adding a backend is implementing
this protocol in one module and naming it in :mod:`fpgaccl.host.backends`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from fpgaccl.proto.isa import Buf, Instr
from fpgaccl.proto.reduce import DType, ReduceOp
from fpgaccl.proto.signature import Signature

Program = Generator[Any, None, None]
"""A host schedule: a generator that posts transfers and yields what it waits for."""


@dataclass(frozen=True)
class Segment:
    """One run of the program: elements ``[lo, hi)`` of every block, as ``coll_id``."""

    coll_id: int
    lo: int
    hi: int
    count: int        # elements of IN: blocks x (hi - lo)


@dataclass(frozen=True)
class ProgramRun:
    """A library (or user) program over a vector, already cut into segments.

    ``get_in(lo, hi)`` gives IN for a segment (the user's array itself where it can);
    ``put_out(out, lo, hi)`` stores the segment's OUT. ``bind``, where given, is the
    caller's result array: a backend that can bind it over its OUT writes the result
    there directly and skips ``put_out``; one that cannot calls ``put_out``.
    """

    name: str
    program: Sequence[Instr]
    dtype: DType
    np_dtype: np.dtype
    op: ReduceOp
    segments: Sequence[Segment]
    get_in: Callable[[int, int], np.ndarray]
    put_out: Callable[[np.ndarray, int, int], None]
    bind: np.ndarray | None = None
    check_lengths: bool = True
    """Whether every received message must match the span its RECV expects (the
    library's collectives); a user program's spans are its own business."""
    signature: Signature | None = None
    """What every rank must agree on (:mod:`fpgaccl.proto.signature`); a backend that
    can checks its peers' before a byte moves."""
    peers: tuple[int, ...] | None = None
    """The ranks that run this program (send/recv: the two ends); None: every rank."""
    blocking: bool = False
    """The caller waits for the result at once (not ``async_op``): a backend may run the
    call on the caller's thread."""


class Pending(Protocol):
    """What a backend returns for a call: done when ``event`` is set, failed if
    ``error`` is then not None. The engine's own job objects are this shape."""

    name: str
    deadline_s: float
    event: Any        # is_set() and wait(timeout) -> bool, as threading.Event
    error: BaseException | None


class Finished:
    """A call that completed before it returned (backends that run synchronously)."""

    def __init__(self, name: str, deadline_s: float) -> None:
        self.name = name
        self.deadline_s = deadline_s
        self.event = threading.Event()
        self.event.set()
        self.error: BaseException | None = None


class Staging(Protocol):
    """Host memory the Communicator gathers blocked IN into (``view(Buf.IN, ...)``)."""

    def view(self, buf: Buf, dtype: Any, count: int) -> np.ndarray: ...


class Backend(Protocol):
    """An engine that runs collective programs for one rank of a world."""

    name: str
    """``"software"``, ``"sim"``, ``"board"``... (``Communicator.backend``)."""
    rank: int
    world_size: int
    stage_bytes: int
    """Bytes of each of the engine's IN/OUT/TMP/TMP2: every rank of a world agreed on
    one, so all cut the same segments."""
    staging: Staging
    host_schedules: bool
    """Whether :meth:`schedule`, :meth:`send` and :meth:`recv` work (host schedules
    need per-peer receive rings, which only the software engine has)."""
    clock_mhz: float | None
    """The engine's clock where times are counted in its cycles (simulation), else None."""
    p2p_programs: bool
    """Whether :meth:`run` takes a program only some ranks run (``ProgramRun.peers``:
    send/recv without host schedules)."""
    barrier_at_close: bool
    """Whether leaving the world starts with a barrier: peers may still need this
    rank's answers (retransmissions) until every rank has finished."""

    def run(self, run: ProgramRun, deadline_s: float) -> Pending:
        """Run ``run.program`` over each of ``run.segments`` in order."""

    def schedule(self, name: str, body: Callable[[Any], Program], coll_id: int,
                 deadline_s: float, signature: Signature | None = None,
                 counts: tuple[Sequence[int], Sequence[int]] | None = None, *,
                 blocking: bool = False) -> Pending:
        """Run a host schedule: ``body`` gets a context posting transfers as ``coll_id``.
        With a ``signature`` (and all-to-all-v's ``counts``: sendcounts, recvcounts),
        peers' data lands only once their signatures agree
        (:mod:`fpgaccl.host.schedule_check`). ``blocking`` as :attr:`ProgramRun.blocking`."""

    def send(self, peer: int, seq: int, data: np.ndarray, deadline_s: float, *,
             blocking: bool = False) -> Pending: ...

    def recv(self, peer: int, seq: int, out: np.ndarray, deadline_s: float, *,
             blocking: bool = False) -> Pending: ...

    def barrier(self, coll_id: int, deadline_s: float) -> Pending: ...

    def stats(self) -> dict[str, int]: ...

    def drop_counters(self) -> dict[str, int]:
        """Per-reason drop counters (:class:`fpgaccl.proto.drops.DropReason` names)."""

    def close(self, linger_s: float | None = None) -> None: ...

    # Optional, where the engine can (the software backend; the Communicator raises
    # UnsupportedError without them):
    #   split_backend(rank, world_size, rendezvous) -> Backend: an engine of its own for
    #     a sub-communicator; rendezvous(record) returns every member's record.
    #   abort(error_of): stop the engine, free its ports and fail every pending call with
    #     error_of(call name).
