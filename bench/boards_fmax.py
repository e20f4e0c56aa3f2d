"""Open-flow build of a board (default: ECPIX-5 85F with the full 64-bit node,
int32+float32 reduction): utilisation, Fmax per clock against its target, and the
critical path, from nextpnr's report. Prints the table and writes
bench/results/boards_fmax.json.

    .venv/bin/python bench/boards_fmax.py [--board ecpix5-85] [--width 64] [--qps 8]

What is built on the ECP5 boards is the full fpgaccl.hw.node.Node (parser, builder,
transport, sequencer, router, copy/reduce engines, CSR bank) with its reduction unit
built for the config's dtypes x ops, its memory port on block RAM; on the iCE40 the
reduced EngineCore (see fpgaccl.boards.top). The numbers are nextpnr's post-route
timing for the board's speed grade.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

from fpgaccl.boards.build import build
from fpgaccl.boards.platforms import BOARDS

REPO = Path(__file__).resolve().parent.parent
TARGET_MHZ = 100.0   # issue 9: 64-bit beats at 100 MHz = 6.4 Gb/s
LOAD: dict[str, list[float]] = {}
DEPTH_NOTE = ("worst register-to-register path ending in each block, unplaced, with a "
              "flat 0.75 ns per net; nextpnr's figures above are the ones of record")
ROUTED_NOTE = ("nextpnr's post-route arrival at each register input, the worst per block; "
               "'failing' counts the inputs later than the 10 ns target")


def logic_depth(folder: Path, rows: int = 12) -> tuple[str, list[dict]]:
    """The per-block logic-depth estimate of yosys' ECP5 netlist (fpgaccl.boards.depth):
    which blocks are too deep for the clock, by name, next to nextpnr's single path."""
    from fpgaccl.boards.depth import analyse, table
    paths = analyse(folder / "top.json")
    return table(paths, rows), [
        {"block": p.block, "est_ns": round(p.ns, 1), "est_mhz": round(p.mhz, 1),
         "lut_levels": p.levels, "endpoint": p.endpoint, "via": p.via}
        for p in paths[:rows]]


def routed_blocks(folder: Path, rows: int = 15) -> tuple[str, list[dict]]:
    """nextpnr's routed arrival at every register input (fpgaccl.boards.slack), worst
    per block: every block that misses the target, not only the one critical path."""
    from fpgaccl.boards.slack import as_rows, by_block, endpoints, table
    period = 1000.0 / TARGET_MHZ
    try:
        blocks = by_block(endpoints(folder), period)
    except ValueError as e:             # a build from before the detailed report
        return str(e), []
    return table(blocks, period, rows), as_rows(blocks, period, rows)


def git_rev() -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                             capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "boards", "hw",
                                "proto"], cwd=REPO, capture_output=True, text=True).stdout
        return rev + ("-dirty" if dirty.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--board", default="ecpix5-85", choices=sorted(BOARDS))
    ap.add_argument("--width", type=int, default=None)
    ap.add_argument("--qps", type=int, default=None)
    ap.add_argument("--no-cache", action="store_true")
    ap.add_argument("--out", type=Path, default=REPO / "bench/results/boards_fmax.json")
    ap.add_argument("--partial", type=Path, default=None, metavar="BUILD_FOLDER",
                    help="record what nextpnr's log says of a build still running (or "
                         "killed): utilisation and the post-placement Fmax estimate")
    ap.add_argument("--depth", type=Path, default=None, metavar="BUILD_FOLDER",
                    help="record only the logic-depth estimate of a build folder's yosys "
                         "netlist (top.json), for a design not (yet) placed")
    ap.add_argument("--rev", default=None,
                    help="the commit the build folder was made from, when it is not the "
                         "checkout's HEAD (default: HEAD, '-dirty' if hw/boards/proto "
                         "have changes)")
    args = ap.parse_args(argv)
    LOAD["start"] = [round(x, 2) for x in os.getloadavg()]
    if args.partial:
        return partial(args)
    if args.depth:
        return depth_only(args)

    board = BOARDS[args.board]
    if not board.open_flow:
        ap.error(f"{args.board} uses Vivado; this bench runs the open flow only")
    changes = {k: v for k, v in (("width", args.width), ("qps", args.qps)) if v is not None}
    config = board.config.replace(**changes)
    result = build(args.board, config, use_cache=not args.no_cache, log=print)
    rep = result.report

    print(f"\n{board.name}: {config.describe()}")
    print(f"bitstream {result.bitstream.stat().st_size} bytes, "
          f"{'cached' if result.cached else f'built in {result.seconds:.0f} s'}\n")
    print(rep.table())
    # The 100 MHz is for the ECP5 node; other boards are held to their clock.
    ecp5 = "NEXTPNR_ECP5" in board.tools
    verdict = []
    for c in rep.clocks:
        # The node's 100 MHz, or the clock's own constraint where higher (RGMII 125 MHz).
        target = max(TARGET_MHZ, c.target_mhz) if ecp5 else c.target_mhz
        verdict.append(f"{c.name}: {c.achieved_mhz:.1f} MHz vs target {target:.0f} MHz -> "
                       f"{'met' if c.achieved_mhz >= target else 'NOT met'}")
    print("\n" + "\n".join(verdict))
    depth_rows: list[dict] = []
    routed_rows: list[dict] = []
    if ecp5:
        text, depth_rows = logic_depth(result.folder)
        print(f"\nlogic depth per block (estimate from the netlist, {DEPTH_NOTE}):\n{text}")
        text, routed_rows = routed_blocks(result.folder)
        print(f"\nrouted, per block ({ROUTED_NOTE}):\n{text}")

    write_record(args.out, git_rev(), {
        "target_mhz": TARGET_MHZ if ecp5 else None,
        "verdict": verdict,
        "build": result.summary(),
        "logic_depth": {"note": DEPTH_NOTE, "blocks": depth_rows} if depth_rows else None,
        "routed_blocks": ({"note": ROUTED_NOTE, "blocks": routed_rows}
                          if routed_rows else None),
    })
    return 0


def depth_only(args) -> int:
    text, depth_rows = logic_depth(args.depth, rows=30)
    note = ("ESTIMATE ONLY: logic depth of yosys' netlist, not placed or routed; "
            "nextpnr's Fmax is the number of record")
    depth_note = DEPTH_NOTE.split(";")[0]
    print(f"{args.depth}\n{note}\n\nlogic depth per block ({depth_note}):\n{text}")
    write_record(args.out, args.rev or git_rev(), {
        "status": note, "target_mhz": TARGET_MHZ, "build_folder": str(args.depth),
        "logic_depth": {"note": depth_note, "blocks": depth_rows},
    })
    return 0


def partial(args) -> int:
    from fpgaccl.boards.report import parse_log
    rep = parse_log(args.partial)
    note = ("INCOMPLETE: routing had not finished; Fmax is nextpnr's post-placement "
            "estimate, utilisation is after packing")
    print(f"{args.partial}\n{note}\n\n{rep.table()}")
    verdict = [f"{c.name}: {c.achieved_mhz:.1f} MHz (estimate) vs target "
               f"{max(TARGET_MHZ, c.target_mhz):.0f} MHz -> "
               f"{'met' if c.achieved_mhz >= max(TARGET_MHZ, c.target_mhz) else 'NOT met'}"
               for c in rep.clocks]
    print("\n" + "\n".join(verdict))
    depth_rows: list[dict] = []
    if (args.partial / "top.json").exists():
        text, depth_rows = logic_depth(args.partial)
        print(f"\nlogic depth per block (estimate from the netlist, {DEPTH_NOTE}):\n{text}")
    # How far the router got: its last progress line (router2: overused wires left;
    # router1: a table row whose 'remaining arcs' column is the measure).
    tim = (args.partial / "top.tim").read_text()
    routing = [ln.removeprefix("Info:").strip() for ln in tim.splitlines()
               if re.match(r"Info:\s+iter=\d+ ", ln) or re.match(r"Info:\s+\d+ \|", ln)
               or "Routing globals" in ln]
    if routing:
        print(f"\nrouter: {routing[-1]}")
    record = {
        "status": note, "target_mhz": TARGET_MHZ, "verdict": verdict,
        "build_folder": str(args.partial), "report": rep.as_dict(),
        "router_last": routing[-1] if routing else None,
        "analysis": "boards/README.md, 'ECP5-85F timing: what limits Fmax'",
        "logic_depth": {"note": DEPTH_NOTE, "blocks": depth_rows} if depth_rows else None,
    }
    write_record(args.out, args.rev or git_rev(), record)
    return 0


def write_record(out: Path, rev: str, fields: dict) -> None:
    """The JSON record: what ran, where and when, then the mode's own ``fields``."""
    record = {
        "bench": "boards_fmax",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "git": rev,
        "machine": {"node": platform.node(), "cpus": os.cpu_count(),
                    "python": platform.python_version(), "system": platform.platform()},
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        # 1/5/15-minute load averages when the bench started and when it wrote this:
        # the machine is shared, and a loaded one builds slower (not a different Fmax).
        "load": {**LOAD, "end": [round(x, 2) for x in os.getloadavg()]},
        **fields,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    sys.exit(main())
