"""The simulated board: the device the ``board`` backend drives when there is no PCIe
card, i.e. two DMA-capable HDL nodes (:class:`fpgaccl.hw.dma_node.DmaNode`, back to back)
with host- and GPU-memory models, in one Verilator process.

``python -m fpgaccl.sim.board --socket PATH`` builds (or reuses) the pair -- the very
build the DmaNode tests use -- and serves ranks until it is asked to stop (or sits idle)
(:class:`fpgaccl.sim.servers.board.BoardServer` in the simulator). :class:`BoardProcess`
is how tests and ``FPGACCL_BOARD=sim`` runs start one.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from fpgaccl.errors import ToolchainError

from .servers.child import SocketServerProcess

SERVER_MODULE = "fpgaccl.sim.servers.entry"
WIDTH = 64
NODES = 2
"""Engines on the simulated board (a :class:`~fpgaccl.sim.tb.dma_node_top.DmaNodePair`)."""


def build_pair():
    from fpgaccl.sim.runner import build
    from fpgaccl.sim.tb.dma_node_top import DmaNodePair
    return build(DmaNodePair(WIDTH), f"dma_node_pair_w{WIDTH}")


def serve(socket_path: str, *, run_dir: str | None = None, seed: int = 0,
          idle_timeout_s: float = 600.0) -> dict[str, Any]:
    from fpgaccl.sim.runner import run
    sim = build_pair()
    run_dir = Path(run_dir or tempfile.mkdtemp(prefix="fpgaccl-board-"))
    summary = run_dir / "summary.json"
    run(sim, SERVER_MODULE, test_dir=run_dir,
        params={"server": "board", "width": WIDTH, "socket": socket_path,
                "summary": str(summary), "seed": seed, "idle_timeout_s": idle_timeout_s})
    return json.loads(summary.read_text())


class BoardProcess(SocketServerProcess):
    """A simulated board in a child process, its socket in a private temporary folder."""

    kind = "simulated board"

    def __init__(self, *, idle_timeout_s: float = 600.0) -> None:
        super().__init__("fpgaccl.sim.board", ["--idle-timeout", str(idle_timeout_s)],
                         prefix="fpgaccl-board-", socket_name="board.sock")


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
