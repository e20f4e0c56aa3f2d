"""GPU-initiated allreduce latency through DmaNode: from the GPU kernel's doorbell store
(the SQ tail written through the peer window) to the first frame on the wire, for a
2-rank ring allreduce of GPU buffers on two Verilator-built DmaNodes back to back.

Milestones per rank, in cycles after the doorbell's CSR write: the SQ entry fetch (AR
to GPU memory), the program's first data read (AR into IN: the set-up COPY), the first
frame leaving the node (first beat handshaken on tx; the ring program's first frame is
its GRANT, a zero-length RDMA WRITE with immediate), the first SEND's read of its
source (AR into OUT, which only SENDs read), the next frame out after that read (the
first data frame unless an ACK went first: the top only marks frame starts), and the
completion flag seen by the polling GPU kernel. Memory models: host 100/40 cycles
read/write latency, GPU 60/30. Prints a table and writes bench/results/dma_node_latency.json.
    .venv/bin/python bench/dma_node_latency.py [--count 256]
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

from fpgaccl.sim.runner import build, run
from fpgaccl.sim.tb.dma_node_top import PARAMS, DmaNodePair

REPO = Path(__file__).resolve().parent.parent


def git_rev() -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                             capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "hw", "sim/benches",
                                "sim/tb", "sim/models", "proto"], cwd=REPO, capture_output=True,
                               text=True).stdout
        return rev + ("-dirty" if dirty.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--count", type=int, default=256, help="int32 elements per rank")
    ap.add_argument("--out", type=Path, default=REPO / "bench/results/dma_node_latency.json")
    args = ap.parse_args(argv)
    width = 64
    t0 = time.monotonic()
    sim = build(DmaNodePair(width), f"dma_node_pair_w{width}")
    t_build = time.monotonic() - t0
    with tempfile.TemporaryDirectory() as tmp:
        res = Path(tmp) / "lat.json"
        run(sim, "fpgaccl.sim.benches.dma_node", testcase="gpu_initiated_allreduce",
            params={"width": width, "count": args.count, "out": str(res)},
            test_dir=Path(tmp) / "run")
        data = json.loads(res.read_text())
    t_total = time.monotonic() - t0
    rows = data["rows"]
    print(f"GPU-initiated ring allreduce, 2 DmaNodes back to back, {width}-bit, "
          f"{data['count']} x int32 ({data['bytes']} B) per rank, GPU buffers; "
          "cycles after the doorbell write")
    cols = {"rank": "rank", "to_sq_fetch": "SQ fetch", "to_first_data_read": "1st data rd",
            "to_first_frame": "1st frame", "to_first_send_read": "SEND src rd",
            "to_next_frame_after_send_read": "frame after", "to_flag_seen": "flag seen",
            "frames_sent": "frames"}
    print(" ".join(f"{h:>12}" for h in cols.values()))
    for r in rows:
        print(" ".join(f"{r[c]:>12}" for c in cols))
    out = {
        "bench": "dma_node_latency",
        "command": " ".join([f"bench/{Path(sys.argv[0]).name}", *sys.argv[1:]]),
        "git_rev": git_rev(),
        "machine": f"{platform.node()} {platform.machine()} {platform.processor()}".strip(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "params": {"width": width, "world": data["world"], "count": data["count"],
                   "dtype": data["dtype"], "bytes_per_rank": data["bytes"],
                   "node": PARAMS, "host_latency_rd_wr": [100, 40],
                   "gpu_latency_rd_wr": [60, 30], "sq_space": "gpu", "buffers": "gpu"},
        "rows": rows,
        "doorbell_to_first_frame_cycles": max(r["to_first_frame"] for r in rows),
        "doorbell_to_first_send_read_cycles": max(r["to_first_send_read"] for r in rows),
        "wall_s": {"build": round(t_build, 1), "total": round(t_total, 1)},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out.relative_to(REPO) if args.out.is_relative_to(REPO) else args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
