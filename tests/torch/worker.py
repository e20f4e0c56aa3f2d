"""One rank of the torch backend tests: ``python -m tests.torch.worker SCENARIO OUTDIR``
with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set (env://, as torchrun would). Each rank
saves what it got to OUTDIR/rank{r}.pt; the tests compute what it should be from the
same inputs (:func:`make_input`)."""

from __future__ import annotations

import os
import sys
import time
import zlib
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8,
          torch.int16, torch.int32, torch.int64, torch.uint8, torch.uint16, torch.uint32,
          torch.uint64]
OPS = {"sum": dist.ReduceOp.SUM, "product": dist.ReduceOp.PRODUCT, "min": dist.ReduceOp.MIN,
       "max": dist.ReduceOp.MAX, "avg": dist.ReduceOp.AVG}
N = 37  # odd, so no collective divides it evenly by accident
BIG = 300_000


def make_input(rank: int, key: str, dtype: torch.dtype = torch.float32, n: int = N) -> torch.Tensor:
    """Rank ``rank``'s input of case ``key``: small integers (exact sums and products in
    every dtype) or floats in [0.5, 1.5)."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{rank}/{key}".encode()))
    if dtype.is_floating_point:
        return (torch.rand(n, generator=g, dtype=torch.float64) + 0.5).to(dtype)
    lo = 0 if not dtype.is_signed else -3
    return torch.randint(lo, 4, (n,), generator=g, dtype=torch.int64).to(dtype)


def _error(fn: Any) -> tuple[str, str]:
    try:
        fn()
    except Exception as e:
        return type(e).__name__, getattr(e, "argument", str(e))
    return "none", ""


def collectives(rank: int, p: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    # Post every allreduce first, then wait: the futures complete behind the caller.
    works = []
    for dt in DTYPES:
        for name, op in OPS.items():
            if name == "product" and dt.is_floating_point and dt != torch.float64:
                continue  # float products of 4 ranks differ by order; float64 covers the op
            t = make_input(rank, f"ar-{name}-{dt}", dt)
            out[f"allreduce/{name}/{dt}"] = t
            works.append(dist.all_reduce(t, op=op, async_op=True))
    futs = [w.get_future() for w in works]
    torch.futures.wait_all(futs)
    out["allreduce_done"] = all(w.is_completed() for w in works)
    # Above 64 KiB the result lands in the tensor itself (bound over the region's OUT).
    t = make_input(rank, "ar-big", torch.int32, BIG)
    dist.all_reduce(t)
    out["allreduce_big"] = t

    t = make_input(rank, "bcast")
    dist.broadcast(t, src=p - 1)
    out["broadcast"] = t

    t = make_input(rank, "ag", torch.int32)
    whole = torch.empty(p * N, dtype=torch.int32)
    dist.all_gather_into_tensor(whole, t)
    out["all_gather_into_tensor"] = whole
    parts = [torch.empty(N, dtype=torch.int32) for _ in range(p)]
    dist.all_gather(parts, t)
    out["all_gather"] = parts

    t = make_input(rank, "rs", torch.int64, p * N)
    res = torch.empty(N, dtype=torch.int64)
    dist.reduce_scatter_tensor(res, t)
    out["reduce_scatter_tensor"] = res
    res = torch.empty(N, dtype=torch.float64)
    dist.reduce_scatter_tensor(res, make_input(rank, "rs-avg", torch.float64, p * N),
                               op=dist.ReduceOp.AVG)
    out["reduce_scatter_tensor_avg"] = res
    res = torch.empty(N, dtype=torch.int64)
    dist.reduce_scatter(res, list(t.chunk(p)))
    out["reduce_scatter"] = res

    # Coalesced (as FSDP2 and DTensor issue them): tensors of several sizes, one collective.
    sizes = (5, 1, 2 * N)
    ts = [make_input(rank, f"arc{k}", torch.int32, n) for k, n in enumerate(sizes)]
    with dist._coalescing_manager():
        for t in ts:
            dist.all_reduce(t)
    out["allreduce_coalesced"] = ts
    ins = [make_input(rank, f"agc{k}", torch.float32, n) for k, n in enumerate(sizes)]
    outs = [torch.empty(p * n) for n in sizes]
    with dist._coalescing_manager():
        for o, i in zip(outs, ins, strict=True):
            dist.all_gather_into_tensor(o, i)
    out["all_gather_coalesced"] = outs
    ins = [make_input(rank, f"rsc{k}", torch.float64, p * n) for k, n in enumerate(sizes)]
    outs = [torch.empty(n, dtype=torch.float64) for n in sizes]
    with dist._coalescing_manager():
        for o, i in zip(outs, ins, strict=True):
            dist.reduce_scatter_tensor(o, i, op=dist.ReduceOp.AVG)
    out["reduce_scatter_coalesced_avg"] = outs

    t = make_input(rank, "a2a", torch.int32, p * N)
    res = torch.empty_like(t)
    dist.all_to_all_single(res, t)
    out["all_to_all_single"] = res
    # Uneven splits: rank r sends j + r + 1 rows of 3 to rank j.
    sends = [j + rank + 1 for j in range(p)]
    recvs = [rank + j + 1 for j in range(p)]
    t = make_input(rank, "a2av", torch.float32, sum(sends) * 3).view(-1, 3)
    res = torch.empty(sum(recvs), 3)
    dist.all_to_all_single(res, t, output_split_sizes=recvs, input_split_sizes=sends)
    out["all_to_all_single_splits"] = res
    ins = list(make_input(rank, "a2al", torch.int16, sum(sends)).split(sends))
    outs = [torch.empty(k, dtype=torch.int16) for k in recvs]
    dist.all_to_all(outs, ins)
    out["all_to_all"] = outs

    t = make_input(rank, "gather")
    glist = [torch.empty(N) for _ in range(p)] if rank == 1 else None
    dist.gather(t, glist, dst=1)
    out["gather"] = glist
    res = torch.empty(N)
    dist.scatter(res, [make_input(j, "scatter") for j in range(p)] if rank == 0 else None, src=0)
    out["scatter"] = res
    t = make_input(rank, "reduce", torch.int32)
    dist.reduce(t, dst=p - 1, op=dist.ReduceOp.MAX)
    out["reduce"] = t

    # Point to point, in a ring, both directions posted before either is awaited.
    t = make_input(rank, "p2p")
    res = torch.empty(N)
    ws = [dist.isend(t, (rank + 1) % p), dist.irecv(res, (rank - 1) % p)]
    for w in ws:
        w.wait()
    out["send_recv"] = res

    # Not contiguous: a transposed matrix and every other element; results land in them.
    m = make_input(rank, "nc", torch.float64, 12).view(3, 4).t()
    dist.all_reduce(m)
    out["noncontig_t"] = m
    base = make_input(rank, "nc2", torch.int64, 2 * N)
    dist.all_reduce(base[::2])
    out["noncontig_strided"] = base

    # The caller is not blocked: the last rank joins 1 s late.
    if rank == p - 1:
        time.sleep(1.0)
    t = torch.ones(4)
    t0 = time.monotonic()
    w = dist.all_reduce(t, async_op=True)
    out["post_s"] = time.monotonic() - t0
    out["done_at_post"] = w.is_completed()
    chained = w.get_future().then(lambda f: f.value()[0].sum().item())
    out["wait_timeout"] = _error(lambda: w.wait(timedelta(milliseconds=50)))
    w.wait()
    out["wait_s"] = time.monotonic() - t0
    out["chained"] = chained.wait()
    # Polled, a call completes with neither wait() nor its future asked for.
    w = dist.all_reduce(torch.ones(4), async_op=True)
    t0 = time.monotonic()
    while not w.is_completed() and time.monotonic() - t0 < 30:
        time.sleep(0.001)
    out["polled"] = w.is_completed() and w.exception() is None
    # A call waited for runs on the waiting thread: the completion thread never has it.
    w = dist.all_reduce(torch.ones(4), async_op=True)
    w.wait()
    out["waited_alone"] = not w._posted.queued

    t0 = time.monotonic()
    dist.barrier()
    out["barrier"] = True

    # Idle: the completion thread and the engine sleep.
    c0, w0 = time.process_time(), time.monotonic()
    time.sleep(1.0)
    out["idle_cpu_per_s"] = (time.process_time() - c0) / (time.monotonic() - w0)

    # A whole-world group shares the communicator; a subset raises on its members.
    g = dist.new_group(list(range(p)))
    t = torch.full((3,), float(rank))
    dist.all_reduce(t, group=g)
    out["new_group_world"] = t
    out["subgroups"] = _subgroups(rank, p)
    out["tag"] = _error(lambda: dist.send(torch.ones(1), (rank + 1) % p, tag=7))
    out["bool"] = _error(lambda: dist.all_reduce(torch.ones(2, dtype=torch.bool)))
    out["float8"] = _error(lambda: dist.broadcast(torch.ones(2, dtype=torch.float8_e5m2), 0))
    out["coalesced"] = _error(lambda: dist.all_gather_coalesced([[torch.ones(2)] * p],
                                                                [torch.ones(2)]))
    dist.barrier()
    return out


def _subgroups(rank: int, p: int) -> dict[str, Any]:
    """Two overlapping subgroups (every rank calls new_group, as torch requires), used in
    opposite orders on the ranks they share; a group of one; a group given in reversed
    order (torch sorts it)."""
    a = dist.new_group([0, 1])
    b = dist.new_group(list(range(1, p)))
    one = dist.new_group([p - 1])
    rev = dist.new_group(list(range(p))[::-1][:2])  # ranks p-1, p-2
    out: dict[str, Any] = {}
    for i in range(5):
        works = {}
        calls = []
        if rank in (0, 1):
            ta = torch.full((5,), float(rank + 1 + i))
            calls.append(("a", lambda ta=ta: (ta, dist.all_reduce(ta, group=a, async_op=True))))
        if rank >= 1:
            tb = torch.full((3,), float(rank * 10 + i))
            calls.append(("b", lambda tb=tb: (tb, dist.broadcast(tb, src=p - 1, group=b,
                                                                 async_op=True))))
        if rank % 2 == 1:
            calls.reverse()
        for name, call in calls:
            works[name] = call()
        for name, (t, w) in works.items():
            w.wait()
            out.setdefault(name, []).append(t.clone())
    if rank == p - 1:
        t = torch.full((2,), 7.0)
        dist.all_reduce(t, group=one)
        out["one"] = t
    if rank >= p - 2:
        t = torch.full((1,), float(rank))
        dist.broadcast(t, src=p - 1, group=rev)
        out["rev"] = (dist.get_group_rank(rev, rank), t.item())
    dist.barrier()
    return out


def ddp(rank: int, p: int, steps: int = 3) -> dict[str, Any]:
    """Parameters after each step of a small MLP under DDP with several gradient buckets;
    every rank starts from different weights and sees different data."""
    torch.manual_seed(100 + rank)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(),
                                torch.nn.Linear(64, 64), torch.nn.Tanh(),
                                torch.nn.Linear(64, 4))
    # bucket_cap_mb small: 3+ buckets, reduced while backward still runs.
    ddp_model = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.01)
    opt = torch.optim.SGD(ddp_model.parameters(), lr=0.1)
    params = []
    for _ in range(steps):
        x = torch.randn(8, 16)
        loss = ddp_model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        params.append(torch.cat([q.detach().reshape(-1) for q in model.parameters()]).clone())
    return {"params": params}


def main() -> None:
    scenario, outdir = sys.argv[1], sys.argv[2]
    import fpgaccl.torch  # noqa: F401  (registers the backend)

    rank, p = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("fpgaccl", timeout=timedelta(seconds=60))
    out = {"collectives": collectives, "ddp": ddp}[scenario](rank, p)
    out["backend"] = dist.get_backend()
    dist.destroy_process_group()
    torch.save(out, os.path.join(outdir, f"rank{rank}.pt"))


if __name__ == "__main__":
    main()
