"""Run a function on every rank of a local world, one process per rank.

Processes come from a forkserver (a clean interpreter with fpgaccl preloaded), so a
world of 8 starts in well under a second and no test thread leaks into a rank.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import random
import time
import traceback
from collections.abc import Callable
from typing import Any

_CTX = mp.get_context("forkserver")
_CTX.set_forkserver_preload(["numpy", "fpgaccl.host"])


def _entry(fn: Callable, rank: int, world: int, port: int, comm_kw: dict, kw: dict,
           q: Any) -> None:
    from fpgaccl.host import Communicator
    close = kw.pop("_close", True)
    try:
        comm = Communicator(rank, world, master_port=port, **comm_kw)
        try:
            q.put((rank, "ok", fn(comm, **kw)))
        finally:
            if close:
                comm.close()
    except BaseException as e:  # report, never hang the parent
        q.put((rank, "error", (type(e).__name__, str(e), traceback.format_exc())))


def run_world(world: int, fn: Callable, *, timeout: float = 120.0,
              comm_kw: dict | None = None, ranks_kw: dict[int, dict] | None = None,
              **kw: Any) -> dict[int, tuple[str, Any]]:
    """``fn(comm, **kw)`` on every rank.

    Returns {rank: ("ok", value) | ("error", info) | ("died", exitcode)}.
    """
    # Below Linux's ephemeral range (32768-60999): a port the kernel gave some connection
    # cannot be bound for the rendezvous, and rank 0 would fail while the others wait out
    # their rendezvous timeout (seen once in CI).
    port = random.randint(20000, 32767)
    q = _CTX.Queue()
    procs = []
    for r in range(world):
        rkw = {**kw, **(ranks_kw or {}).get(r, {})}
        p = _CTX.Process(target=_entry, args=(fn, r, world, port, comm_kw or {}, rkw, q),
                         daemon=True)
        p.start()
        procs.append(p)
    out: dict[int, tuple[str, Any]] = {}
    end = time.monotonic() + timeout
    try:
        while len(out) < world:
            try:
                rank, status, value = q.get(timeout=0.2)
                out[rank] = (status, value)
                continue
            except queue.Empty:
                pass
            for r, p in enumerate(procs):
                # A rank that exited without reporting died (tests kill ranks on purpose).
                if r not in out and not p.is_alive() and q.empty():
                    out[r] = ("died", p.exitcode)
            if time.monotonic() > end:
                missing = sorted(set(range(world)) - set(out))
                raise AssertionError(f"ranks {missing} reported nothing in {timeout} s")
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    return out


def all_ok(results: dict[int, tuple[str, Any]]) -> list[Any]:
    errors = {r: v for r, (s, v) in results.items() if s != "ok"}
    assert not errors, "\n".join(f"rank {r}: {v}" for r, v in errors.items())
    return [results[r][1] for r in sorted(results)]
