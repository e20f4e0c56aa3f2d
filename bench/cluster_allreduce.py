"""Collectives on the simulated four-node cluster (the whole HDL node on Verilator, the
hardware switch between them): bus bandwidth in bytes per cycle against the link limit
(issue 6), and simulation speed in node-cycles and reduced bytes per wall second
(issue 8), and per CPU second of the simulation process (on a shared machine the wall
figures include other people's load). Prints a table and writes
bench/results/cluster_allreduce.json.

    .venv/bin/python bench/cluster_allreduce.py [--bytes 1048576] [--clock-mhz 250]
        [--pieces 4] [--shared-memory]
        [--impair loss=1311,reorder=655,dup=655,corrupt=655] [--waves]

Each run also prints the run summary read from the hardware (cycles, packets,
retransmits, drops by reason) and stores it. The JSON keeps the previous run's speed
under ``previous`` so a change to the simulation's speed shows as before/after.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import tempfile
import time
from pathlib import Path

from common import RESULTS, write_results

from fpgaccl.sim.hdl.cluster import build_standard
from fpgaccl.sim.hdl.link import LINK_REGS
from fpgaccl.sim.runner import run, waves_file
from fpgaccl.sim.tb.cluster_tb import format_summary


def impairments(text: str) -> dict[str, int]:
    out = {}
    for item in filter(None, text.split(",")):
        name, _, value = item.partition("=")
        if name not in LINK_REGS or not value:
            raise SystemExit(f"--impair: {item!r} is not NAME=VALUE with NAME in "
                             f"{', '.join(LINK_REGS)}")
        out[name] = int(value, 0)
    return out


def previous_speed(path: Path) -> dict | None:
    """The speed the stored results recorded, before this run replaces them."""
    if not path.exists():
        return None
    old = json.loads(path.read_text())
    return {"git_rev": old.get("git_rev"), "date": old.get("date"),
            "rows": [{k: r.get(k) for k in ("collective", "bytes", "cycles", "wall_s",
                                            "node_cycles_per_s", "reduced_bytes_per_wall_s",
                                            "node_cycles_per_cpu_s")}
                     for r in old.get("results", [])]}


def print_timeline(name: str, samples: list[list[int]]) -> None:
    """Per sampling interval, each node's link utilisation (beats / cycles)."""
    print(f"# {name}: link utilisation per interval (node 0 .. node {len(samples[0]) - 2})")
    for a, b in itertools.pairwise(samples):
        span = b[0] - a[0]
        util = " ".join(f"{(y - x) / span:5.2f}" for x, y in zip(a[1:], b[1:], strict=True))
        print(f"  {a[0] - samples[0][0]:>9} +{span:<6} {util}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bytes", type=int, default=1 << 20, help="float32 bytes per rank")
    ap.add_argument("--clock-mhz", type=float, default=250.0)
    ap.add_argument("--cases", nargs="+", default=["ring_allreduce", "rhd_allreduce"])
    ap.add_argument("--impair", type=impairments, default={},
                    help="link impairments for every link, e.g. loss=1311,reorder=655 "
                         "(probabilities in 1/65536, latency in cycles, rate in 1/65536 "
                         "beats per cycle)")
    ap.add_argument("--pieces", type=int, default=4,
                    help="messages per ring step (ring_allreduce's pipelining)")
    ap.add_argument("--shared-memory", action="store_true",
                    help="nodes on one shared memory port instead of a channel per "
                         "datapath master (a separate build)")
    ap.add_argument("--probe", type=int, default=0, metavar="CYCLES",
                    help="sample every link's beat count every CYCLES cycles and print "
                         "each node's link utilisation over time")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--waves", action="store_true", help="trace (FST or VCD) to the run "
                    "folder; also FPGACCL_WAVES=1")
    ap.add_argument("--no-save", action="store_true", help="print only, keep the JSON")
    args = ap.parse_args()
    load = os.getloadavg()
    t0 = time.perf_counter()
    sim, params = build_standard(waves=args.waves or None,
                                 split_memory=not args.shared_memory)
    build_s = time.perf_counter() - t0
    nodes, width = params["nodes"], params["width"]
    test_dir = sim.build_dir / "run_bench"
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        t0 = time.perf_counter()
        run(sim, "fpgaccl.sim.benches.cluster", test_dir=test_dir,
            params={**params, "count": args.bytes // 4, "cases": args.cases,
                    "report": str(report), "float_only": True, "impair": args.impair,
                    "seed": args.seed, "pieces": args.pieces, "probe": args.probe})
        total_s = time.perf_counter() - t0
        got = json.loads(report.read_text())
    rows, summary = got["rows"], got["summary"]
    link = width // 8  # bytes per cycle on one link
    memory = "one shared port" if args.shared_memory else "a channel per master"
    print(f"# {nodes} simulated nodes, {width}-bit links ({link} B/cycle), memory: "
          f"{memory}, ring pieces {args.pieces}, clock {args.clock_mhz:g} MHz for the "
          f"time columns")
    print(f"{'collective':<16} {'size (B)':>10} {'type':>8} {'cycles':>9} {'time(us)':>9} "
          f"{'busbw B/cyc':>11} {'of link':>8} {'busbw GB/s':>10} {'cyc/s':>9} "
          f"{'node-cyc/s':>10} {'red. B/s':>10} {'ncyc/cpu-s':>10}")
    out = []
    for r in rows:
        factor = 2 * (nodes - 1) / nodes  # nccl-tests' allreduce busbw factor
        busbw = factor * r["bytes"] / r["cycles"]
        time_us = r["cycles"] / args.clock_mhz
        cps = r["cycles"] / r["wall_s"]
        reduced = r["bytes"] * nodes / r["wall_s"]
        cpu_cps = r["cycles"] / r["cpu_s"]
        row = {**r, "busbw_bytes_per_cycle": busbw, "link_bytes_per_cycle": link,
               "fraction_of_link": busbw / link, "time_us_at_clock": time_us,
               "busbw_gbps_at_clock": busbw * args.clock_mhz * 1e6 / 1e9,
               "sim_cycles_per_s": cps, "node_cycles_per_s": cps * nodes,
               "reduced_bytes_per_wall_s": reduced,
               "node_cycles_per_cpu_s": cpu_cps * nodes,
               "reduced_bytes_per_cpu_s": r["bytes"] * nodes / r["cpu_s"]}
        out.append(row)
        print(f"{r['collective']:<16} {r['bytes']:>10} {r['dtype']:>8} {r['cycles']:>9} "
              f"{time_us:>9.1f} {busbw:>11.3f} {busbw / link:>8.1%} "
              f"{row['busbw_gbps_at_clock']:>10.3f} {cps:>9.0f} {cps * nodes:>10.0f} "
              f"{reduced:>10.3g} {cpu_cps * nodes:>10.0f}")
    print(format_summary(summary))
    for r in rows:
        if r.get("link_beats"):
            print_timeline(r["collective"], r["link_beats"])
    print(f"# simulation process {total_s:.1f} s (of which the collectives "
          f"{sum(r['wall_s'] for r in rows):.1f} s), build/cache check {build_s:.1f} s, "
          f"load average {load[0]:.2f} on {os.cpu_count()} cores")
    if sim.waves:
        print(f"# waves: {waves_file(test_dir)}")
    if args.no_save:
        return
    path = RESULTS / "cluster_allreduce.json"
    previous = previous_speed(path)
    path = write_results("cluster_allreduce", out, clock_mhz=args.clock_mhz, nodes=nodes,
                         width=width, impairments=args.impair, summary=summary,
                         memory="shared" if args.shared_memory else "split",
                         pieces=args.pieces,
                         process_s=total_s, build_s=build_s, load_average=load,
                         previous=previous)
    print(f"# wrote {path}")


if __name__ == "__main__":
    main()
