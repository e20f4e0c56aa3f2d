"""The engine's loop: who runs it (a waiting caller, else the engine thread), and that
an idle engine sleeps."""

from __future__ import annotations

import contextlib
import resource
import threading
import time
from collections.abc import Iterator

import numpy as np

from fpgaccl.host.engine import Engine

from .test_transport import connect_engines


@contextlib.contextmanager
def _two(base: str) -> Iterator[tuple[Engine, Engine]]:
    """Two started engines on ``base``.1 and ``base``.2, each with a queue pair to the
    other; stopped at the end."""
    a, b = Engine(0, f"{base}.1"), Engine(1, f"{base}.2")
    try:
        connect_engines(a, b)
        a.start()
        b.start()
        yield a, b
    finally:
        a.stop()
        b.stop()


def _exchange(eng: Engine, peer: int, threads: list[int], got: np.ndarray):
    threads.append(threading.get_ident())
    done = eng.recv(peer, 7, 1, got)
    sent = eng.send(peer, 7, 1, memoryview(np.full(64, eng.rank + 1, np.uint8)))
    yield [done, sent]
    threads.append(threading.get_ident())


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def test_a_waiting_caller_runs_its_job_on_its_own_thread() -> None:
    # No hop to the engine thread and back: the caller that waits drives the loop. (The
    # engine thread may hold the loop at the moment a call comes, answering a peer, and
    # then runs a step of it: so not every step, but steps of every caller, run on it.)
    mine = {0: 0, 1: 0}
    with _two("127.77.52") as (a, b):
        for _ in range(6):
            ta: list[int] = []
            tb: list[int] = []
            ga, gb = np.zeros(64, np.uint8), np.zeros(64, np.uint8)
            other = threading.Thread(target=lambda: b.submit(
                "x", _exchange(b, 0, tb, gb), 10.0).event.wait(10))  # noqa: B023
            other.start()
            job = a.submit("x", _exchange(a, 1, ta, ga), 10.0)
            assert job.event.wait(10) and job.error is None
            other.join(10)
            assert (ga == 2).all() and (gb == 1).all() and len(ta) == len(tb) == 2
            mine[0] += ta.count(threading.get_ident())
            mine[1] += tb.count(other.ident)
        assert mine[0] >= 3 and mine[1] >= 3, f"steps run by their callers, of 12: {mine}"


def test_an_idle_engine_does_not_spin() -> None:
    with _two("127.77.53") as (a, b):
        got = np.zeros(64, np.uint8)
        job = a.submit("x", _exchange(a, 1, [], got), 10.0)
        b.submit("x", _exchange(b, 0, [], np.zeros(64, np.uint8)), 10.0)
        assert job.event.wait(10) and job.error is None
        time.sleep(0.2)  # deferred ACKs and the like go out
        c0, w0 = _cpu_s(), time.monotonic()
        time.sleep(1.0)
        cpu = (_cpu_s() - c0) / (time.monotonic() - w0)
        # Two engine threads that sleep in poll use well under 1 % of a core here; a
        # loop that spins uses all of one.
        assert cpu < 0.05, f"two idle engines used {cpu:.1%} of a core"


def _calls(eng: Engine, peer: int, n: int, blocking: bool) -> int:
    """``n`` exchanges with ``peer``, each waited for at once; how often the engine
    thread was woken meanwhile (a wake-up costs both threads a context switch)."""
    wakes = [0]
    wake = eng._wake

    def counted() -> None:
        wakes[0] += 1
        wake()

    eng._wake = counted
    try:
        for _ in range(n):
            got = np.zeros(64, np.uint8)
            job = eng.submit("x", _exchange(eng, peer, [], got), 10.0, blocking=blocking)
            assert job.event.wait(10) and job.error is None
            assert (got == peer + 1).all()
    finally:
        del eng._wake
    return wakes[0]


def test_calls_waited_for_at_once_wake_no_engine_thread() -> None:
    # A call submitted and then waited for let the loop go in between and took it back:
    # the engine thread was woken to hold its timers, only to be asked for the loop
    # again. A blocking call keeps the loop; a caller that lets it go sets the engine
    # thread's alarm rather than waking it, so a caller that waits (or calls) again
    # first takes the loop back with no thread woken. Without the alarm (the control),
    # the same calls wake the engine thread.
    n = 100
    with _two("127.77.54") as (a, b):
        for blocking, alarm in ((True, True), (False, True), (True, False)):
            saved = a._alarm, b._alarm
            if not alarm:
                a._alarm = b._alarm = None
            counts = [0, 0]
            other = threading.Thread(target=lambda: counts.__setitem__(  # noqa: B023
                1, _calls(b, 0, n, blocking)))  # noqa: B023
            other.start()
            counts[0] = _calls(a, 1, n, blocking)
            other.join(30)
            a._alarm, b._alarm = saved
            print(f"blocking={blocking} alarm={alarm}: {counts} wake-ups in {n} calls each")
            if alarm:
                assert sum(counts) <= 0.1 * 2 * n, (blocking, counts)
            else:
                assert sum(counts) >= 0.2 * 2 * n, (blocking, counts)


def test_a_job_nobody_waits_for_is_finished_by_the_engine_thread() -> None:
    # Its caller let the loop go with the job running and never drives it again: the
    # alarm hands the job to the engine thread.
    with _two("127.77.55") as (a, b):
        for _ in range(5):
            ga = np.zeros(64, np.uint8)
            job = a.submit("x", _exchange(a, 1, [], ga), 10.0)
            other = b.submit("x", _exchange(b, 0, [], np.zeros(64, np.uint8)), 10.0)
            assert job.event.wait_set(10) and job.error is None and (ga == 2).all()
            assert other.event.wait_set(10) and other.error is None
