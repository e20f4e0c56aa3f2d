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
    _config_args(p)
    p.add_argument("--no-cache", action="store_true", help="rebuild even if cached")
    p.add_argument("--json", type=Path, default=None, help="also write the summary here")
    p.set_defaults(build_handler=run_build)
    return p


def _config_args(p: argparse.ArgumentParser) -> None:
    """The options that pick a board's configuration (and so its bitstream)."""
    p.add_argument("--width", type=int, default=None,
                   help="beat width in bits (default: the board's configuration)")
    p.add_argument("--qps", type=int, default=None, help="queue pairs (default: the board's)")
    p.add_argument("--ip", default=None,
                   help="Ethernet boards: the node's IPv4 address after power-up "
                        "(default 192.168.10.50)")
    p.add_argument("--mac", default=None,
                   help="Ethernet boards: the node's MAC (default 02:fc:cc + the IP's low "
                        "three bytes)")
    p.add_argument("--root", type=Path, default=None,
                   help="build folder root (default: build/boards)")


def _config(args: argparse.Namespace, command: str):
    """The board's configuration with the options' changes; None (after saying why on
    stderr) when they are invalid."""
    from fpgaccl.boards.platforms import BOARDS

    board = BOARDS[args.board]
    changes = {k: getattr(args, k) for k in ("width", "qps", "ip", "mac")
               if getattr(args, k) is not None}
    try:
        return board.config.replace(**changes) if changes else board.config
    except ValueError as e:
        print(f"fpgaccl {command}: {e}", file=sys.stderr)
        return None


def run_build(args: argparse.Namespace) -> int:
    from fpgaccl.boards.build import DEFAULT_ROOT, ToolMissing, build
    from fpgaccl.boards.platforms import BOARDS

    board = BOARDS[args.board]
    config = _config(args, "build")
    if config is None:
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


def add_flash_subcommand(subparsers) -> argparse.ArgumentParser:
    from fpgaccl.boards.flash import TARGETS

    p = subparsers.add_parser(
        "flash", help="program a board with openFPGALoader",
        description="Load a bitstream onto a board over its USB cable with openFPGALoader "
                    "(./fpgaccl flash installs the Debian package openfpgaloader when "
                    "missing). Without --bitstream: the bitstream 'fpgaccl build' made for "
                    "the same board and options. SRAM by default (lost at power-off); "
                    "--write-flash makes it load at every power-up.")
    p.add_argument("--board", required=True, choices=sorted(TARGETS), help="target board")
    p.add_argument("--bitstream", type=Path, default=None, metavar="PATH",
                   help="the file to load (default: this board's build with these options)")
    p.add_argument("--cable", default=None,
                   help="openFPGALoader cable name (default: the board's own, e.g. the "
                        "ECPIX-5's FT2232); 'openFPGALoader --list-cables' lists them")
    p.add_argument("--write-flash", action="store_true",
                   help="write the board's SPI flash instead of the FPGA's SRAM")
    p.add_argument("--dry-run", action="store_true",
                   help="print the openFPGALoader command and stop")
    _config_args(p)
    p.set_defaults(flash_handler=run_flash)
    return p


def run_flash(args: argparse.Namespace) -> int:
    from fpgaccl.boards.build import DEFAULT_ROOT
    from fpgaccl.boards.flash import built_bitstream, check_bitstream, flash, flash_command
    from fpgaccl.errors import FpgacclError

    try:
        if args.bitstream is not None:
            bitstream = check_bitstream(args.bitstream)
        else:
            config = _config(args, "flash")
            if config is None:
                return 2
            bitstream = built_bitstream(args.board, config, args.root or DEFAULT_ROOT)
        cmd = flash_command(args.board, bitstream, cable=args.cable,
                            write_flash=args.write_flash)
        print(" ".join(cmd), flush=True)
        if args.dry_run:
            return 0
        out = flash(args.board, bitstream, cable=args.cable, write_flash=args.write_flash)
    except FpgacclError as e:
        print(f"fpgaccl flash: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    print(out, end="")
    print(f"fpgaccl flash: {bitstream} loaded onto {args.board}"
          f"{' (SPI flash)' if args.write_flash else ''}")
    return 0
