"""``fpgaccl bench``: an nccl-tests style benchmark of one collective over a size sweep.

The parent starts ``-g`` local ranks (``python -m fpgaccl.host.bench --worker``) with the
launcher; each rank runs the sweep, times are the maximum over ranks, and rank 0 prints
the nccl-tests table (out-of-place, then in-place) and optionally writes JSON.
Bandwidths follow nccl-tests' PERFORMANCE.md: algbw = size / time, busbw = algbw x
a per-collective factor that makes it comparable to the link speed.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from .buffers import DTYPES, INT_ONLY, OPS

COLLECTIVES = ("allreduce", "reduce", "broadcast", "reduce_scatter", "allgather", "alltoall",
               "alltoallv", "gather", "scatter", "barrier", "sendrecv")
_BLOCKED = ("reduce_scatter", "allgather", "alltoall", "alltoallv", "gather", "scatter")
"""Collectives sized, as nccl-tests does, by the whole buffer of world_size blocks."""
REPO = Path(__file__).resolve().parent.parent


def busbw_factor(coll: str, n: int) -> float:
    if coll == "allreduce":
        return 2 * (n - 1) / n if n > 1 else 0.0
    if coll in _BLOCKED:
        return (n - 1) / n if n > 1 else 0.0
    return 0.0 if coll == "barrier" else 1.0


def parse_size(text: str) -> int:
    text = text.strip().upper().removesuffix("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    if text and text[-1] in mult:
        return int(float(text[:-1]) * mult[text[-1]])
    return int(text)


def sizes(begin: int, end: int, factor: int) -> list[int]:
    out = []
    s = max(begin, 1)
    while s <= end:
        out.append(s)
        s = s * factor if factor > 1 else s + max(1, begin)
    return out


def machine() -> dict[str, Any]:
    out = {"node": platform.node(), "system": platform.system(), "release": platform.release(),
           "machine": platform.machine(), "cpus": os.cpu_count(),
           "python": platform.python_version(),
           # Other work on the machine shifts every time: say how much there was.
           "loadavg": [round(x, 2) for x in os.getloadavg()]}
    # The UDP socket buffers the kernel grants bound the software engine's send window.
    for key in ("rmem_max", "wmem_max"):
        with contextlib.suppress(OSError, ValueError):
            out[f"net_core_{key}"] = int(Path(f"/proc/sys/net/core/{key}").read_text())
    # With CAP_NET_ADMIN the engine forces its buffers past those limits.
    with contextlib.suppress(OSError, ValueError, StopIteration):
        status = Path("/proc/self/status").read_text().splitlines()
        cap_eff = next(line for line in status if line.startswith("CapEff:"))
        out["cap_net_admin"] = bool(int(cap_eff.split()[1], 16) >> _CAP_NET_ADMIN & 1)
    return out


_CAP_NET_ADMIN = 12  # <linux/capability.h>


def git_rev() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, text=True,
                              capture_output=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("collective", nargs="?", default="allreduce", choices=COLLECTIVES)
    p.add_argument("-g", "--ranks", type=int, default=4, help="world size (local ranks)")
    p.add_argument("-b", "--minbytes", default="8", help="smallest size, e.g. 8, 1K, 1M")
    p.add_argument("-e", "--maxbytes", default=None,
                   help="largest size (default 32M; 64K on --backend sim)")
    p.add_argument("-f", "--stepfactor", type=int, default=2, help="size multiplier per step")
    p.add_argument("-n", "--iters", type=int, default=20, help="timed iterations per size")
    p.add_argument("-w", "--warmup_iters", type=int, default=5, help="untimed iterations")
    p.add_argument("-c", "--check", type=int, default=1,
                   help="1: check every iteration against numpy (#wrong column)")
    p.add_argument("-d", "--datatype", default="float32", choices=sorted(DTYPES))
    p.add_argument("-o", "--op", default="sum", choices=sorted(OPS))
    p.add_argument("-r", "--root", type=int, default=0)
    p.add_argument("--algo", default=None, help="force an algorithm (ring, rhd, rd, tree, chain)")
    p.add_argument("--mtu", type=int, default=4096)
    p.add_argument("--json", default=None, help="write the results as JSON to this file")
    p.add_argument("--backend", default="software", choices=("software", "sim"),
                   help="sim: the ranks drive the Verilator-simulated cluster; times are "
                        "simulated cycles at 250 MHz (doorbell to completion)")


# ------------------------------------------------------------------------------ worker side
def _inputs(seed: int, rank: int, count: int, dt: np.dtype, op: str) -> np.ndarray:
    # Small integers: exact in every dtype and any reduction order, so a wrong bit is a bug.
    rng = np.random.default_rng([seed, rank, count])
    if op == "prod":
        vals = rng.choice(np.array([1, -1]) if dt.kind != "u" else np.array([1, 1]), count)
    elif op in INT_ONLY:
        vals = rng.integers(0, 128, count)
    else:
        vals = rng.integers(0, 8, count)
    return vals.astype(dt)


class _Case:
    """Buffers and the numpy reference for one (collective, size)."""

    def __init__(self, comm: Any, args: argparse.Namespace, nbytes: int) -> None:
        p, r = comm.world_size, comm.rank
        self.comm, self.args, self.p, self.r = comm, args, p, r
        dt = self.dt = DTYPES[args.datatype]
        coll = args.collective
        per = max(1, nbytes // dt.itemsize)
        if coll in _BLOCKED:
            per = max(p, per - per % p)  # nccl-tests sizes these by the whole buffer
        if coll == "barrier":
            per = 0
        self.count = per
        self.nbytes = per * dt.itemsize
        ufunc = OPS[args.op]
        self.seed = 1234
        ins = [_inputs(self.seed, k, per, dt, args.op) for k in range(p)]
        self.mine = ins[r]
        red = ins[0].copy()
        for x in ins[1:]:
            ufunc(red, x, out=red)
        n = per // p
        if coll == "allreduce":
            self.expect = red
        elif coll == "reduce":
            self.expect = red if r == args.root else None
        elif coll == "broadcast":
            self.expect = ins[args.root]
        elif coll == "reduce_scatter":
            self.expect = red[r * n:(r + 1) * n]
        elif coll == "allgather":
            self.expect = np.concatenate([x[k * n:(k + 1) * n] for k, x in enumerate(ins)])
            self.mine = ins[r][r * n:(r + 1) * n]
        elif coll == "alltoall":
            self.expect = np.concatenate([x[r * n:(r + 1) * n] for x in ins])
        elif coll == "alltoallv":
            # Uneven blocks (MoE-like): rank i sends rank j (1 + (i + j) % p) * n/p of
            # the n elements of its block j, from its start.
            self.counts = [[(1 + (i + j) % p) * n // p for j in range(p)] for i in range(p)]
            self.expect = np.concatenate([x[r * n:r * n + self.counts[i][r]]
                                          for i, x in enumerate(ins)])
            self.vsend = np.concatenate([ins[r][j * n:j * n + self.counts[r][j]]
                                         for j in range(p)])
        elif coll == "gather":
            self.expect = (np.concatenate([x[k * n:(k + 1) * n] for k, x in enumerate(ins)])
                           if r == args.root else None)
            self.mine = ins[r][r * n:(r + 1) * n]
        elif coll == "scatter":
            self.expect = ins[args.root][r * n:(r + 1) * n]
        elif coll == "barrier":
            self.expect = None
        elif coll == "sendrecv":
            self.expect = ins[(r - 1) % p]
        self.n = n
        self.recv = np.empty(self.expect.size if self.expect is not None else per, dt)
        self.work = np.empty(per, dt)

    def run(self, inplace: bool) -> np.ndarray | None:
        c, a, coll = self.comm, self.args, self.args.collective
        kw = {"algo": a.algo} if a.algo else {}
        if coll == "allreduce":
            return c.allreduce(self.work, None if inplace else self.recv, a.op, **kw)
        if coll == "reduce":
            out = c.reduce(self.work, None if inplace else self.recv, a.op, a.root, **kw)
            return self.work if inplace and out is not None else out
        if coll == "broadcast":
            c.broadcast(self.work, a.root, **kw)
            return self.work
        if coll == "reduce_scatter":
            return c.reduce_scatter(self.work, None if inplace else self.recv, a.op, **kw)
        if coll == "allgather":
            if inplace:
                return c.allgather(self.work, **kw)
            return c.allgather(self.work[:self.n], self.recv, **kw)
        if coll == "alltoall":
            return c.alltoall(self.work, None if inplace else self.recv, **kw)
        # No in-place forms below: both columns time the same call.
        if coll == "alltoallv":
            p, r = self.p, self.r
            rc = [self.counts[i][r] for i in range(p)]
            return c.alltoallv(self.vsend, self.counts[r], self.recv, rc, **kw)
        if coll == "gather":
            root = self.args.root
            return c.gather(self.work[:self.n], self.recv if self.r == root else None, root)
        if coll == "scatter":
            return c.scatter(self.work, self.recv, self.args.root)
        if coll == "barrier":
            c.barrier()
            return None
        if coll == "sendrecv":
            p, r = self.p, self.r
            h = c.send(self.work, (r + 1) % p, async_op=True)
            c.recv(self.recv, (r - 1) % p)
            h.wait()
            return self.recv
        raise AssertionError(coll)

    def reset(self, inplace: bool) -> None:
        coll = self.args.collective
        if coll == "allgather":
            if inplace:
                self.work[self.r * self.n:(self.r + 1) * self.n] = self.mine
            else:
                self.work[:self.n] = self.mine
        elif coll == "gather":
            self.work[:self.n] = self.mine
        elif coll == "broadcast" and self.r != self.args.root:
            self.work[:] = 0
        else:
            self.work[:] = self.mine

    def wrong(self, out: np.ndarray | None) -> int:
        if self.expect is None or out is None:
            return 0
        got = np.asarray(out).reshape(-1)
        if got.size != self.expect.size:
            return int(self.expect.size)
        if got.size == 0:
            return 0
        g = got.view(np.uint8).reshape(got.size, -1)
        e = self.expect.view(np.uint8).reshape(got.size, -1)
        return int(np.count_nonzero(np.any(g != e, axis=1)))


def _measure(case: _Case, inplace: bool, args: argparse.Namespace) -> tuple[float, int]:
    for _ in range(args.warmup_iters):
        case.reset(inplace)
        case.run(inplace)
    wrong = 0
    sim = case.comm.backend == "sim"
    if args.check or sim:
        total = 0.0
        for _ in range(args.iters):
            case.reset(inplace)
            t0 = time.perf_counter()
            out = case.run(inplace)
            # On sim the time is the engines', in simulated cycles at the stated clock.
            total += (case.comm.impl.last_cycles / (case.comm.clock_mhz * 1e6) if sim
                      else time.perf_counter() - t0)
            if args.check:
                wrong += case.wrong(out)
        elapsed = total
    else:
        case.reset(inplace)
        t0 = time.perf_counter()
        for _ in range(args.iters):
            case.run(inplace)
        elapsed = time.perf_counter() - t0
    per_iter = elapsed / max(1, args.iters)
    # nccl-tests reports the slowest rank's time and the sum of wrong elements.
    agg = np.array([per_iter], np.float64)
    case.comm.allreduce(agg, op="max")
    w = np.array([wrong], np.int64)
    case.comm.allreduce(w, op="sum")
    return float(agg[0]), int(w[0])


HEADER = ("#{:>11} {:>12} {:>8} {:>6} {:>6}  {:>9} {:>7} {:>7} {:>6}  {:>9} {:>7} {:>7} {:>6}"
          .format("size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong",
                  "time", "algbw", "busbw", "#wrong"))
UNITS = ("#{:>11} {:>12} {:>8} {:>6} {:>6}  {:>9} {:>7} {:>7} {:>6}  {:>9} {:>7} {:>7} {:>6}"
         .format("(B)", "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", "",
                 "(us)", "(GB/s)", "(GB/s)", ""))


SIM_HEADER = ("#{:>11} {:>12} {:>8} {:>6} {:>6}  {:>9} {:>9} {:>7} {:>7} {:>6}  {:>9} {:>9} {:>7} "
              "{:>7} {:>6}").format("size", "count", "type", "redop", "root", "cycles", "time",
                                    "algbw", "busbw", "#wrong", "cycles", "time", "algbw",
                                    "busbw", "#wrong")
SIM_UNITS = ("#{:>11} {:>12} {:>8} {:>6} {:>6}  {:>9} {:>9} {:>7} {:>7} {:>6}  {:>9} {:>9} {:>7} "
             "{:>7} {:>6}").format("(B)", "(elements)", "", "", "", "", "(us)", "(GB/s)",
                                   "(GB/s)", "", "", "(us)", "(GB/s)", "(GB/s)", "")


def format_sim_row(row: dict) -> str:
    o, i = row["out_of_place"], row["in_place"]
    return (f" {row['size']:>11} {row['count']:>12} {row['type']:>8} {row['redop']:>6} "
            f"{row['root']:>6}  {o['cycles']:>9} {o['time_us']:>9.2f} {o['algbw']:>7.3f} "
            f"{o['busbw']:>7.3f} {o['wrong']:>6}  {i['cycles']:>9} {i['time_us']:>9.2f} "
            f"{i['algbw']:>7.3f} {i['busbw']:>7.3f} {i['wrong']:>6}")


def format_row(row: dict) -> str:
    o, i = row["out_of_place"], row["in_place"]
    return (f" {row['size']:>11} {row['count']:>12} {row['type']:>8} {row['redop']:>6} "
            f"{row['root']:>6}  {o['time_us']:>9.1f} {o['algbw']:>7.3f} {o['busbw']:>7.3f} "
            f"{o['wrong']:>6}  {i['time_us']:>9.1f} {i['algbw']:>7.3f} {i['busbw']:>7.3f} "
            f"{i['wrong']:>6}")


def worker(args: argparse.Namespace) -> int:
    from .environment import init
    comm = init(mtu=args.mtu)
    lead = comm.rank == 0
    coll = args.collective
    sim = comm.backend == "sim"
    if lead and sim:
        print(f"# fpgaccl bench: {coll}, {comm.world_size} ranks, sim backend (HDL nodes on "
              f"the Verilator cluster), time = simulated cycles at {comm.clock_mhz:g} MHz "
              f"from doorbell to completion (slowest rank), {args.iters} iters, "
              f"{args.warmup_iters} warmup, check {args.check}")
        print(SIM_HEADER)
        print(SIM_UNITS, flush=True)
    elif lead:
        print(f"# fpgaccl bench: {coll}, {comm.world_size} ranks, software backend over "
              f"RoCEv2/UDP, mtu {args.mtu}, {args.iters} iters, {args.warmup_iters} warmup, "
              f"check {args.check}")
        print(HEADER)
        print(UNITS, flush=True)
    rows = []
    maxbytes = args.maxbytes or ("64K" if sim else "32M")
    size_list = sizes(parse_size(args.minbytes), parse_size(maxbytes), args.stepfactor)
    if coll == "barrier":
        size_list = [0]   # moves nothing: one row, its time the barrier's latency
    start = time.monotonic()
    factor = busbw_factor(coll, comm.world_size)
    wrong_total = 0
    for k, nbytes in enumerate(size_list):
        case = _Case(comm, args, nbytes)
        res = {}
        for inplace in (False, True):
            t, wrong = _measure(case, inplace, args)
            algbw = case.nbytes / t / 1e9 if t > 0 else 0.0
            res["in_place" if inplace else "out_of_place"] = {
                "time_us": t * 1e6, "algbw": algbw, "busbw": algbw * factor, "wrong": wrong}
            if sim:
                res["in_place" if inplace else "out_of_place"]["cycles"] = round(
                    t * comm.clock_mhz * 1e6)
            wrong_total += wrong
        redop = args.op if coll in ("allreduce", "reduce", "reduce_scatter") else "none"
        root = args.root if coll in ("reduce", "broadcast", "gather", "scatter") else -1
        row = {"size": case.nbytes, "count": case.count, "type": args.datatype, "redop": redop,
               "root": root, **res}
        rows.append(row)
        if lead:
            print(format_sim_row(row) if sim else format_row(row), flush=True)
            elapsed = time.monotonic() - start
            if elapsed > 2:
                bar = "#" * int(30 * (k + 1) / len(size_list))
                print(f"\r[{bar:<30}] {k + 1}/{len(size_list)} sizes, {elapsed:.0f} s",
                      end="" if k + 1 < len(size_list) else "\n", file=sys.stderr, flush=True)
    # Peak resident memory (max over ranks) against the largest user buffer, for the
    # "2x user buffer plus a bounded ring" target; and rank 0's drop counters, as the
    # hardware's CSR drop block would be read.
    rss = np.array([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024], np.float64)
    comm.allreduce(rss, op="max")
    drops = {k: v for k, v in comm.drop_counters().items() if v}
    if lead:
        busbws = [r["out_of_place"]["busbw"] for r in rows]
        print(f"# Peak RSS per rank    : {rss[0]:.1f} MiB (largest buffer "
              f"{max(r['size'] for r in rows) / 2**20:.1f} MiB)")
        print(f"# Drops (rank 0)       : {drops or 'none'}")
        print(f"# Out of bounds values : {wrong_total} {'OK' if not wrong_total else 'FAILED'}")
        print(f"# Avg bus bandwidth    : {sum(busbws) / max(1, len(busbws)):.4f} GB/s")
        if args.json:
            doc = {"bench": f"fpgaccl-{coll}", "command": " ".join(sys.argv),
                   "git_rev": git_rev(), "machine": machine(),
                   "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
                   "params": {k: v for k, v in vars(args).items() if k != "json"},
                   "world_size": comm.world_size, "backend": comm.backend, "rows": rows,
                   **({"clock_mhz": comm.clock_mhz} if sim else {}),
                   "wrong_total": wrong_total, "peak_rss_mib": float(rss[0]),
                   "drops_rank0": drops}
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
            print(f"# results written to {args.json}")
    comm.close()
    return 1 if wrong_total else 0


def main(args: argparse.Namespace) -> int:
    """Parent side: start the ranks, each running :func:`worker` with the same options."""
    from .launcher import run
    argv = [sys.executable, "-m", "fpgaccl.host.bench", "--worker", args.collective,
            "-b", str(args.minbytes), "-f", str(args.stepfactor),
            "-n", str(args.iters), "-w", str(args.warmup_iters), "-c", str(args.check),
            "-d", args.datatype, "-o", args.op, "-r", str(args.root), "--mtu", str(args.mtu)]
    if args.maxbytes:
        argv += ["-e", str(args.maxbytes)]
    if args.algo:
        argv += ["--algo", args.algo]
    if args.json:
        argv += ["--json", str(Path(args.json).resolve())]
    return run(args.ranks, argv, backend=args.backend)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="fpgaccl bench")
    parser.add_argument("--worker", action="store_true")
    add_arguments(parser)
    a = parser.parse_args()
    sys.exit(worker(a) if a.worker else main(a))
