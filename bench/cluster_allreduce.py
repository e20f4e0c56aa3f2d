"""Collectives on the simulated four-node cluster (the whole HDL node on Verilator, the
hardware switch between them): bus bandwidth in bytes per cycle against the link limit
(issue 6), and simulation speed in node-cycles and reduced bytes per wall second
(issue 8). Prints a table and writes bench/results/cluster_allreduce.json.

    .venv/bin/python bench/cluster_allreduce.py [--bytes 1048576] [--clock-mhz 250]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from common import write_results

from fpgaccl.sim.hdl.cluster import build_standard
from fpgaccl.sim.runner import run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bytes", type=int, default=1 << 20, help="float32 bytes per rank")
    ap.add_argument("--clock-mhz", type=float, default=250.0)
    ap.add_argument("--cases", nargs="+", default=["ring_allreduce", "rhd_allreduce"])
    args = ap.parse_args()
    sim, params = build_standard()
    nodes, width = params["nodes"], params["width"]
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        run(sim, "fpgaccl.sim.benches.cluster", test_dir=sim.build_dir / "run_bench",
            params={**params, "count": args.bytes // 4, "cases": args.cases,
                    "report": str(report), "float_only": True})
        rows = json.loads(report.read_text())
    link = width // 8  # bytes per cycle on one link
    print(f"# {nodes} simulated nodes, {width}-bit links ({link} B/cycle), "
          f"clock {args.clock_mhz:g} MHz for the time columns")
    print(f"{'collective':<16} {'size (B)':>10} {'type':>8} {'cycles':>9} {'time(us)':>9} "
          f"{'busbw B/cyc':>11} {'of link':>8} {'busbw GB/s':>10} {'cyc/s':>9} "
          f"{'node-cyc/s':>10} {'red. B/s':>10}")
    out = []
    for r in rows:
        factor = 2 * (nodes - 1) / nodes  # nccl-tests' allreduce busbw factor
        busbw = factor * r["bytes"] / r["cycles"]
        time_us = r["cycles"] / args.clock_mhz
        cps = r["cycles"] / r["wall_s"]
        reduced = r["bytes"] * nodes / r["wall_s"]
        row = {**r, "busbw_bytes_per_cycle": busbw, "link_bytes_per_cycle": link,
               "fraction_of_link": busbw / link, "time_us_at_clock": time_us,
               "busbw_gbps_at_clock": busbw * args.clock_mhz * 1e6 / 1e9,
               "sim_cycles_per_s": cps, "node_cycles_per_s": cps * nodes,
               "reduced_bytes_per_wall_s": reduced}
        out.append(row)
        print(f"{r['collective']:<16} {r['bytes']:>10} {r['dtype']:>8} {r['cycles']:>9} "
              f"{time_us:>9.1f} {busbw:>11.3f} {busbw / link:>8.1%} "
              f"{row['busbw_gbps_at_clock']:>10.3f} {cps:>9.0f} {cps * nodes:>10.0f} "
              f"{reduced:>10.3g}")
    path = write_results("cluster_allreduce", out, clock_mhz=args.clock_mhz, nodes=nodes,
                         width=width)
    print(f"# wrote {path}")


if __name__ == "__main__":
    main()
