"""The engine's loop: who runs it (a waiting caller, else the engine thread), and that
an idle engine sleeps."""

from __future__ import annotations

import resource
import threading
import time

import numpy as np

from fpgaccl.host.engine import Engine


def _two(base: str) -> tuple[Engine, Engine]:
    """Two started engines on ``base``.1 and ``base``.2, each with a queue pair to the
    other."""
    a, b = Engine(0, f"{base}.1"), Engine(1, f"{base}.2")
    qa, qb = a.create_qp(1), b.create_qp(0)
    qa.connect(remote_qpn=qb.qpn, addr=b.addr, local_ip=a.addr[0], send_psn=5, recv_psn=9,
               remote_va=qb.ring.va, remote_rkey=qb.ring.rkey)
    qb.connect(remote_qpn=qa.qpn, addr=a.addr, local_ip=b.addr[0], send_psn=9, recv_psn=5,
               remote_va=qa.ring.va, remote_rkey=qa.ring.rkey)
    a.start()
    b.start()
    return a, b


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
    a, b = _two("127.77.52")
    mine = {0: 0, 1: 0}
    try:
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
    finally:
        a.stop()
        b.stop()


def test_an_idle_engine_does_not_spin() -> None:
    a, b = _two("127.77.53")
    try:
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
    finally:
        a.stop()
        b.stop()
