"""The simulated board: the device the ``board`` backend drives when there is no PCIe
card, i.e. two DMA-capable HDL nodes (:class:`fpgaccl.hw.dma_node.DmaNode`, back to back)
with host- and GPU-memory models, in one Verilator process.

``python -m fpgaccl.sim.board --socket PATH`` builds (or reuses) the pair -- the very
build the DmaNode tests use -- and serves ranks until it is asked to stop (or sits idle)
(:mod:`fpgaccl.sim.benches.board_server`). :class:`BoardProcess` is how tests and
``FPGACCL_BOARD=sim`` runs start one.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from fpgaccl.errors import BackendUnavailableError, ToolchainError

SERVER_MODULE = "fpgaccl.sim.benches.board_server"
WIDTH = 64
NODES = 2
"""Engines on the simulated board (a :class:`~fpgaccl.sim.benches.dma_node_top.DmaNodePair`)."""


def build_pair():
    from fpgaccl.sim.benches.dma_node_top import DmaNodePair
    from fpgaccl.sim.runner import build
    return build(DmaNodePair(WIDTH), f"dma_node_pair_w{WIDTH}")


def serve(socket_path: str, *, run_dir: str | None = None, seed: int = 0,
          idle_timeout_s: float = 600.0) -> dict[str, Any]:
    from fpgaccl.sim.runner import run
    sim = build_pair()
    run_dir = Path(run_dir or tempfile.mkdtemp(prefix="fpgaccl-board-"))
    summary = run_dir / "summary.json"
    run(sim, SERVER_MODULE, test_dir=run_dir,
        params={"width": WIDTH, "socket": socket_path, "summary": str(summary), "seed": seed,
                "idle_timeout_s": idle_timeout_s})
    return json.loads(summary.read_text())


class BoardProcess:
    """A simulated board in a child process, its socket in a private temporary folder."""

    def __init__(self, *, idle_timeout_s: float = 600.0) -> None:
        self.dir = tempfile.mkdtemp(prefix="fpgaccl-board-")
        self.socket = os.path.join(self.dir, "board.sock")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "fpgaccl.sim.board", "--socket", self.socket,
             "--run-dir", self.dir, "--idle-timeout", str(idle_timeout_s)])

    def wait_ready(self, timeout_s: float = 1800.0) -> str:
        """Wait for the socket (the first call may build the pair: minutes)."""
        end = time.monotonic() + timeout_s
        while not os.path.exists(self.socket):
            if self.proc.poll() is not None:
                raise BackendUnavailableError(
                    f"the simulated board exited with {self.proc.returncode} before it "
                    f"listened (run folder {self.dir})")
            if time.monotonic() > end:
                self.proc.kill()
                raise BackendUnavailableError(f"no simulated board after {timeout_s:g} s")
            time.sleep(0.1)
        return self.socket

    def stop(self, timeout_s: float = 60.0) -> int:
        """Ask the board to shut down and wait for it."""
        if self.proc.poll() is None and os.path.exists(self.socket):
            import socket as _socket

            from fpgaccl.host.sim_backend import encode
            with contextlib.suppress(OSError), \
                    _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM) as s:
                s.connect(self.socket)
                s.sendall(encode({"op": "shutdown"}))
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fpgaccl.sim.board", description=__doc__)
    ap.add_argument("--socket", required=True)
    ap.add_argument("--run-dir", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--idle-timeout", type=float, default=600.0)
    a = ap.parse_args(argv)
    try:
        s = serve(a.socket, run_dir=a.run_dir, seed=a.seed, idle_timeout_s=a.idle_timeout)
    except (ToolchainError, AssertionError) as e:
        print(f"fpgaccl board: simulated board failed: {e}", file=sys.stderr)
        return 1
    print(f"fpgaccl board: {s['cycles']} cycles, {s['csr_ops']} register accesses",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
