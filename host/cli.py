"""The ``fpgaccl`` command line: one entry point, one subcommand per job."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fpgaccl", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="build RoCEv2 packets, write a pcap, decode it with tshark")
    demo.add_argument("--pcap", default="build/demo.pcap", help="where to write the capture")
    args, rest = parser.parse_known_args(argv)
    if args.command == "demo":
        from .demo import run_demo
        return run_demo(args.pcap)
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
