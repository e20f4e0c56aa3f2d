"""DMA read/write throughput vs outstanding bursts, and doorbell-to-first-read latency.

512-bit bus, 4 KiB bursts, 200-cycle memory latency (issue 7's target: >= 0.9 beats per
cycle with enough outstanding requests; this reports how many that takes). The
Verilator-built DMA subsystem runs COPYs submitted through its SQ; read throughput is a
host -> GPU copy with the host slow and the GPU side fast, write throughput the reverse
with the host's write responses slow. Beats/cycle counts the data beats on the slow
port from its first to its last beat. Prints a table and writes
bench/results/dma_throughput.json (command, git revision, machine, date, numbers).

    .venv/bin/python bench/dma_throughput.py [--width 512] [--latency 200] [--kib 256]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fpgaccl.hw.dma.burst import burst_bytes
from fpgaccl.hw.dma.subsystem import DmaSubsystem
from fpgaccl.sim.runner import build, run

REPO = Path(__file__).resolve().parent.parent
TARGET = 0.9


def git_rev() -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                             capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "hw/dma",
                                "sim/benches", "sim/tb", "sim/models"], cwd=REPO,
                               capture_output=True, text=True).stdout
        return rev + ("-dirty" if dirty.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--latency", type=int, default=200)
    ap.add_argument("--kib", type=int, default=256, help="bytes per copy, KiB")
    ap.add_argument("--outstanding", default="1,2,3,4,5,6,8,16")
    ap.add_argument("--out", type=Path, default=REPO / "bench/results/dma_throughput.json")
    args = ap.parse_args(argv)
    outstanding = [int(x) for x in args.outstanding.split(",")]

    t0 = time.monotonic()
    sim = build(DmaSubsystem(args.width), f"dma_subsystem_w{args.width}")
    t_build = time.monotonic() - t0
    with tempfile.TemporaryDirectory() as tmp:
        res = Path(tmp) / "dma.json"
        run(sim, "fpgaccl.sim.benches.dma_perf", params={
            "width": args.width, "latency": args.latency, "bytes": args.kib * 1024,
            "outstanding": outstanding, "out": str(res)})
        data = json.loads(res.read_text())
    t_total = time.monotonic() - t0

    rows = data["rows"]
    need = {d: next((r["outstanding"] for r in rows
                     if r[d]["beats_per_cycle"] >= TARGET), None) for d in ("read", "write")}
    burst = burst_bytes(args.width)
    print(f"DMA at {args.width} bits, {burst} B bursts, {args.latency}-cycle memory "
          f"latency, {args.kib} KiB per copy")
    print(f"{'outstanding':>11} {'read b/c':>9} {'write b/c':>10} {'rd cycles':>10} "
          f"{'wr cycles':>10} {'1st rd beat':>12}")
    for r in rows:
        print(f"{r['outstanding']:>11} {r['read']['beats_per_cycle']:>9.3f} "
              f"{r['write']['beats_per_cycle']:>10.3f} {r['read']['cycles']:>10} "
              f"{r['write']['cycles']:>10} {r['read']['first_beat_after_doorbell']:>12}")
    for d in ("read", "write"):
        print(f"{d}: >= {TARGET} beats/cycle from {need[d]} outstanding bursts"
              if need[d] else f"{d}: {TARGET} beats/cycle not reached")
    lat = data["doorbell_to_first_read"]
    print(f"doorbell -> first SQ read (AR handshake): host-memory SQ {lat['host_sq']} cycles, "
          f"GPU-memory SQ (GPU-written doorbell) {lat.get('gpu_sq')} cycles")
    out = {
        "bench": "dma_throughput",
        "command": " ".join([f"bench/{Path(sys.argv[0]).name}", *sys.argv[1:]]),
        "git_rev": git_rev(),
        "machine": f"{platform.node()} {platform.machine()} {platform.processor()}".strip(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "params": {"width": args.width, "burst_bytes": burst, "latency": args.latency,
                   "bytes_per_copy": args.kib * 1024, "target_beats_per_cycle": TARGET},
        "rows": rows,
        "outstanding_needed": need,
        "doorbell_to_first_read_cycles": lat,
        "wall_s": {"build": round(t_build, 1), "total": round(t_total, 1)},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out.relative_to(REPO) if args.out.is_relative_to(REPO) else args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
