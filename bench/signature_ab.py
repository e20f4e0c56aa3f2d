"""What checking call signatures costs, measured inside one world: the ranks alternate
``comm.check_calls`` call by call (every rank alike), so both settings run on the same
engines, sockets and CPU speed, a call apart. This machine's speed moves between runs by
more than the check costs; interleaved calls see the same machine.

For each size: ``-n`` calls after ``-w`` warm-ups, half checked; each rank's median
wall time and CPU time (its whole process) per call for either setting; the table gives
every rank's ratio, the JSON (``bench/results/signature_ab.json``, or
``signature_ab_<coll>.json`` for another ``--coll``) the times. ``--coll``: ``allreduce``
(float32 sum, a program: the digest rides in its GRANTs), ``tree`` (allreduce
``algo="tree"``, a host schedule: records ahead of the data) or ``alltoallv`` (size
bytes to each peer, the direct schedule: records with every rank's counts).

    python bench/signature_ab.py                  # 8 B and 64 MiB, 4 ranks
    python bench/signature_ab.py --sizes 8,1M -n 400
    python bench/signature_ab.py --coll alltoallv --sizes 8,64K,16M
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time

import numpy as np
from common import REPO, write_results

sys.path.insert(0, str(REPO))
from tests.host._world import run_world

SIZES = {"8": 8, "64K": 64 << 10, "1M": 1 << 20, "16M": 16 << 20, "64M": 64 << 20}


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _call(comm, coll: str, nbytes: int):
    n = max(1, nbytes // 4)
    if coll == "alltoallv":
        p = comm.world_size
        x = np.ones(n * p, np.float32)
        y = np.empty_like(x)
        return lambda: comm.alltoallv(x, [n] * p, y, [n] * p, algo="direct")
    x = np.ones(n, np.float32)
    y = np.empty_like(x)
    algo = "tree" if coll == "tree" else None
    return lambda: comm.allreduce(x, y, algo=algo)


def alternate(comm, coll: str, nbytes: int, iters: int, warmup: int) -> dict:
    call = _call(comm, coll, nbytes)
    times: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    for i in range(warmup + iters):
        check = bool(i % 2)
        comm.check_calls = check
        comm.barrier()
        t0, c0 = time.perf_counter(), _cpu_s()
        call()
        if i >= warmup:
            times[check].append((time.perf_counter() - t0, _cpu_s() - c0))
    return {("on" if k else "off"): {"wall_s": float(np.median([w for w, _ in v])),
                                     "cpu_s": float(np.median([c for _, c in v]))}
            for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="8,64M")
    ap.add_argument("--coll", choices=("allreduce", "tree", "alltoallv"), default="allreduce")
    ap.add_argument("-g", "--ranks", type=int, default=4)
    ap.add_argument("-n", "--iters", type=int, default=None,
                    help="calls per size (default: 400 for small sizes, 30 for 64M)")
    ap.add_argument("-w", "--warmup", type=int, default=4)
    args = ap.parse_args()
    rows = []
    for name in args.sizes.split(","):
        nbytes = SIZES.get(name) or int(name)
        iters = args.iters or (30 if nbytes >= 16 << 20 else 400)
        load0 = os.getloadavg()[0]
        print(f"# {name}: {iters} {args.coll} calls on {args.ranks} ranks, alternating ...",
              flush=True)
        res = run_world(args.ranks, alternate, coll=args.coll, nbytes=nbytes, iters=iters,
                        warmup=args.warmup, timeout=1800, comm_kw={"deadline_s": 60},
                        _close=False)
        bad = {r: v for r, v in res.items() if v[0] != "ok"}
        if bad:
            raise SystemExit(f"ranks failed: {bad}")
        per_rank = {r: v for r, (_, v) in sorted(res.items())}
        ratios = [v["on"]["wall_s"] / v["off"]["wall_s"] for v in per_rank.values()]
        cpu = [v["on"]["cpu_s"] / v["off"]["cpu_s"] for v in per_rank.values()]
        rows.append({"coll": args.coll, "size": nbytes, "iters": iters, "per_rank": per_rank,
                     "wall_ratio": ratios, "cpu_ratio": cpu,
                     "load": [load0, os.getloadavg()[0]]})
        off = np.median([v["off"]["wall_s"] for v in per_rank.values()]) * 1e6
        on = np.median([v["on"]["wall_s"] for v in per_rank.values()]) * 1e6
        print(f"{nbytes:>10} B  off {off:10.1f} us  on {on:10.1f} us  on/off by rank "
              f"{' '.join(f'{x:.3f}' for x in ratios)}  cpu on/off "
              f"{' '.join(f'{x:.3f}' for x in cpu)}", flush=True)
    name = "signature_ab" if args.coll == "allreduce" else f"signature_ab_{args.coll}"
    path = write_results(name, rows, ranks=args.ranks)
    print(f"# written to {path}")


if __name__ == "__main__":
    main()
