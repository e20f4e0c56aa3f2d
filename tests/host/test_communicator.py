"""The Communicator's own bookkeeping: call numbers taken under one lock."""

from __future__ import annotations

import threading
import time

import numpy as np

from fpgaccl.errors import AbortedError
from fpgaccl.host import Communicator
from fpgaccl.host.backends.base import Finished

from ._world import all_ok, run_world
from .cases import overlapping_round, overlapping_want


class _RacingLock:
    """The Communicator's lock, with another thread's call slipped in right after the
    first release: the moment a call number read outside the lock goes stale."""

    def __init__(self, comm: Communicator) -> None:
        self._comm = comm
        self._inner = comm._lock
        self._raced = False

    def __enter__(self) -> None:
        self._inner.__enter__()

    def __exit__(self, *exc: object) -> None:
        self._inner.__exit__(*exc)
        if not self._raced:
            self._raced = True
            self._comm._next_coll()  # the other thread's barrier, say


def test_a_call_keeps_the_sequence_number_it_took_when_another_call_slips_in() -> None:
    comm = Communicator(0, 1, master_port=31997, check_calls=True)
    try:
        runs = []

        def run(program_run, deadline_s):
            runs.append(program_run)
            return Finished(program_run.name, deadline_s)

        comm.impl.run = run
        comm._lock = _RacingLock(comm)
        comm.allreduce(np.ones(4, np.float32))
        comm.allreduce(np.ones(4, np.float32))
        # Calls 1 and 3 (the slipped-in one took 2), not 2 and 3.
        assert [r.signature.seq for r in runs] == [1, 3]
    finally:
        del comm.impl.run
        comm._lock = comm._lock._inner
        comm.close()


def _split_basics(comm) -> dict:
    # Ranks 0 and 2 form one communicator, 1 and 3 want another but 3 is in none.
    color = None if comm.rank == 3 else comm.rank % 2
    sub = comm.split(color, key=-comm.rank)
    x = np.array([comm.rank + 1], np.int64)
    if sub is None:
        return {"sub": None, "parent": int(comm.allreduce(x.copy())[0])}
    try:
        total = sub.allreduce(x.copy())
        got = np.empty(sub.world_size, np.int64)
        sub.allgather(x, got)
        parent = comm.allreduce(x.copy())  # the parent goes on, beside its child
        return {"sub": (sub.rank, sub.world_size, sub.label, sub.check_calls,
                        [e["seq"] for e in sub.flight_record()]), "total": int(total[0]),
                "order": got.tolist(), "parent": int(parent[0]),
                "ports": (comm.impl.engine.addr, sub.impl.engine.addr)}
    finally:
        sub.close()


def test_split_sizes_ranks_mpi_order_and_no_color() -> None:
    # With signatures: a sub-communicator checks its calls in a sequence of its own.
    res = all_ok(run_world(4, _split_basics, timeout=60, _close=False,
                           comm_kw={"check_calls": True}))
    assert res[3] == {"sub": None, "parent": 10}
    # key = -rank: the higher old rank comes first.
    assert res[0]["sub"] == (1, 2, "world.split1", True, [1, 2])
    assert res[2]["sub"] == (0, 2, "world.split1", True, [1, 2])
    assert res[1]["sub"] == (0, 1, "world.split1", True, [1, 2])
    assert res[0]["total"] == res[2]["total"] == 1 + 3 and res[1]["total"] == 2
    assert res[0]["order"] == res[2]["order"] == [3, 1]
    assert [res[r]["parent"] for r in (0, 1, 2)] == [10, 10, 10]
    for r in (0, 1, 2):
        (pip, pport), (sip, sport) = res[r]["ports"]
        assert pip == sip and pport != sport  # an engine of its own on the same address


def _overlapping(comm, iterations: int) -> list:
    r = comm.rank
    a = comm.split(0 if r in (0, 1, 2) else None)  # ranks 0, 1, 2
    b = comm.split(0 if r in (1, 2, 3) else None)  # ranks 1, 2, 3
    try:
        return [overlapping_round(comm, a, b, i) for i in range(iterations)]
    finally:
        for c in (a, b):
            if c is not None:
                c.close()


def test_overlapping_sub_communicators_in_opposite_orders_complete_bit_exact() -> None:
    n = 50
    res = all_ok(run_world(4, _overlapping, iterations=n, timeout=240,
                           comm_kw={"deadline_s": 30}, _close=False))
    for i in range(n):
        for r in range(4):
            assert res[r][i] == overlapping_want(i, r), (i, r)


def _loopback_port(comm) -> int:
    # A local rank's engine binds 127.<port >> 8>.<port & 255>.<rank + 1> (rendezvous.py).
    _, hi, lo, _ = comm.impl.engine.addr[0].split(".")
    return int(hi) << 8 | int(lo)


def _abort_pending(comm, handles: list) -> tuple[list[str], float]:
    """``comm.abort()`` 0.3 s from now, from another thread: the operations ``handles``
    failed with AbortedError, and how long waiting for them took."""
    t0 = time.monotonic()
    threading.Timer(0.3, comm.abort).start()
    names = []
    for h in handles:
        try:
            h.wait()
        except AbortedError as e:
            names.append(e.operation)
    return names, time.monotonic() - t0


def _abort_then_rebuild(comm) -> dict:
    port = _loopback_port(comm)
    out: dict = {}
    if comm.rank == 0:
        # Three calls rank 1 never makes: only abort() can end them before the deadline.
        handles = [comm.allreduce(np.ones(100, np.float32), async_op=True) for _ in range(3)]
        out["errors"], out["waited_s"] = _abort_pending(comm, handles)
        out["record"] = [(e["seq"], e["state"], (e["error"] or "").split(":")[0])
                         for e in comm.flight_record()]
    else:
        time.sleep(0.6)
        comm.abort()  # nothing pending here: it only frees the ports
    try:
        comm.allreduce(np.ones(4, np.float32))
    except AbortedError:
        out["later"] = "AbortedError"
    comm.close()  # a no-op after abort
    # The same address and port 4791 again, and a new rendezvous on the same TCP port:
    # only possible if abort() gave them back.
    with Communicator(comm.rank, 2, master_port=port, deadline_s=10) as again:
        out["again"] = again.allreduce(np.full(4, comm.rank + 1, np.float32)).tolist()
        out["same_address"] = again.impl.engine.addr == comm.impl.engine.addr
    return out


def test_abort_fails_every_pending_call_at_once_and_a_new_world_forms() -> None:
    res = all_ok(run_world(2, _abort_then_rebuild, timeout=90,
                           comm_kw={"deadline_s": 30}, _close=False))
    assert res[0]["errors"] == ["allreduce"] * 3
    assert res[0]["waited_s"] < 5, res[0]  # not the 30 s deadline
    assert res[0]["record"] == [(s, "failed", "AbortedError") for s in (1, 2, 3)]
    for r in (0, 1):
        assert res[r]["later"] == "AbortedError"
        assert res[r]["again"] == [3.0] * 4 and res[r]["same_address"]


def _abort_reaches_subs(comm) -> dict:
    sub = comm.split(0, comm.rank)
    inner = sub.split(0, comm.rank)
    out: dict = {}
    if comm.rank == 0:
        # Calls rank 1 never makes, on both levels: only the parent's abort() ends them.
        handles = [c.allreduce(np.ones(10, np.float32), async_op=True) for c in (sub, inner)]
        out["names"], out["waited_s"] = _abort_pending(comm, handles)
    else:
        time.sleep(0.6)
        comm.abort()
    for c in (sub, inner):
        try:
            c.allreduce(np.ones(4, np.float32))
        except AbortedError:
            out.setdefault("later", []).append("AbortedError")
    return out


def test_abort_reaches_the_sub_communicators_split_from_it() -> None:
    res = all_ok(run_world(2, _abort_reaches_subs, timeout=90, comm_kw={"deadline_s": 30},
                           _close=False))
    assert res[0]["names"] == ["allreduce", "allreduce"]
    assert res[0]["waited_s"] < 5, res[0]  # not the 30 s deadline
    for r in (0, 1):
        assert res[r]["later"] == ["AbortedError"] * 2


def _recorded(comm) -> list:
    x = np.arange(8, dtype=np.int32)
    comm.allreduce(x.copy(), op="max", tag="t")
    comm.broadcast(x.copy(), root=1)
    h = comm.allreduce(x.astype(np.float64), async_op=True)
    pending = comm.flight_record()[-1]["state"]
    h.wait()
    comm.barrier()
    rec = comm.flight_record()
    return [pending] + [{k: e[k] for k in ("seq", "name", "count", "dtype", "op", "root",
                                            "state")} for e in rec] + [
        all(e["start"] <= e["end"] for e in rec)]


def _seen_while_blocked(comm) -> list:
    """What the flight record shows of a blocking call while it waits for a late peer
    (on the software backend it runs to its end inside its own submission)."""
    seen: list = []
    x = np.ones(4, np.float32)
    comm.allreduce(x)
    if comm.rank == 1:
        time.sleep(0.8)
    else:
        def look() -> None:
            time.sleep(0.3)
            last = comm.flight_record()[-1]
            seen.append((last["seq"], last["name"], last["state"]))

        t = threading.Thread(target=look)
        t.start()
    comm.allreduce(x)
    if comm.rank == 0:
        t.join()
    return seen


def test_a_blocking_call_is_in_the_flight_record_while_it_waits() -> None:
    res = all_ok(run_world(2, _seen_while_blocked, timeout=60))
    assert res[0] == [(2, "allreduce", "pending")], res


def test_the_flight_record_holds_each_calls_signature_and_state() -> None:
    res = all_ok(run_world(2, _recorded, timeout=60))
    for got in res:
        assert got[0] in ("pending", "done")
        assert got[1:-1] == [
            {"seq": 1, "name": "allreduce", "count": 8, "dtype": "INT32", "op": "MAX",
             "root": None, "state": "done"},
            {"seq": 2, "name": "broadcast", "count": 8, "dtype": "INT32", "op": None,
             "root": 1, "state": "done"},
            {"seq": 3, "name": "allreduce", "count": 8, "dtype": "FLOAT64", "op": "SUM",
             "root": None, "state": "done"},
            # A barrier is a program over a token of whole 64-bit words: its signature's.
            {"seq": 4, "name": "barrier", "count": 1, "dtype": "UINT64", "op": None,
             "root": None, "state": "done"}]
        assert got[-1]
