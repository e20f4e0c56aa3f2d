"""The ``sim`` backend's simulation server: one Verilator process of the standard cluster
serving the ranks of ``fpgaccl run --backend sim`` over a Unix socket.

``python -m fpgaccl.sim.server --socket PATH [--waves] [--loss N] [--json F]`` builds (or
reuses) the standard cluster, runs the cocotb server bench
(:mod:`fpgaccl.sim.benches.sim_server`) until every rank has connected and left, and
prints the run summary on stderr. :class:`ServerProcess` is how the launcher and the
tests start one. ``--waves`` uses a separate build with tracing (minutes the first time)
and leaves the waveform in the run folder it prints: ``dump.fst`` where the lz4 and zlib
headers are installed (Debian: liblz4-dev, zlib1g-dev), else ``dump.vcd`` (much larger:
~8 KB per cycle for four nodes). ``FPGACCL_WAVES=1`` does the same for any run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from fpgaccl.errors import BackendUnavailableError, ToolchainError

SERVER_MODULE = "fpgaccl.sim.benches.sim_server"


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
    from fpgaccl.host.sim_backend import SIM_STAGE_BYTES
    from fpgaccl.sim.runner import run, waves_requested
    waves = waves or waves_requested()
    sim, params = build_cluster(waves)
    run_dir = Path(run_dir or tempfile.mkdtemp(prefix="fpgaccl-sim-"))
    summary = run_dir / "summary.json"
    run(sim, SERVER_MODULE, waves=waves, test_dir=run_dir,
        params={**params, "socket": socket_path, "stage_bytes": SIM_STAGE_BYTES,
                "summary": str(summary), "loss": loss, "seed": seed, "clock_ns": 4,
                "idle_timeout_s": idle_timeout_s})
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


class ServerProcess:
    """A server in a child process, with its socket in a private temporary folder."""

    def __init__(self, *, waves: bool = False, loss: int = 0,
                 idle_timeout_s: float = 600.0, env: dict[str, str] | None = None) -> None:
        self.dir = tempfile.mkdtemp(prefix="fpgaccl-sim-")
        self.socket = os.path.join(self.dir, "sim.sock")
        cmd = [sys.executable, "-m", "fpgaccl.sim.server", "--socket", self.socket,
               "--run-dir", self.dir, "--loss", str(loss),
               "--idle-timeout", str(idle_timeout_s)] + (["--waves"] if waves else [])
        # ``env``: extra variables for the server only (a mixed run's bridge options). Its
        # own process group: the simulator is a grandchild (cocotb's runner starts it), and
        # killing the group is the only way not to leave it running.
        self.proc = subprocess.Popen(cmd, env={**os.environ, **(env or {})},
                                     start_new_session=True)

    def wait_ready(self, timeout_s: float = 1800.0) -> str:
        """Wait for the socket (the first call may build the cluster: minutes)."""
        end = time.monotonic() + timeout_s
        while not os.path.exists(self.socket):
            if self.proc.poll() is not None:
                raise BackendUnavailableError(
                    f"the simulation server exited with {self.proc.returncode} before it "
                    f"listened (log: {self.dir}/sim.log)")
            if time.monotonic() > end:
                self._kill()
                raise BackendUnavailableError(f"no simulation server after {timeout_s:g} s")
            time.sleep(0.1)
        return self.socket

    def stop(self, timeout_s: float = 60.0) -> int:
        """Wait for the server to finish (it ends once every rank has left); kill it if it
        does not."""
        if self.proc.poll() is None and os.path.exists(self.socket):
            # Ranks that never connected (or failed before hello) leave it waiting: end it.
            import socket as _socket

            from fpgaccl.host.sim_backend import encode
            with contextlib.suppress(OSError), \
                    _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM) as s:
                s.connect(self.socket)
                s.sendall(encode({"op": "shutdown"}))
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self._kill()
            return self.proc.wait()

    def _kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)


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
