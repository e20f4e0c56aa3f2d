"""Run a function on every rank of a local world, one process per rank.

Processes come from a forkserver (a clean interpreter with fpgaccl preloaded), so a
world of 8 starts in well under a second and no test thread leaks into a rank.
"""

from __future__ import annotations

import multiprocessing as mp
import random
import traceback
from collections.abc import Callable
from typing import Any

_CTX = mp.get_context("forkserver")
_CTX.set_forkserver_preload(["numpy", "fpgaccl.host"])


def _entry(fn: Callable, rank: int, world: int, port: int, comm_kw: dict, kw: dict,
           q: Any) -> None:
    from fpgaccl.host import Communicator
    try:
        comm = Communicator(rank, world, master_port=port, **comm_kw)
        try:
            q.put((rank, "ok", fn(comm, **kw)))
        finally:
            if kw.get("_close", True):
                comm.close()
    except BaseException as e:  # report, never hang the parent
        q.put((rank, "error", (type(e).__name__, str(e), traceback.format_exc())))


def run_world(world: int, fn: Callable, *, timeout: float = 120.0,
              comm_kw: dict | None = None, ranks_kw: dict[int, dict] | None = None,
              **kw: Any) -> dict[int, tuple[str, Any]]:
    """``fn(comm, **kw)`` on every rank; returns {rank: ("ok", value) | ("error", info)}."""
    port = random.randint(20000, 60000)
    q = _CTX.Queue()
    procs = []
    for r in range(world):
        rkw = {**kw, **(ranks_kw or {}).get(r, {})}
        p = _CTX.Process(target=_entry, args=(fn, r, world, port, comm_kw or {}, rkw, q),
                         daemon=True)
        p.start()
        procs.append(p)
    out: dict[int, tuple[str, Any]] = {}
    try:
        while len(out) < world:
            try:
                rank, status, value = q.get(timeout=timeout)
            except Exception:
                missing = sorted(set(range(world)) - set(out))
                raise AssertionError(f"ranks {missing} reported nothing in {timeout} s") from None
            out[rank] = (status, value)
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    return out


def all_ok(results: dict[int, tuple[str, Any]]) -> list[Any]:
    errors = {r: v for r, (s, v) in results.items() if s != "ok"}
    assert not errors, "\n".join(f"rank {r}: {v[0]}: {v[1]}\n{v[2]}" for r, v in errors.items())
    return [results[r][1] for r in sorted(results)]
