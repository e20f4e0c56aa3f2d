"""``fpgaccl run -n N -- cmd``: start N local ranks of a command and wait for them.

Each rank gets the environment :func:`fpgaccl.host.init` reads (FPGACCL_RANK,
FPGACCL_WORLD_SIZE, and torchrun's RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT),
a fresh rendezvous port, and optionally a capture directory whose per-rank pcaps are
merged into one file when the run ends. Multi-host runs use the site's launcher
(torchrun, srun, mpirun) instead; this one only starts local processes.

Every rank writes its communicators' flight records (:mod:`.flight`) to a directory of
the run (FPGACCL_FLIGHT_DIR) when a call fails and at exit; when the run fails, the
launcher prints every rank's last calls from them.

The run draws a job secret (FPGACCL_JOB_SECRET, unless the environment sets one) that
every rank proves at the rendezvous, so no stranger joins it. SIGTERM, SIGHUP and SIGINT
to the launcher (what a batch system or a terminal sends) go to every rank's process
group; ranks still running :data:`GRACE_S` later (a second signal cuts that short) are
killed, as are the servers the run started, and the launcher exits with 128 + the signal.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from . import flight
from . import pcap as pcapmod
from .rendezvous import SECRET_ENV


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


MIXED_RTO_S = 1.0
"""Retransmit timeout of the software ranks of a mixed run: a simulated node answers in
simulated cycles, tens of milliseconds of wall time, so the software default (50 ms)
would resend most packets."""
MIXED_MTU = 1024
"""MTU of the software ranks of a mixed run: at most the simulated nodes' build MTU
(``sim.hdl.cluster.STANDARD``, 4096), which their parsers take."""


GRACE_S = 5.0
"""Seconds ranks and servers have to exit after the launcher passes a signal on, before
SIGKILL: well inside Slurm's default KillWait (30 s) between its SIGTERM and SIGKILL."""
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)


class _Stopped(BaseException):
    """A stop signal, raised only where the launcher waits on a server's start."""


class _Signals:
    """The stop signals while a run lasts: noted in ``received`` for the rank loop to act
    on, raised as :class:`_Stopped` only inside :meth:`interruptible`."""

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.received: int | None = None
        self.count = 0
        self._raise = False
        self._old: dict[int, Any] = {}

    def __enter__(self) -> _Signals:
        if threading.current_thread() is threading.main_thread():  # else Python refuses
            self._old = {s: signal.signal(s, self._handle) for s in STOP_SIGNALS}
        return self

    def __exit__(self, *exc: Any) -> None:
        for s, handler in self._old.items():
            signal.signal(s, handler)

    def _handle(self, signum: int, frame: Any) -> None:
        # No printing here: the handler may interrupt a write to the same stream.
        self.count += 1
        if self.received is None:
            self.received = signum
        if self._raise:
            self._raise = False
            raise _Stopped

    @contextlib.contextmanager
    def interruptible(self) -> Any:
        if self.received is not None:
            raise _Stopped
        self._raise = True
        try:
            yield
        finally:
            self._raise = False

    def stop_child(self, child: Any) -> None:
        """Stop a server the run started (a :class:`fpgaccl.sim.servers.child.SocketServerProcess`):
        within the grace period once signalled."""
        if self.received is None:
            child.stop()
            return
        if not os.path.exists(child.socket):  # still building: deaf to a shutdown request
            _signal_group(child.proc, self.received)
        child.stop(timeout_s=self.grace_s)


def _signal_group(proc: subprocess.Popen, signum: int) -> None:
    # The group outlives its leader while grandchildren hold it, and its id stays theirs.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signum)


def run(nprocs: int, cmd: list[str], *, grace_s: float = GRACE_S, **options: Any) -> int:
    """Run ``cmd`` as ``nprocs`` ranks; the exit status is the first failing rank's, or
    128 + N when signal N stopped the run (the module's docstring says how; ``grace_s``
    replaces :data:`GRACE_S`). ``options``: ``pcap``, ``impair``, ``deadline_s``,
    ``timeout_s``, ``backend``, ``waves``, ``sim_loss``, ``sim_ranks``, ``bridge_loss``,
    ``bridge_pcap``, ``tap``.

    ``backend="sim"`` first starts the simulation server (:mod:`fpgaccl.sim.server`) and
    gives every rank its socket (FPGACCL_SIM_SOCKET) and FPGACCL_BACKEND=sim, so
    ``fpgaccl.init()`` connects each rank to node ``rank`` of the simulated cluster; the
    server prints the run summary when the ranks are done. ``sim_loss`` is the fraction
    of frames the simulated switch drops (its seeded ``loss`` register).

    ``sim_ranks`` (a mixed run): those ranks drive simulated nodes, the others run the
    software backend, in one world; the server bridges the simulated switch to the
    software ranks' sockets (:mod:`fpgaccl.sim.bridge`), dropping ``bridge_loss`` of the
    bridged frames, writing them to ``bridge_pcap`` and, as root, mirroring them to the
    TAP interface ``tap``. ``pcap`` then merges the software ranks' captures with the
    frames the simulated nodes sent them.

    ``backend="board"`` gives every rank FPGACCL_BACKEND=board: each drives engine
    ``rank`` of the board FPGACCL_BOARD names, or of a simulated board
    (:mod:`fpgaccl.sim.board`) started for the run when none is named.
    """
    with _Signals(grace_s) as sig:
        try:
            rc = _launch(nprocs, cmd, sig=sig, **options)
        except _Stopped:
            rc = 1
    if sig.received is not None:
        print(f"fpgaccl run: stopped by {signal.Signals(sig.received).name}", file=sys.stderr)
        return 128 + sig.received
    return rc


def _launch(nprocs: int, cmd: list[str], *, sig: _Signals, pcap: str | None = None,
            impair: str | None = None, deadline_s: float | None = None,
            timeout_s: float | None = None, backend: str = "software", waves: bool = False,
            sim_loss: float = 0.0, sim_ranks: list[int] | None = None,
            bridge_loss: float = 0.0, bridge_pcap: str | None = None,
            tap: str | None = None) -> int:
    """The body of :func:`run`, under its signal handling."""
    if sim_ranks:
        return _run_mixed(nprocs, cmd, sorted(set(sim_ranks)), sig, pcap=pcap, impair=impair,
                          deadline_s=deadline_s, timeout_s=timeout_s, waves=waves,
                          sim_loss=sim_loss, bridge_loss=bridge_loss, bridge_pcap=bridge_pcap,
                          tap=tap)
    if bridge_loss or bridge_pcap or tap:
        print("fpgaccl run: --bridge-loss/--bridge-pcap/--tap need --sim-ranks", file=sys.stderr)
        return 2
    server = None
    if backend == "sim":
        from fpgaccl.host.backends.sim import SIM_MAX_NODES
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
            try:
                with sig.interruptible():
                    sock = server.wait_ready()
            except Exception as e:
                print(f"fpgaccl run: {e}", file=sys.stderr)
                return 1
            return _run(nprocs, cmd, sig, pcap=None, impair=None, deadline_s=deadline_s,
                        timeout_s=timeout_s,
                        extra={"FPGACCL_BACKEND": "sim", "FPGACCL_SIM_SOCKET": sock})
        finally:
            sig.stop_child(server)
    elif backend == "board":
        return _run_board(nprocs, cmd, sig, pcap=pcap, impair=impair, deadline_s=deadline_s,
                          timeout_s=timeout_s)
    elif backend != "software":
        print(f"fpgaccl run: unknown backend {backend!r}", file=sys.stderr)
        return 2
    return _run(nprocs, cmd, sig, pcap=pcap, impair=impair, deadline_s=deadline_s,
                timeout_s=timeout_s)


def _run_board(nprocs: int, cmd: list[str], sig: _Signals, *, pcap: str | None,
               impair: str | None,
               deadline_s: float | None, timeout_s: float | None) -> int:
    """Ranks of the ``board`` backend: on the board FPGACCL_BOARD names, else on a
    simulated board started for this run (and stopped after it)."""
    from fpgaccl.host.board_device import BOARD_ENV
    if pcap or impair:
        print("fpgaccl run: --pcap/--impair are software-backend options; a board's wire "
              "is its own", file=sys.stderr)
        return 2
    if not cmd:
        print("fpgaccl run: no command given", file=sys.stderr)
        return 2
    extra = {"FPGACCL_BACKEND": "board"}
    if os.environ.get(BOARD_ENV):
        return _run(nprocs, cmd, sig, pcap=None, impair=None, deadline_s=deadline_s,
                    timeout_s=timeout_s, extra=extra)
    from fpgaccl.sim.board import NODES, BoardProcess
    if nprocs > NODES:
        print(f"fpgaccl run: the simulated board has {NODES} engines, not {nprocs}",
              file=sys.stderr)
        return 2
    print("fpgaccl run: no board in FPGACCL_BOARD; starting the simulated board (the "
          "first run builds it: minutes)", file=sys.stderr)
    board = BoardProcess()
    try:
        try:
            with sig.interruptible():
                extra[BOARD_ENV] = f"sim:{board.wait_ready()}"
        except Exception as e:
            print(f"fpgaccl run: {e}", file=sys.stderr)
            return 1
        return _run(nprocs, cmd, sig, pcap=None, impair=None, deadline_s=deadline_s,
                    timeout_s=timeout_s, extra=extra)
    finally:
        sig.stop_child(board)


def _run_mixed(nprocs: int, cmd: list[str], sim_ranks: list[int], sig: _Signals, *,
               pcap: str | None,
               impair: str | None, deadline_s: float | None, timeout_s: float | None,
               waves: bool, sim_loss: float, bridge_loss: float, bridge_pcap: str | None,
               tap: str | None) -> int:
    from fpgaccl.host.backends.sim import SIM_MAX_NODES, SIM_RANKS_ENV
    from fpgaccl.sim.server import BRIDGE_ENV
    if nprocs > SIM_MAX_NODES:
        print(f"fpgaccl run: a mixed run has at most {SIM_MAX_NODES} ranks (the simulated "
              f"switch's ports), not {nprocs}", file=sys.stderr)
        return 2
    if not all(0 <= r < nprocs for r in sim_ranks):
        print(f"fpgaccl run: --sim-ranks {sim_ranks} are not all ranks of -n {nprocs}",
              file=sys.stderr)
        return 2
    if impair:
        print("fpgaccl run: --impair is a software-link option; a mixed run's bridged "
              "links take --bridge-loss", file=sys.stderr)
        return 2
    if not cmd:
        print("fpgaccl run: no command given", file=sys.stderr)
        return 2
    if tap and os.geteuid() != 0:
        print(f"fpgaccl run: --tap {tap} needs root", file=sys.stderr)
        return 2
    tmp = tempfile.TemporaryDirectory(prefix="fpgaccl-pcap-") if pcap else None
    opts: dict[str, Any] = {"loss": bridge_loss, "tap": tap}
    if bridge_pcap:
        opts["pcap"] = str(Path(bridge_pcap).resolve())
    elif tmp is not None:
        # The software ranks capture what they send; the bridge adds what the nodes send.
        opts.update(pcap=str(Path(tmp.name) / "rank-bridge.pcap"), pcap_inbound=False)
    from fpgaccl.sim.server import ServerProcess
    print(f"fpgaccl run: ranks {','.join(map(str, sim_ranks))} on simulated nodes, the "
          "others on the software backend; starting the simulation server", file=sys.stderr)
    # The server's cocotb process reads the bridge options from its environment.
    server = ServerProcess(waves=waves, loss=round(sim_loss * 65536),
                           env={BRIDGE_ENV: json.dumps(opts)})
    try:
        with sig.interruptible():
            sock = server.wait_ready()
    except Exception as e:
        print(f"fpgaccl run: {e}", file=sys.stderr)
        sig.stop_child(server)
        return 1
    except _Stopped:
        sig.stop_child(server)
        raise
    sims = ",".join(map(str, sim_ranks))
    per_rank = {}
    for r in range(nprocs):
        if r in sim_ranks:
            per_rank[r] = {"FPGACCL_BACKEND": "sim", "FPGACCL_SIM_SOCKET": sock,
                           SIM_RANKS_ENV: sims}
        else:
            per_rank[r] = {"FPGACCL_BACKEND": "software",
                           "FPGACCL_RTO_S": os.environ.get("FPGACCL_RTO_S", str(MIXED_RTO_S)),
                           "FPGACCL_MTU": os.environ.get("FPGACCL_MTU", str(MIXED_MTU))}
    try:
        return _run(nprocs, cmd, sig, pcap=pcap, impair=None, deadline_s=deadline_s,
                    timeout_s=timeout_s, per_rank=per_rank, pcap_dir=tmp,
                    before_merge=lambda: sig.stop_child(server))
    finally:
        sig.stop_child(server)
        if tmp is not None:
            tmp.cleanup()
        summary = Path(server.dir) / "summary.json"
        if summary.exists():
            b = json.loads(summary.read_text()).get("bridge") or {}
            print("fpgaccl run: bridge: " + (", ".join(f"{k}={v}" for k, v in sorted(b.items()))
                                             or "no frames"), file=sys.stderr)


def _run(nprocs: int, cmd: list[str], sig: _Signals, *, pcap: str | None,
         impair: str | None,
         deadline_s: float | None, timeout_s: float | None,
         extra: dict[str, str] | None = None, per_rank: dict[int, dict[str, str]] | None = None,
         pcap_dir: Any = None, before_merge: Any = None) -> int:
    if nprocs < 1:
        print("fpgaccl run: -n must be at least 1", file=sys.stderr)
        return 2
    if not cmd:
        print("fpgaccl run: no command given (use: fpgaccl run -n 4 -- python script.py)",
              file=sys.stderr)
        return 2
    port = free_port()
    extra = dict(extra or {})
    tmp = pcap_dir
    if pcap:
        tmp = tmp or tempfile.TemporaryDirectory(prefix="fpgaccl-pcap-")
        extra["FPGACCL_PCAP_DIR"] = tmp.name
    if impair:
        extra["FPGACCL_IMPAIR"] = impair
    if deadline_s:
        extra["FPGACCL_DEADLINE_S"] = str(deadline_s)
    extra.setdefault(SECRET_ENV, os.environ.get(SECRET_ENV) or secrets.token_hex(16))
    flights = tempfile.TemporaryDirectory(prefix="fpgaccl-flight-")
    extra.setdefault(flight.FLIGHT_DIR_ENV, os.environ.get(flight.FLIGHT_DIR_ENV) or flights.name)
    procs: list[subprocess.Popen] = []
    for r in range(nprocs):
        if sig.received is not None:
            break
        # A group of its own: a signal reaches what the rank started too, and a terminal's
        # Ctrl-C reaches the rank once (through the launcher), not twice.
        procs.append(subprocess.Popen(
            cmd, env=rank_env(r, nprocs, port, {**extra, **(per_rank or {}).get(r, {})}),
            stdout=subprocess.PIPE, start_new_session=True))
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
    pending = set(range(len(procs)))
    while pending:
        if sig.received is not None:
            rc = _stop_ranks(procs, sig)
            break
        for r in sorted(pending):
            code = procs[r].poll()
            if code is not None:
                pending.discard(r)
                if code and not rc:
                    # A rank killed by signal N reports -N; the shell's 128 + N reads
                    # as that signal (sys.exit(-N) would exit with 256 - N).
                    rc = code if code > 0 else 128 - code
                    how = f"exited with {code}" if code > 0 else \
                        f"was killed by {signal.Signals(-code).name}"
                    print(f"fpgaccl run: rank {r} {how}", file=sys.stderr)
        if timeout_s is not None and time.monotonic() - start > timeout_s:
            print(f"fpgaccl run: timed out after {timeout_s:g} s", file=sys.stderr)
            for r in pending:
                _signal_group(procs[r], signal.SIGKILL)
            rc = rc or 124
            break
        time.sleep(0.02)
    for t in pumps:
        t.join(5)
    if rc:
        records = flight.read_dir(extra[flight.FLIGHT_DIR_ENV])
        if records:
            print(flight.report(records, nprocs), file=sys.stderr)
    flights.cleanup()
    if before_merge is not None:
        before_merge()  # e.g. the simulation server, which closes its capture at exit
    if pcap and tmp is not None:
        files = sorted(Path(tmp.name).glob("rank*.pcap"))
        n = pcapmod.merge(files, pcap)
        print(f"fpgaccl run: {n} frames from {len(files)} capture(s) -> {pcap}",
              file=sys.stderr)
        if pcap_dir is None:
            tmp.cleanup()
    return rc


def _stop_ranks(procs: list[subprocess.Popen], sig: _Signals) -> int:
    """Pass the signal to every rank's group; SIGKILL what is left after the grace
    period (or at a second signal)."""
    assert sig.received is not None
    name = signal.Signals(sig.received).name
    print(f"fpgaccl run: {name}: passing it to {len(procs)} rank(s); SIGKILL for those "
          f"still running in {sig.grace_s:g} s", file=sys.stderr)
    for p in procs:
        _signal_group(p, sig.received)
    end, seen = time.monotonic() + sig.grace_s, sig.count
    while any(p.poll() is None for p in procs) and time.monotonic() < end \
            and sig.count == seen:
        time.sleep(0.02)
    late = [r for r, p in enumerate(procs) if p.poll() is None]
    if late:
        print(f"fpgaccl run: rank(s) {late} still running after {name}: SIGKILL",
              file=sys.stderr)
    for p in procs:  # also what a rank started and left behind
        _signal_group(p, signal.SIGKILL)
    for p in procs:
        p.wait()
    return 128 + sig.received
