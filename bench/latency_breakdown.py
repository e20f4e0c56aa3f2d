"""Where a small allreduce's time goes on the software backend, beside the UDP floor.

Starts ``-g`` local ranks (``fpgaccl run``); each times ``-n`` allreduces of ``--bytes``
float32 bytes after ``-w`` warm-ups and stamps every call with ``time.perf_counter_ns``
at five points, by wrapping the engine's entry points from outside (the engine itself
is unchanged by the measurement, but for those wrappers' cost of about 1 us a call):

* ``call``: the caller enters ``allreduce``;
* ``submit``: the backend hands the program to the engine (``Engine.submit``);
* ``start``: the program first runs (on the engine thread, or on the caller's);
* ``end``: the program returns (its last wait is over);
* ``return``: ``allreduce`` returns to the caller.

Between ``start`` and ``end`` it also sums the time the thread that runs the program
slept (in ``poll``, or in the driving caller's wait: the wire and the peers, as this
rank saw them) and counts the datagrams each call sent and
received. Then each rank stays idle for ``--idle-s`` seconds and measures its own CPU
time meanwhile (all threads): an idle communicator must not spin.

The same run builds ``bench/udp_floor.c`` (``cc -O2``) and measures a plain C UDP
ping-pong between two processes on loopback (datagrams of ``--bytes``, at most 1400):
the floor under all of it. The table and ``bench/results/latency_breakdown.json`` (or
``--json``) report medians over the calls of each rank, the slowest rank's mean call
time, and the load average before and after.

    python bench/latency_breakdown.py                 # 4 ranks, 8 B, 500 calls
    python bench/latency_breakdown.py --bytes 64K -n 200
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
from common import RESULTS, provenance

HERE = Path(__file__).resolve().parent
FLOOR_MAX_BYTES = 1400  # udp_floor.c's largest datagram: one, under a 1500-byte MTU
POINTS = ("call", "submit", "start", "end", "return")
PARTS = (
    ("python before submit", "call", "submit"),
    ("submit to program start (hand-off)", "submit", "start"),
    ("program: running", None, None),
    ("program: asleep in poll", None, None),
    ("program end to return (wake-up, Python after)", "end", "return"),
)


def _size(text: str) -> int:
    text = text.strip().upper().removesuffix("B")
    mult = {"K": 1 << 10, "M": 1 << 20}
    return int(float(text[:-1]) * mult[text[-1]]) if text[-1:] in mult else int(text)


# ------------------------------------------------------------------------------ worker
class _Stamps:
    def __init__(self, n: int) -> None:
        self.t = np.zeros((n, len(POINTS)), np.int64)
        self.sleep = np.zeros(n, np.int64)
        self.sleeps = np.zeros(n, np.int64)
        self.i = -1  # the call being stamped; -1: none (warm-up)
        self.in_program = False
        self.tid = 0  # the thread the program runs on: only its waits count
        self.wakes = 0  # wake-ups of the engine thread (a byte on its socket pair)


def _instrument(st: _Stamps) -> None:
    """Wrap Engine.submit (stamps submit, start, end) and the engine's poll (sleep time
    while a program runs)."""
    import select as _select
    import types

    from fpgaccl.host import engine as engine_mod

    ns = time.perf_counter_ns
    submit = engine_mod.Engine.submit

    def stamped_submit(self, name, program, deadline_s, **kw):
        i = st.i
        if i >= 0:
            st.t[i, 1] = ns()

        def wrapped():
            if i >= 0:
                st.t[i, 2] = ns()
                st.in_program = True
                st.tid = threading.get_ident()
            try:
                yield from program
            finally:
                if i >= 0:
                    st.t[i, 3] = ns()
                    st.in_program = False

        return submit(self, name, wrapped(), deadline_s, **kw)

    class Poller:
        def __init__(self) -> None:
            self.p = _select.poll()

        def register(self, *a):
            return self.p.register(*a)

        def unregister(self, *a):
            return self.p.unregister(*a)

        def modify(self, *a):
            return self.p.modify(*a)

        def poll(self, timeout=None):
            if not timeout or not st.in_program or st.i < 0 or \
                    threading.get_ident() != st.tid:
                return self.p.poll(timeout)
            t = ns()
            try:
                return self.p.poll(timeout)
            finally:
                st.sleep[st.i] += ns() - t
                st.sleeps[st.i] += 1

    engine_mod.Engine.submit = stamped_submit
    wake = engine_mod.Engine._wake

    def counted_wake(self):
        if st.i >= 0:
            st.wakes += 1
        return wake(self)

    engine_mod.Engine._wake = counted_wake
    drive_wait = getattr(engine_mod.Engine, "_drive_wait", None)
    if drive_wait is not None:  # a caller that drives the loop waits here, not in poll
        def timed_drive_wait(self):
            wait = drive_wait(self)

            def timed(ms: int) -> bool:
                if not st.in_program or st.i < 0 or threading.get_ident() != st.tid:
                    return wait(ms)
                t = ns()
                try:
                    return wait(ms)
                finally:
                    st.sleep[st.i] += ns() - t
                    st.sleeps[st.i] += 1
            self._drive_waiter = timed
            return timed

        engine_mod.Engine._drive_wait = timed_drive_wait
    shim = types.SimpleNamespace(**{k: getattr(_select, k) for k in dir(_select)
                                    if k.isupper() or k == "error"})
    shim.poll = Poller
    engine_mod.select = shim


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _worker(args: argparse.Namespace) -> None:
    st = _Stamps(args.iters)
    _instrument(st)
    from fpgaccl.host import init
    fc = init()
    rank = fc.rank
    engine = fc.impl.engine
    x = np.ones(max(1, args.bytes // 4), np.float32)
    for _ in range(args.warmup):
        fc.allreduce(x)
    ns = time.perf_counter_ns
    stats0 = dict(engine.stats)
    t0 = time.perf_counter()
    for i in range(args.iters):
        st.i = i
        st.t[i, 0] = ns()
        fc.allreduce(x)
        st.t[i, 4] = ns()
    wall = time.perf_counter() - t0
    st.i = -1
    moved = {k: (engine.stats[k] - stats0.get(k, 0)) / args.iters
             for k in ("rx_packets", "tx_packets", "acks_tx", "poll_expired")}
    fc.barrier()
    c0, w0 = _cpu_s(), time.perf_counter()
    time.sleep(args.idle_s)
    idle = (_cpu_s() - c0) / (time.perf_counter() - w0)
    d = np.diff(st.t, axis=1) / 1e3  # us between consecutive points
    prog = d[:, 2]
    asleep = st.sleep / 1e3
    parts = [d[:, 0], d[:, 1], prog - asleep, asleep, d[:, 3]]
    out = {"rank": rank, "mean_call_us": wall / args.iters * 1e6,
           "median_call_us": float(np.median((st.t[:, 4] - st.t[:, 0]) / 1e3)),
           "parts_median_us": [float(np.median(p)) for p in parts],
           "parts_mean_us": [float(np.mean(p)) for p in parts],
           "sleeps_per_call": float(st.sleeps.mean()),
           "engine_wakeups_per_call": st.wakes / args.iters,
           "per_call": moved, "idle_cpu_fraction": idle}
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(out))
    fc.close()


# ------------------------------------------------------------------------------ parent
def _floor(iters: int, size: int) -> dict:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return {"skipped": "no C compiler (cc/gcc) on PATH"}
    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(tmp, "udp_floor")
        subprocess.run([cc, "-O2", "-o", str(exe), str(HERE / "udp_floor.c")], check=True)
        got = subprocess.run([str(exe), str(iters), str(size)], check=True,
                             capture_output=True, text=True).stdout
    return json.loads(got)


def _run(python: str, args: argparse.Namespace) -> list[dict]:
    """One run of ``-g`` ranks under ``python`` (whose fpgaccl they import)."""
    with tempfile.TemporaryDirectory() as out:
        cmd = [python, "-m", "fpgaccl.host.cli", "run", "-n", str(args.ranks), "--",
               python, __file__, "--worker", "--out", out, "--bytes", str(args.bytes),
               "-n", str(args.iters), "-w", str(args.warmup), "--idle-s", str(args.idle_s)]
        subprocess.run(cmd, check=True)
        return [json.loads(Path(out, f"rank{r}.json").read_text())
                for r in range(args.ranks)]


def _table(ranks: list[dict]) -> None:
    med = np.array([r["parts_median_us"] for r in ranks])
    print(f"{'part (median per call, us)':48} " +
          " ".join(f"{'rank ' + str(r['rank']):>8}" for r in ranks))
    for k, (name, _, _) in enumerate(PARTS):
        print(f"{name:48} " + " ".join(f"{v:8.1f}" for v in med[:, k]))
    print(f"{'call (median)':48} " + " ".join(f"{r['median_call_us']:8.1f}" for r in ranks))
    print(f"{'call (mean)':48} " + " ".join(f"{r['mean_call_us']:8.1f}" for r in ranks))
    print(f"{'sleeps (engine poll or caller wait) per call':48} " +
          " ".join(f"{r['sleeps_per_call']:8.2f}" for r in ranks))
    print(f"{'engine thread wake-ups per call':48} " +
          " ".join(f"{r['engine_wakeups_per_call']:8.2f}" for r in ranks))
    for key in ("tx_packets", "rx_packets", "acks_tx"):
        print(f"{key + ' per call':48} " + " ".join(f"{r['per_call'][key]:8.2f}" for r in ranks))
    print(f"{'idle CPU, % of a core':48} " +
          " ".join(f"{100 * r['idle_cpu_fraction']:8.2f}" for r in ranks))


def _git_rev(python: str) -> str:
    code = "import fpgaccl, pathlib; print(pathlib.Path(fpgaccl.__file__).resolve().parents[1])"
    root = subprocess.run([python, "-c", code], capture_output=True, text=True).stdout.strip()
    rev = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"],
                         capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    return f"{root} {rev}{'-dirty' if dirty else ''}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-g", "--ranks", type=int, default=4)
    ap.add_argument("--bytes", type=_size, default=8)
    ap.add_argument("-n", "--iters", type=int, default=500)
    ap.add_argument("-w", "--warmup", type=int, default=50)
    ap.add_argument("-r", "--rounds", type=int, default=1,
                    help="runs of each --python, interleaved")
    ap.add_argument("--python", action="append",
                    help="a checkout's interpreter (its .venv/bin/python) to measure beside "
                         "this one's, in the same rounds; repeatable")
    ap.add_argument("--idle-s", type=float, default=5.0)
    ap.add_argument("--json", type=Path, default=RESULTS / "latency_breakdown.json")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        _worker(args)
        return 0
    pythons = [sys.executable, *(args.python or [])]
    load0 = os.getloadavg()
    floor = _floor(2000, min(args.bytes, FLOOR_MAX_BYTES))
    print(f"{args.ranks} ranks, {args.bytes} B float32 sum allreduce, {args.iters} calls "
          f"after {args.warmup}, {args.rounds} round(s); load {load0[0]:.2f}", flush=True)
    runs: dict[str, list] = {py: [] for py in pythons}
    for rnd in range(args.rounds):
        order = pythons if rnd % 2 == 0 else pythons[::-1]
        for py in order:
            ranks = _run(py, args)
            runs[py].append({"loadavg": os.getloadavg(), "per_rank": ranks})
    load1 = os.getloadavg()
    out = []
    for py in pythons:
        where = _git_rev(py)
        slowest = [max(r["mean_call_us"] for r in run["per_rank"]) for run in runs[py]]
        best = int(np.argsort(slowest)[len(slowest) // 2])  # the median round's table
        print(f"\n{where}: slowest rank's mean call per round " +
              ", ".join(f"{t:.1f}" for t in slowest) + " us; the median round:")
        _table(runs[py][best]["per_rank"])
        out.append({"python": py, "checkout": where, "slowest_mean_call_us": slowest,
                    "median_slowest_mean_call_us": float(np.median(slowest)),
                    "rounds": runs[py]})
    if "median_rtt_us" in floor:
        print(f"\nC UDP ping-pong floor ({min(args.bytes, FLOOR_MAX_BYTES)} B datagrams): round "
              f"trip {floor['median_rtt_us']:.1f} us median ({floor['mean_rtt_us']:.1f} mean); "
              f"load {load0[0]:.2f} -> {load1[0]:.2f}")
    else:
        print(f"\nfloor: {floor['skipped']}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({
        **provenance(), "ranks": args.ranks, "bytes": args.bytes, "iters": args.iters,
        "warmup": args.warmup, "parts": [p[0] for p in PARTS], "checkouts": out,
        "udp_floor": floor, "loadavg_before": load0, "loadavg_after": load1}, indent=2) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
