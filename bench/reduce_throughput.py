"""Reduction unit throughput and latency on Verilator.

For every supported dtype x op, streams unstalled beats through the unit at the given
width and reports sustained beats/cycle (output beats over the cycles from first to last
output beat) and the pipeline latency in cycles (first operand beat taken to first
result beat valid). Prints a table and writes bench/results/reduce_throughput.json.

    .venv/bin/python bench/reduce_throughput.py [--width 512] [--beats 256]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

from fpgaccl.hw.reduce.unit import LATENCY
from fpgaccl.sim.runner import run
from fpgaccl.sim.tb.reduce_build import build_reduce_unit

REPO = Path(__file__).resolve().parent.parent


def git_rev() -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                             capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "hw/reduce",
                                "proto/reduce.py", "sim/benches", "sim/tb"], cwd=REPO,
                               capture_output=True, text=True).stdout.strip()
        return rev + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--beats", type=int, default=256)
    ap.add_argument("--out", type=Path, default=REPO / "bench/results/reduce_throughput.json")
    args = ap.parse_args(argv)

    sim = build_reduce_unit(args.width)
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "rows.json"
        run(sim, "fpgaccl.sim.benches.reduce_perf",
            params={"width": args.width, "beats": args.beats, "out": str(raw)})
        rows = json.loads(raw.read_text())

    hdr = f"{'type':>9} {'redop':>5} {'width':>5} {'beats':>6} {'beats/cycle':>11} " \
          f"{'latency':>7} {'#wrong':>6}"
    print(hdr)
    for r in rows:
        print(f"{r['dtype']:>9} {r['op']:>5} {r['width']:>5} {r['beats']:>6} "
              f"{r['beats_per_cycle']:>11.3f} {r['latency_cycles']:>7} {r['wrong']:>6}")
    worst = min(r["beats_per_cycle"] for r in rows)
    print(f"# min beats/cycle {worst:.3f}; pipeline latency {LATENCY} cycles "
          f"(measured {sorted({r['latency_cycles'] for r in rows})})")

    result = {
        "bench": "reduce_throughput",
        "command": " ".join(["python", "bench/reduce_throughput.py",
                             *(argv if argv is not None else sys.argv[1:])]),
        "git_rev": git_rev(),
        "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} cpus, "
                   f"python {platform.python_version()}",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "simulator": "verilator (cocotb)",
        "width": args.width,
        "latency_cycles": LATENCY,
        "min_beats_per_cycle": worst,
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0 if all(r["wrong"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
