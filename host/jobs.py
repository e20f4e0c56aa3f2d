"""The engine's job queue: the programs the host submitted, resumed on the engine thread
when what they wait on is done, failed with their queue pairs or when they make no
progress for their deadline.

Ordered jobs (collectives) share the collective region and its numbering: they run one
at a time, in submission order, which every rank shares, like a hardware command queue.
An unordered one (a send or a recv) needs only its own messages, which per-peer sequence
numbers match: it neither waits behind another job nor holds one back, so an irecv
posted before its isend (or before an allreduce) completes, as MPI's
Irecv/Isend/Waitall does.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any

from fpgaccl.errors import CollectiveMismatchError, RanksTimeoutError, TransportError

from .qp import Completion

if TYPE_CHECKING:
    from .engine import Engine

Program = Generator[Any, None, None]
"""A collective schedule: yields Completions (or iterables of them) to wait on."""

SEQUENCE_POLL_S = 0.002
"""The sequencer runs when something it may wait on happened (``Engine.seq_due``: an
ACKed message, a grant or message landed, a receive delivered, a new job) and, failing
that, at least this often, for deadlines."""

PROBES_PER_PEER_TIMEOUT = 5
"""A waiting job asks its silent peers for a sign of life this many times per
``peer_timeout_s`` (:meth:`Engine.probe`)."""

PROGRESS_SAMPLES = 8
"""Times per deadline a waiting job looks for transport progress: a job fails after
between 1 and 1.25 deadlines without any."""


class Latch:
    """A one-shot event for one setter (the engine thread) and any waiters: a lock held
    until set. ``threading.Event`` builds a Condition and a fresh lock on every wait; a
    small collective pays for both twice, a bare lock costs one futex each side.

    ``driver(latch, timeout)``, where set, is called by a waiter first: it may do the
    work that sets the latch on the waiter's own thread (:meth:`Engine._drive`)."""

    __slots__ = ("_lock", "_set", "driver")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()
        self._set = False
        self.driver: Callable[[Latch, float | None], None] | None = None

    def set(self) -> None:
        if not self._set:
            self._set = True
            self._lock.release()

    def is_set(self) -> bool:
        return self._set

    def wait_set(self, timeout: float | None = None) -> bool:
        """:meth:`wait` without driving: for a thread that must not take the loop from
        the one that runs it (it would only hand it back and forth)."""
        if self._set:
            return True
        if self._lock.acquire(timeout=-1 if timeout is None else max(timeout, 0.0)):
            self._lock.release()  # the next waiter gets through too
            return True
        return self._set

    def wait(self, timeout: float | None = None) -> bool:
        if self._set:
            return True
        if self.driver is not None:
            end = None if timeout is None else time.monotonic() + timeout
            self.driver(self, timeout)
            if self._set:
                return True
            if end is not None:
                timeout = end - time.monotonic()
        return self.wait_set(timeout)


class Job:
    """One submitted program; the host waits on it."""

    def __init__(self, name: str, program: Program, deadline_s: float, *,
                 ordered: bool = True) -> None:
        self.name = name
        self.ordered = ordered
        self.program = program
        self.deadline_s = deadline_s
        self.event = Latch()
        self.error: BaseException | None = None
        self.started = 0.0
        self.waiting: list[Completion] = []
        self.progress_at = 0.0  # when the job resumed or the transport last moved
        self.mark: tuple | None = None  # the transport's position then
        self.probe_at = 0.0
        self.created = time.monotonic()  # the flight recorder's start of the call
        self.ended = 0.0  # monotonic: the flight recorder's end of the call

    def finish(self, error: BaseException | None = None) -> None:
        self.error = error
        self.ended = time.monotonic()
        self.event.set()


class Jobs:
    """``submitted`` (by the host thread, taken by the engine thread) and ``running``:
    the jobs the engine thread resumes in :meth:`sequence`."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.submitted: deque[Job] = deque()
        self.running: deque[Job] = deque()

    def sequence(self, now: float) -> bool:
        """Resume every job whose waits are over (or failed, or without progress for its
        deadline); whether any was resumed."""
        engine = self.engine
        jobs = self.running
        while self.submitted:
            jobs.append(self.submitted.popleft())
        progressed = False
        i = 0
        ordered_blocked = False
        mark = None
        while i < len(jobs):
            job = jobs[i]
            if job.ordered and ordered_blocked:
                i += 1
                continue
            if not job.started:
                job.started = job.progress_at = now
                job.probe_at = now + self.probe_s()
            err = None
            for c in job.waiting:
                if c.error is not None:
                    err = c.error
                    break
            if err is None and not all(c.done for c in job.waiting):
                err = engine._qp_error
                if err is None:
                    if now >= job.probe_at:
                        job.probe_at = now + self.probe_s()
                        engine.probe(engine.by_peer if job.ordered else
                                     {r for r, _ in self.waits(job)}, now)
                    idle = now - job.progress_at
                    if idle > job.deadline_s / PROGRESS_SAMPLES:
                        # The deadline bounds a wait without progress, not the call: a
                        # long transfer that keeps moving never times out.
                        mark = mark or self.mark()
                        if mark != job.mark:
                            job.mark, job.progress_at, idle = mark, now, 0.0
                    if idle > job.deadline_s:
                        err = RanksTimeoutError(job.name, engine.rank, job.deadline_s,
                                                self.waits(job))
                    else:
                        ordered_blocked = ordered_blocked or job.ordered
                        i += 1
                        continue
            progressed = True
            job.progress_at = now
            try:
                got = job.program.throw(err) if err is not None else job.program.send(None)
            except StopIteration:
                del jobs[i]
                job.finish()
                continue
            except CollectiveMismatchError as e:
                # Every rank of the call fails it before any data moves (signature
                # check): the queue pairs stay in step, and later calls may run.
                del jobs[i]
                job.finish(e)
                continue
            except BaseException as e:
                # Whatever failed mid-schedule, peers and queue pairs are now out of step
                # with this rank: other jobs cannot be trusted to match, so fail them too.
                del jobs[i]
                job.finish(e)
                engine.failed = e
                self.close_running(lambda _job, e=e, name=job.name: TransportError(
                    f"aborted after {name} failed: {e}"))
                continue
            job.waiting = _flatten(got)
            if engine.arrivals_dirty:
                engine._match()
        return progressed

    def close_running(self, error: Callable[[Job], BaseException]) -> None:
        """Fail every running job with what ``error(job)`` returns. Each program is closed
        here, on the engine thread: its clean-up (its borrowed SENDs taking their own
        copies) must run before the caller has its buffers back, not whenever and
        wherever the generator is collected."""
        for job in self.running:
            own = None
            try:
                job.program.close()
            except CollectiveMismatchError as e:  # what the call had found before it failed
                own = e
            except Exception:
                pass
            job.finish(own or error(job))
        self.running.clear()

    def finish_all(self, error: BaseException) -> None:
        """The engine thread died with ``error``: every job, running or not, fails."""
        for job in (*self.running, *self.submitted):
            job.finish(error)

    def wait_s(self, now: float) -> float | None:
        """Seconds until the first running job's next look at its progress; None without
        one."""
        if not self.running:
            return None
        job = self.running[0]
        return max(0.0, job.progress_at + job.deadline_s / PROGRESS_SAMPLES - now)

    def probe_s(self) -> float:
        timeout = self.engine.peer_timeout_s
        return float("inf") if timeout is None else timeout / PROBES_PER_PEER_TIMEOUT

    def mark(self) -> tuple:
        """The transport's position: what each queue pair has received and had ACKed."""
        return tuple((qp.epsn, qp.next_psn - qp.inflight)
                     for qp in self.engine.by_peer.values())

    def waits(self, job: Job) -> list[tuple[int, str]]:
        """Whom ``job`` waits on, and for what: (rank, what), in order, each once."""
        heads = {}
        for qp in self.engine.by_peer.values():
            heads[id(qp.grants)] = (qp.peer, "grant")
            heads[id(qp.landed)] = (qp.peer, "message")
        out: list[tuple[int, str]] = []
        for w in job.waiting:
            if w.done:
                continue
            peer = getattr(w, "peer", -1)
            if peer >= 0:
                out.append((peer, w.what))
                continue
            # The executor yields a bare queue head: whose, the queue says; for which
            # step, the instruction it runs.
            hit = heads.get(id(getattr(w, "queue", None)))
            if hit is not None:
                step = _step(job.program)
                out.append((hit[0], hit[1] + ("" if step is None else f" of step {step}")))
        return list(dict.fromkeys(out))


def _step(program: Program) -> int | None:
    """The ``step`` of the instruction the innermost running generator of ``program``
    holds (the executor's ``ins``), None if there is none."""
    gen: Any = program
    while getattr(gen, "gi_yieldfrom", None) is not None:
        gen = gen.gi_yieldfrom
    frame = getattr(gen, "gi_frame", None)
    ins = None if frame is None else frame.f_locals.get("ins")
    return getattr(ins, "step", None)


def _flatten(got: Any) -> list[Completion]:
    if got is None:
        return []
    if isinstance(got, Completion) or hasattr(got, "done"):
        return [got]
    out: list[Completion] = []
    for g in got:
        out.extend(_flatten(g))
    return out
