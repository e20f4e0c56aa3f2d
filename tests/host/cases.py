"""Every collective x dtype x op, checked against numpy on each rank (runs inside ranks)."""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from fpgaccl.host.buffers import AVG, DTYPES, INT_ONLY, OPS

FLOAT_RTOL = {"float16": 2e-2, "bfloat16": 1e-1, "float32": 1e-4, "float64": 1e-10}


def inputs(seed: int, world: int, count: int, dtype: str) -> list[np.ndarray]:
    """Every rank's input, computable on any rank (same seed everywhere)."""
    dt = DTYPES[dtype]
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(world):
        if dt.kind in "iu":
            info = np.iinfo(dt)
            out.append(rng.integers(info.min, info.max, count, dtype=dt, endpoint=True))
        else:
            out.append(rng.uniform(0.5, 1.5, count).astype(dt) * rng.choice([-1, 1], count)
                       .astype(dt))
    return out


def reference(xs: list[np.ndarray], op: str) -> np.ndarray:
    dt = xs[0].dtype
    if op == AVG:
        summed = reference(xs, "sum")
        n = len(xs)
        if dt.kind in "iu":  # the wrapped sum, divided toward zero (Python ints)
            return np.array([v // n if v >= 0 else -(-v // n) for v in summed.tolist()], dt)
        return summed / n
    if dt.kind == "f" or dt.name == "bfloat16":
        acc = xs[0].astype(np.float64)
        for x in xs[1:]:
            acc = OPS[op](acc, x.astype(np.float64))
        return acc
    acc = xs[0].copy()
    for x in xs[1:]:
        OPS[op](acc, x, out=acc)  # integer arithmetic wraps, like the engine's
    return acc


def same(got: np.ndarray, want: np.ndarray, dtype: str) -> bool:
    if DTYPES[dtype].kind in "iu":
        return got.dtype == want.dtype and np.array_equal(got, want)
    return bool(np.allclose(got.astype(np.float64), want, rtol=FLOAT_RTOL[dtype] *
                            max(1, len(got) and 1), atol=FLOAT_RTOL[dtype]))


def ops_for(dtype: str) -> list[str]:
    return [o for o in (*OPS, AVG) if o not in INT_ONLY or DTYPES[dtype].kind in "iu"]


def run_all(comm: Any, seed: int, big: bool = False) -> dict[str, Any]:
    """Returns failures and a digest of every float result (must match across ranks)."""
    p, r = comm.world_size, comm.rank
    fails: list[str] = []
    digest = hashlib.sha256()
    case = 0

    def check(name: str, got: Any, want: np.ndarray, dtype: str) -> None:
        got = np.asarray(got).reshape(-1)
        if not same(got, want, dtype):
            bad = np.flatnonzero(got.astype(np.float64) != want.astype(np.float64))[:5]
            fails.append(f"rank {r} {name}: mismatch at {bad.tolist()}")
        if name.split()[0] == "allreduce":  # the only result all ranks share
            digest.update(name.encode() + got.tobytes())

    for dtype in DTYPES:
        for op in ops_for(dtype):
            case += 1
            count = int(np.random.default_rng([seed, case]).integers(1, 300))
            if big and case % 9 == 0:
                count = 70_000  # several ring slots, multi-packet messages
            xs = inputs(seed + case, p, count, dtype)
            want = reference(xs, op)
            algo = ("ring", "rhd", "rd", "tree")[case // 2 % 4]  # each in and out of place
            inplace = case % 2 == 0
            buf = xs[r].copy()
            out = comm.allreduce(buf, None if inplace else np.empty_like(buf), op, algo=algo)
            check(f"allreduce {dtype} {op} {algo} inplace={inplace} n={count}", out, want,
                  dtype)
            root = case % p
            buf = xs[r].copy()
            res = comm.reduce(buf, None if inplace else np.empty_like(buf), op, root=root)
            if r == root:
                check(f"reduce {dtype} {op} root={root}", res, want, dtype)
            elif not np.array_equal(buf, xs[r]):
                fails.append(f"rank {r} reduce {dtype} {op}: non-root sendbuf modified")
            n = count
            xs_rs = inputs(seed + 1000 + case, p, n * p, dtype)
            want_rs = reference(xs_rs, op)[r * n:(r + 1) * n]
            buf = xs_rs[r].copy()
            res = comm.reduce_scatter(buf, None if inplace else np.empty(n, buf.dtype), op)
            check(f"reduce_scatter {dtype} {op} inplace={inplace}", res, want_rs, dtype)

    for k, dtype in enumerate(DTYPES):
        count = 1 + 37 * k + (50_000 if big and k == 3 else 0)
        xs = inputs(seed + 5000 + k, p, count, dtype)
        root = k % p
        buf = xs[r].copy()
        comm.broadcast(buf, root=root, algo=("tree", "chain")[k % 2])
        if not np.array_equal(buf.view(np.uint8), xs[root].view(np.uint8)):
            fails.append(f"rank {r} broadcast {dtype} root={root}")
        full = np.concatenate(xs)
        if k % 2:
            buf = full.copy()
            buf[:] = 0
            buf[r * count:(r + 1) * count] = xs[r]
            res = comm.allgather(buf)
        else:
            res = comm.allgather(xs[r], np.empty(count * p, xs[r].dtype))
        if not np.array_equal(np.asarray(res).view(np.uint8), full.view(np.uint8)):
            fails.append(f"rank {r} allgather {dtype} inplace={bool(k % 2)}")
        # alltoall: block j of rank i's buffer goes to rank j
        mine = xs[r]
        blk = count // p if count >= p else 1
        a2a = inputs(seed + 6000 + k, p, blk * p, dtype)
        want = np.concatenate([a2a[i][r * blk:(r + 1) * blk] for i in range(p)])
        if k % 2:
            buf = a2a[r].copy()
            res = comm.alltoall(buf)
        else:
            res = comm.alltoall(a2a[r], np.empty_like(a2a[r]))
        if not np.array_equal(np.asarray(res).view(np.uint8), want.view(np.uint8)):
            fails.append(f"rank {r} alltoall {dtype}")
        # gather to and scatter from root (every rank's result is checked on its own)
        got = comm.gather(xs[r], np.empty(count * p, xs[r].dtype) if r == root else None,
                          root=root)
        if (r == root) != (got is not None) or (
                r == root and got.view(np.uint8).tobytes() != full.view(np.uint8).tobytes()):
            fails.append(f"rank {r} gather {dtype} root={root}")
        part = np.empty(count, xs[r].dtype)
        got = comm.scatter(full if r == root else None, part, root=root)
        if got.view(np.uint8).tobytes() != xs[r].view(np.uint8).tobytes():
            fails.append(f"rank {r} scatter {dtype} root={root}")
        # alltoallv: rank i sends (i + j + k) % 4 elements to rank j
        cnt = [[(i + j + k) % 4 for j in range(p)] for i in range(p)]
        srcs = inputs(seed + 7000 + k, p, 4 * p, dtype)
        send = srcs[r][:sum(cnt[r])]
        recvcounts = [cnt[i][r] for i in range(p)]
        recv = np.empty(sum(recvcounts), send.dtype)
        algo = ("direct", "padded")[k % 2]
        comm.alltoallv(send, cnt[r], recv, recvcounts, algo=algo)
        parts = []
        for i in range(p):
            sdi = int(np.sum(cnt[i][:r]))
            parts.append(srcs[i][sdi:sdi + cnt[i][r]])
        want = np.concatenate(parts) if parts else recv[:0]
        if not np.array_equal(recv.view(np.uint8), want.view(np.uint8)):
            fails.append(f"rank {r} alltoallv {dtype} {algo}")
        # send/recv around the ring, async send so nobody deadlocks
        if p > 1:
            h = comm.send(mine, (r + 1) % p, async_op=True)
            got = np.empty_like(mine)
            comm.recv(got, (r - 1) % p)
            h.wait()
            if not np.array_equal(got.view(np.uint8), xs[(r - 1) % p].view(np.uint8)):
                fails.append(f"rank {r} send/recv {dtype}")
        del mine
    # async handles: two collectives in flight at once
    a = np.full(1000, r + 1, np.int64)
    b = np.full(10, 2 * r, np.int32)
    h1 = comm.allreduce(a, async_op=True)
    h2 = comm.allreduce(b, op="max", async_op=True)
    h2.wait()
    h1.wait()
    assert h1.test() and h2.test()
    if not (a == p * (p + 1) // 2).all() or not (b == 2 * (p - 1)).all():
        fails.append(f"rank {r} async allreduce")
    comm.barrier()
    return {"fails": fails, "digest": digest.hexdigest(), "drops": comm.drop_counters(),
            "stats": comm.stats()}


def overlapping_round(comm: Any, a: Any, b: Any, i: int) -> dict[str, bytes]:
    """Round ``i`` of the overlapping sub-communicator workload (issue 28), on world rank
    ``comm.rank``: ``a`` (world ranks 0-2, or None) allreduces and allgathers, ``b``
    (ranks 1-3, or None) allreduces max, async, in opposite orders across the two on
    alternate ranks and rounds, beside a world allreduce. Within a communicator every
    rank keeps one order. Every result, as bytes (see :func:`overlapping_want`)."""
    r = comm.rank
    rng = np.random.default_rng(1000 * i + r)
    xa = rng.integers(-1 << 20, 1 << 20, 257, dtype=np.int64)
    xb = rng.standard_normal(64).astype(np.float32)
    on_a, on_b = [], []
    if a is not None:
        g = np.empty(64 * a.world_size, np.float32)
        on_a.append(("a", lambda: a.allreduce(xa.copy(), async_op=True)))
        on_a.append(("ag", lambda: a.allgather(xb, g, async_op=True)))
    if b is not None:
        on_b.append(("b", lambda: b.allreduce(xa.copy(), op="max", async_op=True)))
    # Rank 1 issues a's calls first where rank 2 issues b's; each engine runs in order.
    calls = on_b + on_a if (r + i) % 2 else on_a + on_b
    handles = [(name, call()) for name, call in calls]
    whole = comm.allreduce(xa.copy(), async_op=True)
    got = {name: h.wait() for name, h in reversed(handles)}
    got["world"] = whole.wait()
    return {k: v.tobytes() for k, v in got.items()}


def overlapping_want(i: int, rank: int) -> dict[str, bytes]:
    """What :func:`overlapping_round` ``i`` returns on ``rank`` of a world of 4."""
    xa, xb = [], []
    for r in range(4):
        rng = np.random.default_rng(1000 * i + r)
        xa.append(rng.integers(-1 << 20, 1 << 20, 257, dtype=np.int64))
        xb.append(rng.standard_normal(64).astype(np.float32))
    want = {"world": sum(xa).tobytes()}
    if rank in (0, 1, 2):
        want["a"] = (xa[0] + xa[1] + xa[2]).tobytes()
        want["ag"] = np.concatenate(xb[:3]).tobytes()
    if rank in (1, 2, 3):
        want["b"] = np.maximum(np.maximum(xa[1], xa[2]), xa[3]).tobytes()
    return want
