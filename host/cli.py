"""The ``fpgaccl`` command line: one entry point, one subcommand per job."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # Everything after "--" belongs to the launched command, not to us.
    rest: list[str] = []
    if "--" in argv:
        k = argv.index("--")
        argv, rest = argv[:k], argv[k + 1:]
    parser = argparse.ArgumentParser(prog="fpgaccl", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="build RoCEv2 packets, write a pcap, decode it with tshark")
    demo.add_argument("--pcap", default="build/demo.pcap", help="where to write the capture")

    run = sub.add_parser("run", help="start N local ranks of a command: fpgaccl run -n 4 -- cmd")
    run.add_argument("-n", "--nprocs", type=int, required=True, help="number of ranks")
    run.add_argument("--pcap", default=None, help="write all RoCEv2 traffic to this pcap")
    run.add_argument("--impair", default=None,
                     help="lossy link for testing, e.g. loss=0.05,dup=0.02,reorder=0.05,delay=0.01 "
                     "(delay in seconds each way; lag=0.002 holds a reordered datagram back "
                     "that long instead of until the next one)")
    run.add_argument("--deadline", type=float, default=None,
                     help="seconds a collective may wait without progress before it raises "
                     "CollectiveTimeoutError")
    run.add_argument("--timeout", type=float, default=None, help="kill the run after this long")
    run.add_argument("--grace", type=float, default=None, metavar="SECONDS",
                     help="after SIGTERM/SIGHUP/SIGINT to the launcher, seconds the ranks "
                          "have to exit before SIGKILL (default 5)")
    run.add_argument("--backend", choices=("software", "sim", "board"), default="software",
                     help="sim: each rank drives a node of the Verilator-simulated cluster; "
                          "board: each rank drives an engine of the board FPGACCL_BOARD "
                          "names (else a simulated board) through its queues")
    run.add_argument("--waves", action="store_true",
                     help="with --backend sim: dump waveforms (a separate traced build)")
    run.add_argument("--sim-loss", type=float, default=0.0,
                     help="with --backend sim: fraction of frames the simulated switch drops")
    run.add_argument("--sim-ranks", default=None, metavar="LIST",
                     help="a mixed run: these ranks (e.g. 2,3) drive simulated HDL nodes, the "
                          "others run the software backend, bridged over UDP")
    run.add_argument("--bridge-loss", type=float, default=0.0,
                     help="with --sim-ranks: fraction of bridged frames dropped (seeded)")
    run.add_argument("--bridge-pcap", default=None,
                     help="with --sim-ranks: write every bridged frame to this pcap")
    run.add_argument("--tap", default=None, metavar="IFNAME",
                     help="with --sim-ranks, as root: mirror the bridged frames to a TAP "
                          "interface, for tshark/tcpdump -i IFNAME")
    run.add_argument("cmd", nargs="*", help=argparse.SUPPRESS)

    from .bench import add_arguments
    bench = sub.add_parser("bench", help="nccl-tests style benchmark over local ranks")
    add_arguments(bench)

    ard = sub.add_parser("allreduce-demo",
                         help="4-rank allreduce on the software backend, checked against numpy")
    ard.add_argument("-g", "--ranks", type=int, default=4)
    ard.add_argument("-e", "--maxbytes", default="16M")
    ard.add_argument("--json", default=None)

    node = sub.add_parser("node", help="as root: one simulated node (ARP, ping, control port, "
                          "RoCE engine) on a TAP interface, until SIGTERM/SIGINT")
    node.add_argument("--tap", required=True, metavar="IFNAME", help="the TAP to create")
    node.add_argument("--ip", required=True, metavar="ADDR",
                      help="the node's IPv4 address; the kernel's side gets one in its /24")
    node.add_argument("--netns", default=None, metavar="NAME",
                      help="put the TAP in this network namespace (created, and removed "
                           "at exit, if missing)")
    node.add_argument("--mac", default=None, help="the node's MAC (default 02:fc:cc:00:00:01)")
    node.add_argument("--bridge", default=None, metavar="BR",
                      help="join the TAP to this Linux bridge (created with the kernel's "
                           "address if missing) instead of giving the TAP an address: "
                           "several nodes and the host's ranks then share one link")

    from .build_cli import add_build_subcommand, add_flash_subcommand
    add_build_subcommand(sub)
    add_flash_subcommand(sub)

    args = parser.parse_args(argv)
    if args.command == "build":
        return args.build_handler(args)
    if args.command == "flash":
        return args.flash_handler(args)
    if args.command == "demo":
        from .demo import run_demo
        return run_demo(args.pcap)
    if args.command == "run":
        from .launcher import run as launch
        return launch(args.nprocs, list(args.cmd) + rest, pcap=args.pcap, impair=args.impair,
                      deadline_s=args.deadline, timeout_s=args.timeout,
                      backend=args.backend, waves=args.waves, sim_loss=args.sim_loss,
                      sim_ranks=_ranks(args.sim_ranks, parser), bridge_loss=args.bridge_loss,
                      bridge_pcap=args.bridge_pcap, tap=args.tap,
                      **({"grace_s": args.grace} if args.grace is not None else {}))
    if args.command == "node":
        from fpgaccl.sim.tap import DEFAULT_MAC, run_node
        return run_node(args.tap, args.ip, netns=args.netns, mac=args.mac or DEFAULT_MAC,
                        bridge=args.bridge)
    if args.command == "bench":
        from .bench import main as bench_main
        return bench_main(args)
    if args.command == "allreduce-demo":
        from .bench import main as bench_main
        bargs = parser.parse_args(["bench", "allreduce", "-g", str(args.ranks), "-b", "8",
                                   "-e", args.maxbytes, "-f", "4", "-n", "5", "-w", "1",
                                   "-c", "1"] + (["--json", args.json] if args.json else []))
        return bench_main(bargs)
    parser.error(f"unknown command {args.command}")
    return 2


def _ranks(text: str | None, parser: argparse.ArgumentParser) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        parser.error(f"--sim-ranks {text!r}: a comma-separated list of ranks, e.g. 2,3")
        return None


if __name__ == "__main__":
    sys.exit(main())
