"""The engine's job queue: the programs the host submitted, resumed on the engine thread
when what they wait on is done, failed at their deadline or with their queue pairs.

Ordered jobs (collectives) share the collective region and its numbering: they run one
at a time, in submission order, which every rank shares, like a hardware command queue.
An unordered one (a send or a recv) needs only its own messages, which per-peer sequence
numbers match: it neither waits behind another job nor holds one back, so an irecv
posted before its isend (or before an allreduce) completes, as MPI's
Irecv/Isend/Waitall does.
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from collections.abc import Callable, Generator
from functools import partial
from typing import TYPE_CHECKING, Any

from fpgaccl.errors import CollectiveTimeoutError, TransportError

from .qp import Completion

if TYPE_CHECKING:
    from .engine import Engine

Program = Generator[Any, None, None]
"""A collective schedule: yields Completions (or iterables of them) to wait on."""

SEQUENCE_POLL_S = 0.002
"""The sequencer runs when something it may wait on happened (``Engine.seq_due``: an
ACKed message, a grant or message landed, a receive delivered, a new job) and, failing
that, at least this often, for deadlines."""


class Latch:
    """A one-shot event for one setter (the engine thread) and any waiters: a lock held
    until set. ``threading.Event`` builds a Condition and a fresh lock on every wait; a
    small collective pays for both twice, a bare lock costs one futex each side."""

    __slots__ = ("_lock", "_set")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()
        self._set = False

    def set(self) -> None:
        if not self._set:
            self._set = True
            self._lock.release()

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout: float | None = None) -> bool:
        if self._set:
            return True
        if self._lock.acquire(timeout=-1 if timeout is None else max(timeout, 0.0)):
            self._lock.release()  # the next waiter gets through too
            return True
        return self._set


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

    def finish(self, error: BaseException | None = None) -> None:
        self.error = error
        self.event.set()


class Jobs:
    """``submitted`` (by the host thread, taken by the engine thread) and ``running``:
    the jobs the engine thread resumes in :meth:`sequence`."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.submitted: deque[Job] = deque()
        self.running: deque[Job] = deque()

    def sequence(self, now: float) -> bool:
        """Resume every job whose waits are over (or failed, or past its deadline);
        whether any was resumed."""
        engine = self.engine
        jobs = self.running
        while self.submitted:
            jobs.append(self.submitted.popleft())
        progressed = False
        i = 0
        ordered_blocked = False
        while i < len(jobs):
            job = jobs[i]
            if job.ordered and ordered_blocked:
                i += 1
                continue
            if not job.started:
                job.started = now
            err = None
            for c in job.waiting:
                if c.error is not None:
                    err = c.error
                    break
            if err is None and not all(c.done for c in job.waiting):
                err = engine._qp_error
                if err is None:
                    if now - job.started > job.deadline_s:
                        err = CollectiveTimeoutError(
                            job.name, engine.rank, job.deadline_s,
                            f"waiting on {sum(not c.done for c in job.waiting)} transfer(s)")
                    else:
                        ordered_blocked = ordered_blocked or job.ordered
                        i += 1
                        continue
            progressed = True
            try:
                got = job.program.throw(err) if err is not None else job.program.send(None)
            except StopIteration:
                del jobs[i]
                job.finish()
                continue
            except BaseException as e:
                # Whatever failed mid-schedule, peers and queue pairs are now out of step
                # with this rank: other jobs cannot be trusted to match, so fail them too.
                del jobs[i]
                job.finish(e)
                engine.failed = e
                self.close_running(partial(TransportError,
                                           f"aborted after {job.name} failed: {e}"))
                continue
            job.waiting = _flatten(got)
            if engine.arrivals_dirty:
                engine._match()
        return progressed

    def close_running(self, error: Callable[[], BaseException]) -> None:
        """Fail every running job with what ``error()`` returns. Each program is closed
        here, on the engine thread: its clean-up (its borrowed SENDs taking their own
        copies) must run before the caller has its buffers back, not whenever and
        wherever the generator is collected."""
        for job in self.running:
            with contextlib.suppress(Exception):
                job.program.close()
            job.finish(error())
        self.running.clear()

    def finish_all(self, error: BaseException) -> None:
        """The engine thread died with ``error``: every job, running or not, fails."""
        for job in (*self.running, *self.submitted):
            job.finish(error)

    def wait_s(self, now: float) -> float | None:
        """Seconds until the first running job's deadline; None without one."""
        if not self.running:
            return None
        job = self.running[0]
        return max(0.0, job.started + job.deadline_s - now)


def _flatten(got: Any) -> list[Completion]:
    if got is None:
        return []
    if isinstance(got, Completion) or hasattr(got, "done"):
        return [got]
    out: list[Completion] = []
    for g in got:
        out.extend(_flatten(g))
    return out
