"""``fpgaccl run -n N -- cmd``: start N local ranks of a command and wait for them.

Each rank gets the environment :func:`fpgaccl.host.init` reads (FPGACCL_RANK,
FPGACCL_WORLD_SIZE, and torchrun's RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT),
a fresh rendezvous port, and optionally a capture directory whose per-rank pcaps are
merged into one file when the run ends. Multi-host runs use the site's launcher
(torchrun, srun, mpirun) instead; this one only starts local processes.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from . import pcap as pcapmod


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, world: int, port: int, extra: dict[str, str] | None = None
             ) -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        "FPGACCL_RANK": str(rank), "FPGACCL_WORLD_SIZE": str(world),
        "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
    })
    env.update(extra or {})
    return env


def run(nprocs: int, cmd: list[str], *, pcap: str | None = None, impair: str | None = None,
        deadline_s: float | None = None, timeout_s: float | None = None,
        backend: str = "software", waves: bool = False, sim_loss: float = 0.0) -> int:
    """Run ``cmd`` as ``nprocs`` ranks; the exit status is the first failing rank's.

    ``backend="sim"`` first starts the simulation server (:mod:`fpgaccl.sim.server`) and
    gives every rank its socket (FPGACCL_SIM_SOCKET) and FPGACCL_BACKEND=sim, so
    ``fpgaccl.init()`` connects each rank to node ``rank`` of the simulated cluster; the
    server prints the run summary when the ranks are done. ``sim_loss`` is the fraction
    of frames the simulated switch drops (its seeded ``loss`` register).
    """
    server = None
    if backend == "sim":
        from fpgaccl.host.sim_backend import SIM_MAX_NODES
        if nprocs > SIM_MAX_NODES:
            print(f"fpgaccl run: --backend sim runs at most {SIM_MAX_NODES} ranks (the "
                  f"simulated cluster's nodes), not {nprocs}", file=sys.stderr)
            return 2
        if pcap or impair:
            print("fpgaccl run: --pcap/--impair are software-backend options; the sim "
                  "backend has --waves and the switch's loss", file=sys.stderr)
            return 2
        if not cmd:
            print("fpgaccl run: no command given", file=sys.stderr)
            return 2
        from fpgaccl.sim.server import ServerProcess
        print("fpgaccl run: starting the simulation server (the first run builds the "
              "cluster: minutes)", file=sys.stderr)
        server = ServerProcess(waves=waves, loss=round(sim_loss * 65536))
        try:
            sock = server.wait_ready()
        except Exception as e:
            print(f"fpgaccl run: {e}", file=sys.stderr)
            return 1
        try:
            return _run(nprocs, cmd, pcap=None, impair=None, deadline_s=deadline_s,
                        timeout_s=timeout_s,
                        extra={"FPGACCL_BACKEND": "sim", "FPGACCL_SIM_SOCKET": sock})
        finally:
            server.stop()
    elif backend != "software":
        print(f"fpgaccl run: unknown backend {backend!r}", file=sys.stderr)
        return 2
    return _run(nprocs, cmd, pcap=pcap, impair=impair, deadline_s=deadline_s,
                timeout_s=timeout_s)


def _run(nprocs: int, cmd: list[str], *, pcap: str | None, impair: str | None,
         deadline_s: float | None, timeout_s: float | None,
         extra: dict[str, str] | None = None) -> int:
    if nprocs < 1:
        print("fpgaccl run: -n must be at least 1", file=sys.stderr)
        return 2
    if not cmd:
        print("fpgaccl run: no command given (use: fpgaccl run -n 4 -- python script.py)",
              file=sys.stderr)
        return 2
    port = free_port()
    extra = dict(extra or {})
    tmp = None
    if pcap:
        tmp = tempfile.TemporaryDirectory(prefix="fpgaccl-pcap-")
        extra["FPGACCL_PCAP_DIR"] = tmp.name
    if impair:
        extra["FPGACCL_IMPAIR"] = impair
    if deadline_s:
        extra["FPGACCL_DEADLINE_S"] = str(deadline_s)
    procs = [subprocess.Popen(cmd, env=rank_env(r, nprocs, port, extra),
                              stdout=subprocess.PIPE)
             for r in range(nprocs)]
    # Whole lines only: ranks sharing one stdout pipe interleave mid-line otherwise.
    lock = threading.Lock()

    def forward(stream: Any) -> None:
        out = sys.stdout.buffer if hasattr(sys.stdout, "buffer") else None
        for line in iter(stream.readline, b""):
            with lock:
                if out is not None:
                    out.write(line)
                    out.flush()
                else:
                    sys.stdout.write(line.decode(errors="replace"))
        stream.close()

    pumps = [threading.Thread(target=forward, args=(p.stdout,), daemon=True) for p in procs]
    for t in pumps:
        t.start()
    rc = 0
    start = time.monotonic()
    try:
        pending = set(range(nprocs))
        while pending:
            for r in sorted(pending):
                code = procs[r].poll()
                if code is not None:
                    pending.discard(r)
                    if code and not rc:
                        rc = code
                        print(f"fpgaccl run: rank {r} exited with {code}", file=sys.stderr)
            if timeout_s is not None and time.monotonic() - start > timeout_s:
                print(f"fpgaccl run: timed out after {timeout_s:g} s", file=sys.stderr)
                for r in pending:
                    procs[r].kill()
                rc = rc or 124
                break
            time.sleep(0.02)
    except KeyboardInterrupt:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        for p in procs:
            p.wait()
        rc = 130
    for t in pumps:
        t.join(5)
    if pcap and tmp is not None:
        files = sorted(Path(tmp.name).glob("rank*.pcap"))
        n = pcapmod.merge(files, pcap)
        print(f"fpgaccl run: {n} frames from {len(files)} rank(s) -> {pcap}", file=sys.stderr)
        tmp.cleanup()
    return rc
