"""The ``sim`` backend's simulation server: one Verilator process of the standard cluster
serving the ranks of ``fpgaccl run --backend sim`` over a Unix socket.

``python -m fpgaccl.sim.server --socket PATH [--waves] [--loss N] [--json F]`` builds (or
reuses) the standard cluster, serves it (:class:`fpgaccl.sim.servers.cluster.ClusterServer`
in the simulator) until every rank has connected and left, and prints the run summary on
stderr. :class:`ServerProcess` is how the launcher and the tests start one. ``--waves``
uses a separate build with tracing (minutes the first time) and leaves the waveform in
the run folder it prints: ``dump.fst`` where the lz4 and zlib headers are installed
(Debian: liblz4-dev, zlib1g-dev), else ``dump.vcd`` (much larger: ~8 KB per cycle for
four nodes). ``FPGACCL_WAVES=1`` does the same for any run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from fpgaccl.errors import ToolchainError

from .servers.child import SocketServerProcess

SERVER_MODULE = "fpgaccl.sim.servers.entry"

BRIDGE_ENV = "FPGACCL_SIM_BRIDGE"
"""Mixed runs: the server's bridge options (JSON: loss, seed, pcap, pcap_inbound, tap)."""
SIM_STAGE_BYTES = 1 << 20
"""Each of IN, OUT, TMP, TMP2 in a node's 8 MiB memory; the segment size."""

BUILD_ENV = "FPGACCL_SIM_BUILD"
"""JSON ``{"build_dir", "toplevel", "params"}`` of an existing build of the standard
cluster: the server uses it as is, skipping the elaboration that checks the cache
(~10-20 s). Tests that already called build_standard() set it. Ignored for ``waves``
runs, which need the traced build."""


def build_env(sim: Any, params: dict[str, Any]) -> dict[str, str]:
    return {BUILD_ENV: json.dumps({"build_dir": str(sim.build_dir), "toplevel": sim.toplevel,
                                   "verilog": str(sim.verilog), "params": params})}


def build_cluster(waves: bool = False):
    """The standard cluster's build; with ``waves`` a separate, traced build."""
    from fpgaccl.sim.hdl.cluster import build_standard
    from fpgaccl.sim.runner import SimBuild
    if not waves and os.environ.get(BUILD_ENV):
        b = json.loads(os.environ[BUILD_ENV])
        return SimBuild(b["toplevel"], Path(b["build_dir"]), Path(b["verilog"])), b["params"]
    return build_standard(waves=waves)


def serve(socket_path: str, *, waves: bool = False, loss: int = 0, seed: int = 1,
          run_dir: str | None = None, idle_timeout_s: float = 600.0) -> dict[str, Any]:
    """Run the server until the world has come and gone; return the run summary."""
    from fpgaccl.sim.runner import run, waves_requested
    waves = waves or waves_requested()
    sim, params = build_cluster(waves)
    run_dir = Path(run_dir or tempfile.mkdtemp(prefix="fpgaccl-sim-"))
    summary = run_dir / "summary.json"
    run(sim, SERVER_MODULE, waves=waves, test_dir=run_dir,
        params={**params, "server": "cluster", "socket": socket_path,
                "stage_bytes": SIM_STAGE_BYTES, "summary": str(summary), "loss": loss,
                "seed": seed, "clock_ns": 4, "idle_timeout_s": idle_timeout_s,
                "bridge": json.loads(os.environ.get(BRIDGE_ENV) or "{}")})
    out = json.loads(summary.read_text())
    out["run_dir"], out["waves"] = str(run_dir), waves
    return out


def format_summary(s: dict[str, Any]) -> str:
    mhz = 1000 / s.get("clock_ns", 4)
    lines = [f"fpgaccl sim: {s['world']} of {s['nodes']} nodes, {s['collectives']} collectives, "
             f"{s['cycles']} cycles ({s['cycles'] / mhz:.1f} us at {mhz:g} MHz), "
             f"{s['node_cycles']} node-busy cycles",
             f"fpgaccl sim: switch dropped {s['switch_dropped']} frames, "
             f"{s['retransmits']} retransmissions, {s['errors']} errors"]
    drops = ", ".join(f"{k}={v}" for k, v in sorted(s["drops"].items())) or "none"
    lines.append(f"fpgaccl sim: node drops by reason: {drops}")
    return "\n".join(lines)


class ServerProcess(SocketServerProcess):
    """A server in a child process, with its socket in a private temporary folder."""

    kind = "simulation server"

    def __init__(self, *, waves: bool = False, loss: int = 0,
                 idle_timeout_s: float = 600.0, env: dict[str, str] | None = None) -> None:
        # ``env``: extra variables for the server only (a mixed run's bridge options).
        super().__init__("fpgaccl.sim.server",
                         ["--loss", str(loss), "--idle-timeout", str(idle_timeout_s)]
                         + (["--waves"] if waves else []),
                         prefix="fpgaccl-sim-", socket_name="sim.sock", env=env)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fpgaccl.sim.server", description=__doc__)
    ap.add_argument("--socket", required=True)
    ap.add_argument("--run-dir", default=None)
    ap.add_argument("--waves", action="store_true", help="dump waveforms (separate build)")
    ap.add_argument("--loss", type=int, default=0,
                    help="switch loss register (frames dropped per 65536)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--idle-timeout", type=float, default=600.0)
    ap.add_argument("--json", default=None, help="write the summary here")
    a = ap.parse_args(argv)
    try:
        s = serve(a.socket, waves=a.waves, loss=a.loss, seed=a.seed, run_dir=a.run_dir,
                  idle_timeout_s=a.idle_timeout)
    except (ToolchainError, AssertionError) as e:
        print(f"fpgaccl sim: server failed: {e}", file=sys.stderr)
        return 1
    print(format_summary(s), file=sys.stderr)
    if s.get("waves"):
        from fpgaccl.sim.runner import waves_file
        print(f"fpgaccl sim: waveform {waves_file(Path(s['run_dir']))}", file=sys.stderr)
    if a.json:
        Path(a.json).write_text(json.dumps(s, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
