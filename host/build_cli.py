"""``fpgaccl build``: build the node for a board and print its resource/Fmax table.

Wired into :mod:`fpgaccl.host.cli` by :func:`add_build_subcommand`; the handler is set
as the parser's ``build_handler`` default.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path


def add_build_subcommand(subparsers) -> argparse.ArgumentParser:
    from fpgaccl.boards.platforms import BOARDS

    p = subparsers.add_parser(
        "build", help="build the node for a board (open flow via yowasp; Vivado: project only)",
        description="Build the node top for a board. ECP5/iCE40 boards run yosys + nextpnr "
                    "from the yowasp packages and print utilisation and Fmax; the Alveo "
                    "target writes a Vivado project (tcl + Verilog) without running it.")
    p.add_argument("--board", required=True, choices=sorted(BOARDS),
                   help="target board")
    p.add_argument("--width", type=int, default=None,
                   help="beat width in bits (default: the board's configuration)")
    p.add_argument("--qps", type=int, default=None, help="queue pairs (default: the board's)")
    p.add_argument("--root", type=Path, default=None,
                   help="build folder root (default: build/boards)")
    p.add_argument("--no-cache", action="store_true", help="rebuild even if cached")
    p.add_argument("--json", type=Path, default=None, help="also write the summary here")
    p.set_defaults(build_handler=run_build)
    return p


def run_build(args: argparse.Namespace) -> int:
    from fpgaccl.boards.build import DEFAULT_ROOT, ToolMissing, build
    from fpgaccl.boards.platforms import BOARDS

    board = BOARDS[args.board]
    changes = {k: v for k, v in (("width", args.width), ("qps", args.qps)) if v is not None}
    try:
        config = board.config.replace(**changes) if changes else board.config
    except ValueError as e:
        print(f"fpgaccl build: {e}", file=sys.stderr)
        return 2
    try:
        result = build(args.board, config, root=args.root or DEFAULT_ROOT,
                       use_cache=not args.no_cache, log=print)
    except ToolMissing as e:
        print(f"fpgaccl build: {e}", file=sys.stderr)
        return 2
    except subprocess.CalledProcessError as e:
        print(f"fpgaccl build: the toolchain failed; log tail:\n{e.output}", file=sys.stderr)
        return 1

    print(f"board   {board.name}: {config.describe()}")
    print(f"network {board.network}")
    print(f"memory  {board.memory}")
    if not result.ran:
        print(f"\nVivado project written to {result.folder} (top.tcl, top.v, top.xdc, "
              "build_top.sh).\nNOT RUN: there is no Vivado here. On a machine with Vivado: "
              f"cd {result.folder} && vivado -mode batch -source top.tcl")
    else:
        how = "cached" if result.cached else f"built in {result.seconds:.0f} s"
        size = result.bitstream.stat().st_size
        print(f"\nbitstream {result.bitstream} ({size} bytes, {how}; tools "
              + ", ".join(f"{k} {v}" for k, v in result.tools.items()) + ")\n")
        print(result.report.table())
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result.summary(), indent=2) + "\n")
    return 0
