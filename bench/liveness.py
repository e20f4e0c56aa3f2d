"""How fast the other ranks find a dead one: killed (its host answers ICMP port
unreachable) or hung (SIGSTOP: its port stays open and only the peer timeout can tell).

Four local ranks on loopback run 1 MiB float32 allreduces in a loop with the default
liveness settings. After 0.2 s rank 2 posts one more allreduce and, 5 ms into it,
stops by SIGKILL or SIGSTOP. Each other rank records when its call failed, with which
error, naming whom and why; a trial's time is the slowest rank's, counted from the
stop. Trials of each kind alternate in interleaved rounds; ``--against REV`` runs
another revision's engine in the same rounds.

    python bench/liveness.py [--rounds 5] [--against REV] [--out liveness]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

from common import Checkout, write_results

WORLD, VICTIM = 4, 2
KINDS = ("kill", "stop")

RANK = r"""
import json, os, signal, sys, time, numpy as np, fpgaccl.host
from fpgaccl.errors import CollectiveTimeoutError
victim, how, stamp = int(sys.argv[1]), sys.argv[2], sys.argv[3]
comm = fpgaccl.host.init()
x = np.ones(1 << 18, np.float32)
comm.allreduce(x.copy())
comm.barrier()
out = {"rank": comm.rank}
stop_at = time.monotonic() + 0.2
try:
    while True:
        if comm.rank == victim and time.monotonic() >= stop_at:
            comm.allreduce(x.copy(), async_op=True)
            time.sleep(0.005)
            with open(stamp, "w") as f:
                f.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        comm.allreduce(x.copy())
except CollectiveTimeoutError as e:
    out.update(at=time.time(), error=type(e).__name__, peer=getattr(e, "peer", None),
               why=str(e))
print(json.dumps(out), flush=True)
os._exit(0)
"""


def _reason(why: str) -> str:
    if "port unreachable" in why:
        return "port unreachable"
    if "found it dead" in why:
        return "notice"
    if "unACKed" in why or "probe unanswered" in why:
        return "peer timeout"
    if "retransmissions" in why:
        return "retry limit"
    return "other"


def trial(kind: str, pythonpath: str | None) -> dict:
    from fpgaccl.host.launcher import free_port, rank_env
    from fpgaccl.host.rendezvous import SECRET_ENV

    stamp = Path(tempfile.gettempdir()) / f"liveness-{uuid.uuid4().hex}"
    port = free_port()
    extra = {SECRET_ENV: uuid.uuid4().hex}
    if pythonpath:
        extra["PYTHONPATH"] = pythonpath
    procs = [subprocess.Popen([sys.executable, "-c", RANK, str(VICTIM), kind, str(stamp)],
                              env=rank_env(r, WORLD, port, extra), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(WORLD)]
    try:
        res = {}
        for r, p in enumerate(procs):
            if r == VICTIM:
                continue
            out, err = p.communicate(timeout=60)
            if p.returncode or not out.strip():
                raise RuntimeError(f"rank {r} failed: {err[-2000:]}")
            res[r] = json.loads(out.strip().splitlines()[-1])
        stopped_at = float(stamp.read_text())
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()  # the stopped rank too: SIGKILL ends a stopped process
                p.wait()
        stamp.unlink(missing_ok=True)
    lat = {r: v["at"] - stopped_at for r, v in res.items() if "at" in v}
    return {
        "kind": kind,
        "time_s": max(lat.values()) if len(lat) == WORLD - 1 else None,
        "per_rank_s": lat,
        "named_victim": sum(v.get("peer") == VICTIM for v in res.values()),
        "reasons": [_reason(v.get("why", "")) for v in res.values()],
        "errors": sorted({v.get("error", "completed") for v in res.values()}),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--against", default="", metavar="REV")
    ap.add_argument("--out", default="liveness")
    args = ap.parse_args()
    other = Checkout(args.against) if args.against else None
    variants = [("this tree", None)] + ([(args.against, other.path)] if other else [])
    rows = []
    load = os.getloadavg()
    try:
        for rnd in range(args.rounds):
            for kind in KINDS:
                for name, path in variants:
                    t = trial(kind, path)
                    t.update(variant=name, round=rnd)
                    rows.append(t)
                    took = f"{t['time_s']:.3f} s" if t["time_s"] is not None else "-"
                    print(f"round {rnd} {name:10s} {kind:5s} {took:>9s}  named rank "
                          f"{VICTIM} on {t['named_victim']} of {WORLD - 1}: "
                          f"{', '.join(t['reasons'])}", flush=True)
    finally:
        if other:
            other.close()
    table = []
    for name, _ in variants:
        for kind in KINDS:
            ts = [r for r in rows if r["variant"] == name and r["kind"] == kind]
            times = [r["time_s"] for r in ts if r["time_s"] is not None]
            reasons: dict[str, int] = {}
            for r in ts:
                for why in r["reasons"]:
                    reasons[why] = reasons.get(why, 0) + 1
            table.append({
                "variant": name, "kind": kind, "trials": len(ts),
                "median_s": statistics.median(times) if times else None,
                "max_s": max(times) if times else None,
                "named_victim": sum(r["named_victim"] for r in ts),
                "ranks": len(ts) * (WORLD - 1), "reasons": reasons,
            })
    print(f"\n{WORLD} ranks on loopback, rank {VICTIM} stopped mid-call, default liveness "
          f"(peer timeout 1.25 s); load at start {load[0]:.2f} (2 cores)")
    print(f"{'variant':10s} {'kind':5s} {'median s':>9s} {'max s':>7s} {'named':>7s}  reasons")
    for t in table:
        med = f"{t['median_s']:.3f}" if t["median_s"] is not None else "-"
        mx = f"{t['max_s']:.3f}" if t["max_s"] is not None else "-"
        print(f"{t['variant']:10s} {t['kind']:5s} {med:>9s} {mx:>7s} "
              f"{t['named_victim']:>3d}/{t['ranks']:<3d}  {t['reasons']}")
    path = write_results(args.out, {"table": table, "trials": rows}, world=WORLD,
                         victim=VICTIM, load_at_start=load)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
