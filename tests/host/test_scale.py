"""The software backend at scale: 16 and 32 ranks on one machine each run the same mixed
sequence of 1000 collectives (every kind, algorithm, dtype and op the backend offers,
sizes from one element to past the collective region, so that some calls run in
segments), every result checked bit for bit on every rank, with no hang.

Every rank draws the same plan from one seed and can compute any rank's input (block by
block: a rank computes only the blocks its result holds), so each checks its own results
against numpy alone. Inputs are small integers (in float dtypes too), so every sum is
exact whatever order the ranks reduce in; ``prod`` multiplies values of 1 and -1 only,
for the same reason. The collective region is 256 KiB, so the larger calls run in
segments.

32 ranks on CI's 2 cores take about 0.4 s a call (every rank's engine starved by 31
others), so the default run gives them 250 calls; ``FPGACCL_SCALE_CALLS=1000`` runs the
whole sequence at both sizes. Starved that much, a rank may not answer for longer than
the default peer timeout (1.25 s; once in three 1000-call runs it failed a healthy
world with PeerDeadError), so these worlds wait 20 s before judging a peer dead."""

from __future__ import annotations

import os

import numpy as np
import pytest

from ._world import all_ok, run_world

CALLS = 1000
DTYPES = (np.int8, np.uint16, np.int32, np.uint32, np.int64, np.uint64, np.float32,
          np.float64)
KINDS = ("allreduce", "reduce", "broadcast", "reduce_scatter", "allgather", "alltoall",
         "alltoallv", "gather", "scatter", "barrier", "sendrecv")
ALGO = {"allreduce": (None, "ring", "rhd", "rd", "tree"), "reduce": (None, "chain", "tree"),
        "broadcast": (None, "tree", "chain"), "alltoallv": (None, "direct")}
SIZES = (1, 3, 64, 1000, 4096, 40_000)
BLOCKED = ("reduce_scatter", "allgather", "alltoall", "alltoallv", "gather", "scatter")
BLOCK_SIZES = (1, 3, 64, 1000, 2500)  # per block, for the calls with world_size blocks
STAGE_BYTES = 256 << 10


def _input(seed: int, rank: int, n: int, dt: np.dtype, op: str, block: int = 0
           ) -> np.ndarray:
    rng = np.random.default_rng([seed, rank, block])
    if op == "prod":
        return rng.choice(np.array([1, -1] if np.dtype(dt).kind != "u" else [1, 1]),
                          n).astype(dt)
    hi = 3 if np.dtype(dt).itemsize == 1 else 50
    lo = 0 if np.dtype(dt).kind == "u" else -hi
    return rng.integers(lo, hi, n).astype(dt)


def _reduce(op: str, xs: list[np.ndarray]) -> np.ndarray:
    f = {"sum": np.add, "prod": np.multiply, "max": np.maximum, "min": np.minimum}[op]
    out = xs[0].copy()
    for x in xs[1:]:
        out = f(out, x, dtype=out.dtype)
    return out


def _plan(p: int, calls: int) -> list[dict]:
    rng = np.random.default_rng(2026)
    plan = []
    for i in range(calls):
        kind = KINDS[rng.integers(len(KINDS))]
        dt = DTYPES[rng.integers(len(DTYPES))]
        op = ("sum", "prod", "max", "min")[rng.integers(4)]
        algo = ALGO.get(kind, (None,))
        sizes = BLOCK_SIZES if kind in BLOCKED else SIZES
        call = {"i": i, "kind": kind, "dt": dt, "op": op,
                "n": int(sizes[rng.integers(len(sizes))]), "root": int(rng.integers(p)),
                "algo": algo[rng.integers(len(algo))],
                "shift": int(rng.integers(1, p))}
        if kind == "alltoallv":  # counts[i][j]: what rank i sends rank j
            call["counts"] = rng.integers(0, 200, (p, p)).tolist()
        plan.append(call)
    return plan


def _mixed(comm, calls: int) -> dict:
    p, me = comm.world_size, comm.rank
    wrong: list[str] = []
    for c in _plan(p, calls):
        i, kind, dt, op, n, root = c["i"], c["kind"], c["dt"], c["op"], c["n"], c["root"]
        kw = {"algo": c["algo"]} if c["algo"] else {}

        def x(rank: int, m: int = n, c=c) -> np.ndarray:
            return _input(c["i"], rank, m, c["dt"], c["op"])

        def xb(rank: int, block: int, m: int = n, c=c) -> np.ndarray:
            return _input(c["i"], rank, m, c["dt"], c["op"], 1 + block)

        def xs(rank: int, counts: list[int] | None = None, c=c) -> np.ndarray:  # all blocks
            return np.concatenate([xb(rank, j, m) for j, m in
                                   enumerate(counts or [c["n"]] * p)])

        got = want = None
        if kind == "allreduce":
            got = comm.allreduce(x(me), np.empty(n, dt), op=op, **kw)
            want = _reduce(op, [x(r) for r in range(p)])
        elif kind == "reduce":
            got = comm.reduce(x(me), np.empty(n, dt) if me == root else None, op=op,
                              root=root, **kw)
            want = _reduce(op, [x(r) for r in range(p)]) if me == root else None
        elif kind == "broadcast":
            got = x(me) if me == root else np.zeros(n, dt)
            comm.broadcast(got, root=root, **kw)
            want = x(root)
        elif kind == "reduce_scatter":
            got = comm.reduce_scatter(xs(me), np.empty(n, dt), op=op)
            want = _reduce(op, [xb(r, me) for r in range(p)])
        elif kind == "allgather":
            got = comm.allgather(x(me), np.empty(n * p, dt))
            want = np.concatenate([x(r) for r in range(p)])  # p x n: as small as the result
        elif kind == "alltoall":
            got = comm.alltoall(xs(me), np.empty(n * p, dt))
            want = np.concatenate([xb(r, me) for r in range(p)])
        elif kind == "alltoallv":
            cnt = c["counts"]
            sc = cnt[me]
            rc = [cnt[r][me] for r in range(p)]
            got = comm.alltoallv(xs(me, sc), sc, np.empty(sum(rc), dt), rc, **kw)
            want = np.concatenate([xb(r, me, rc[r]) for r in range(p)])
        elif kind == "gather":
            got = comm.gather(x(me), np.empty(n * p, dt) if me == root else None, root=root)
            want = np.concatenate([x(r) for r in range(p)]) if me == root else None
        elif kind == "scatter":
            got = comm.scatter(xs(root) if me == root else None, np.empty(n, dt), root=root)
            want = xb(root, me)
        elif kind == "barrier":
            comm.barrier()
        else:  # sendrecv: a ring shift by ``shift``, every rank sending and receiving
            dst, src = (me + c["shift"]) % p, (me - c["shift"]) % p
            h = comm.send(x(me), dst, async_op=True)
            got = comm.recv(np.empty(n, dt), src)
            h.wait()
            want = x(src)
        if (got is None) != (want is None) or (
                want is not None and not np.array_equal(np.asarray(got).view(np.uint8),
                                                        want.view(np.uint8))):
            wrong.append(f"call {i} {kind} {np.dtype(dt).name} {op} n={n} root={root}")
    return {"wrong": wrong, "stats": comm.stats()}


@pytest.mark.parametrize("world, calls", [(16, CALLS), (32, 250)])
def test_a_mixed_sequence_of_collectives_at_scale(world, calls):
    calls = int(os.environ.get("FPGACCL_SCALE_CALLS", calls))
    res = all_ok(run_world(world, _mixed, timeout=1200, calls=calls,
                           comm_kw={"stage_bytes": STAGE_BYTES, "peer_timeout_s": 20.0}))
    for r, out in enumerate(res):
        assert out["wrong"] == [], f"rank {r}: {out['wrong'][:5]}"
    assert sum(out["stats"].get("tx_packets", 0) for out in res) > 0
