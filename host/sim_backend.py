"""The ``sim`` backend: each rank drives one node of a Verilator-simulated cluster.

``fpgaccl run -n N --backend sim`` starts one simulation server (:mod:`fpgaccl.sim.server`:
the standard 4-node, 64-bit cluster of full HDL nodes = ``hw/node.py`` joined by the
hardware switch) and hands each rank its Unix socket in ``FPGACCL_SIM_SOCKET``.
``Communicator(rank, world, backend="sim")`` (or ``fpgaccl.init()`` under
``--backend sim``) connects, claims node ``rank``, and from then on every collective
goes through the very code path of the software backend -- the same argument checks,
the same library program (:mod:`fpgaccl.proto.programs`), the same segmenting and
``coll_id`` numbering -- except that each segment is shipped to the server as the
program's CSR writes (:func:`fpgaccl.proto.plans.collective_writes`) plus the IN bytes,
and the server returns OUT as the HDL engine wrote it. Results are therefore
bit-identical to the software backend whenever both cut the same segments: always for
vectors that fit one segment (``stage_bytes``, 1 MiB here, less the chunk padding), and
for any size when the software communicator is given the same ``stage_bytes``.

Limits: world_size <= 4 (the standard cluster), programs up to the engine's 256
instruction-memory words, and only calls with a library program (allreduce ring/rhd,
reduce chain, broadcast chain, reduce_scatter, allgather, alltoall, run_program);
host schedules (``tree`` algorithms, alltoallv, send/recv) raise UnsupportedError.
IN and OUT travel through the memory backdoor one 64-bit word per clock, driven from
Python (roughly 10-30k words per wall second): keep simulated collectives to a few
thousand elements per call. Async calls complete before they return.

Mixed runs (``fpgaccl run -n 4 --sim-ranks 2,3``): the ranks listed drive simulated
nodes, the others run the software backend, and all of them make one world. A simulated
rank then also takes part in the software ranks' TCP rendezvous (MASTER_ADDR/PORT),
advertising its node as a software engine advertises itself: the node's IP (the
loopback address the rank would have bound on the software backend), port 4791, QPN
``0x100 + peer``, its PSNs, and its memory key and IN/OUT/TMP/TMP2 addresses. The server
programs the node from the table and bridges the switch ports of the software ranks to
their UDP sockets (:mod:`fpgaccl.sim.bridge`). Both backends cut the same segments
(``stage_bytes``: the smallest advertised) with the same ``coll_id`` numbers, so a
collective spans both. Only library programs cross: barrier, send/recv and the host
schedules (``tree``, alltoallv) have none, and raise UnsupportedError on the simulated
ranks (a one-element allreduce synchronises a mixed world).

Wire format (both directions): ``>II`` header length and payload length, a JSON header,
then the raw payload. Requests: ``hello {node, world}``, ``collective {seq, coll_id,
name, count, dtype, writes, out_bytes}`` + IN bytes, ``barrier {seq}``, ``stats``,
``shutdown``, and for mixed runs ``hello {node, world, sim_ranks, ip}`` and ``connect
{table}``; replies carry ``ok`` or ``error``/``detail``.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
import threading
import time
from typing import Any

import numpy as np

from fpgaccl.errors import (
    BackendUnavailableError,
    CollectiveTimeoutError,
    CountMismatchError,
    InvalidArgumentError,
    TransportError,
    UnsupportedError,
)
from fpgaccl.proto.framing import encode, recv_frame
from fpgaccl.proto.isa import Buf, Instr, assemble
from fpgaccl.proto.opcodes import ROCEV2_UDP_PORT
from fpgaccl.proto.plans import QPN_BASE, collective_writes
from fpgaccl.proto.reduce import DType, ReduceOp
from fpgaccl.proto.regmap import default_map

from .buffers import UserBuffer
from .communicator import Communicator, loopback_ip

SOCKET_ENV = "FPGACCL_SIM_SOCKET"
SIM_RANKS_ENV = "FPGACCL_SIM_RANKS"
"""Mixed runs: the comma-separated ranks that drive simulated nodes."""
BRIDGE_ENV = "FPGACCL_SIM_BRIDGE"
"""Mixed runs: the server's bridge options (JSON: loss, seed, pcap, pcap_inbound, tap)."""
SIM_MAX_NODES = 4
"""Nodes of the standard cluster (:func:`fpgaccl.sim.hdl.cluster.build_standard`)."""
SIM_STAGE_BYTES = 1 << 20
"""Each of IN, OUT, TMP, TMP2 in a node's 8 MiB memory; the segment size."""
CLOCK_MHZ = 250
"""Times reported for simulated runs are cycles at this clock (the bench's 4 ns)."""

def connect_unix(path: str, timeout_s: float, what: str) -> socket.socket:
    """A stream connection to ``path``, retried until the server listens or
    ``timeout_s`` passes (then :class:`BackendUnavailableError` names ``what``)."""
    end = time.monotonic() + timeout_s
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(path)
        except OSError as e:
            sock.close()
            if time.monotonic() > end:
                raise BackendUnavailableError(f"no {what} at {path}: {e}") from e
            time.sleep(0.1)
            continue
        sock.settimeout(timeout_s)
        return sock


class _Region:
    """Host-side staging with the software region's ``view`` (block-gathered IN)."""

    def __init__(self, stage_bytes: int) -> None:
        self.stage_bytes = stage_bytes
        self.mem = np.zeros(4 * stage_bytes, np.uint8)

    def view(self, buf: Buf, dtype: Any, count: int) -> np.ndarray:
        dt = np.dtype(dtype)
        off = int(buf) * self.stage_bytes
        return self.mem[off:off + count * dt.itemsize].view(dt)


class SimHandle:
    """What ``*_async`` returns on the sim backend: the call has already completed."""

    def __init__(self, result: Any) -> None:
        self._result = result

    def test(self) -> bool:
        return True

    def wait(self, timeout: float | None = None) -> Any:
        return self._result


class SimCommunicator(Communicator):
    """A :class:`Communicator` whose engine is one node of the simulated cluster."""

    def __init__(self, rank: int, world_size: int, backend: str = "sim", *,
                 sim_socket: str | None = None, deadline_s: float = 600.0,
                 stage_bytes: int = SIM_STAGE_BYTES, rendezvous_timeout_s: float = 600.0,
                 pcap: Any = None, impair: Any = None, sim_ranks: Any = None,
                 master_addr: str | None = None, master_port: int | None = None,
                 **_software_only: Any) -> None:
        if not isinstance(world_size, int) or world_size < 1:
            raise InvalidArgumentError("world_size", f"{world_size!r} must be a positive int")
        if world_size > SIM_MAX_NODES:
            raise UnsupportedError("world_size", f"{world_size} ranks; the simulated cluster "
                                   f"has {SIM_MAX_NODES} nodes")
        if not isinstance(rank, int) or not 0 <= rank < world_size:
            raise InvalidArgumentError("rank", f"{rank!r} is outside 0..{world_size - 1}")
        if deadline_s <= 0:
            raise InvalidArgumentError("deadline_s", "must be positive")
        if impair:
            raise UnsupportedError("impair", "the sim backend's links are the HDL switch's "
                                   "(its loss register), not host-side impairments")
        path = sim_socket or os.environ.get(SOCKET_ENV)
        if not path:
            raise BackendUnavailableError(
                f"backend 'sim' needs a simulation server: start the ranks with "
                f"`fpgaccl run -n N --backend sim -- ...` or set {SOCKET_ENV}")
        if sim_ranks is None and os.environ.get(SIM_RANKS_ENV):
            sim_ranks = [int(x) for x in os.environ[SIM_RANKS_ENV].split(",") if x.strip()]
        if sim_ranks is not None:
            sim_ranks = sorted({int(x) for x in sim_ranks})
            if rank not in sim_ranks or not all(0 <= x < world_size for x in sim_ranks):
                raise InvalidArgumentError("sim_ranks", f"{sim_ranks} must be ranks of the "
                                           f"world of {world_size} and include rank {rank}")
            if sim_ranks == list(range(world_size)):
                sim_ranks = None  # every rank simulated: the plain sim backend
        if pcap and sim_ranks is None:
            raise UnsupportedError("pcap", "the sim backend's wire is inside the simulation; "
                                   "record it with `fpgaccl run --backend sim --waves`")
        # (In a mixed run the bridge records what this rank's node sends: see --pcap.)
        self.sim_ranks = sim_ranks
        self._init_state(rank, world_size, "sim", deadline_s)
        self._sock = connect_unix(path, rendezvous_timeout_s, "simulation server")
        hello = {"op": "hello", "node": rank, "world": world_size}
        if sim_ranks is not None:
            master_addr = master_addr or os.environ.get("MASTER_ADDR", "127.0.0.1")
            master_port = int(master_port or os.environ.get("MASTER_PORT", 29500))
            ip = os.environ.get("FPGACCL_BIND_IP")
            if ip is None:
                if not ipaddress.ip_address(socket.gethostbyname(master_addr)).is_loopback:
                    raise UnsupportedError("sim_ranks", "mixed runs bridge simulated nodes "
                                           "to software ranks on this host only (loopback)")
                ip = loopback_ip(master_port, rank)
            hello.update(sim_ranks=sim_ranks, ip=ip)
        try:
            head, _ = self._call(hello, b"", "init", rendezvous_timeout_s)
            if sim_ranks is not None:
                stage_bytes = self._join(head, hello["ip"], master_addr, master_port,
                                         rendezvous_timeout_s)
        except BaseException:
            self._sock.close()
            raise
        self.nodes = head["nodes"]
        self.clock_mhz = 1000 / head.get("clock_ns", 4)
        server_stage = int(head["stage_bytes"])
        stage_bytes = min(int(stage_bytes), server_stage)
        self.stage_bytes = max(4096, stage_bytes - stage_bytes % 4096)
        self.buffers = [int(b) for b in head["buffers"]]
        self.imem_words = int(head["imem_words"])
        self.rmap = default_map(qps=int(head["qps"]), imem_words=self.imem_words)
        self.region = _Region(self.stage_bytes)

    def _join(self, head: dict, ip: str, master_addr: str, master_port: int,
               timeout: float) -> int:
        """Mixed runs: the software ranks' rendezvous, on behalf of this rank's node, then
        the node's connection from the table. Returns the world's segment size."""
        from .rendezvous import exchange
        rng = np.random.default_rng()
        qps = {str(p): {"qpn": QPN_BASE + p, "psn": int(rng.integers(0, 1 << 24)),
                        # The node has no per-peer receive ring (send/recv schedules).
                        "va": 0, "rkey": 0}
               for p in range(self.world_size) if p != self.rank}
        info = {"ip": ip, "port": ROCEV2_UDP_PORT, "qps": qps, "backend": "sim",
                "coll": {"key": int(head["key"]), "buffers": [int(b) for b in head["buffers"]],
                         "stage_bytes": int(head["stage_bytes"])}}
        table = exchange(self.rank, self.world_size,
                         (socket.gethostbyname(master_addr), master_port), info, timeout)
        self._call({"op": "connect", "table": table}, b"", "init", timeout)
        # The software ranks cut segments from the smallest advertised region: so do we.
        return min(int(t["coll"]["stage_bytes"]) for t in table)

    # ------------------------------------------------------------------ transport
    def _init_state(self, rank: int, world_size: int, backend: str,
                    deadline_s: float) -> None:
        """What every engine-driving backend starts with (collective numbering, cycle
        counts, the lock that serialises a rank's requests)."""
        self.rank, self.world_size, self.backend = rank, world_size, backend
        self.deadline_s = deadline_s
        self.link = None
        self._closed = False
        self._lock = threading.Lock()
        self._coll = 0
        self._seq = 0
        self.last_cycles = 0
        self.total_cycles = 0

    def _call(self, header: dict, payload: bytes, name: str, timeout: float
              ) -> tuple[dict, bytes]:
        if self._closed:
            raise InvalidArgumentError("comm", "communicator is closed")
        self._sock.settimeout(timeout)
        try:
            self._sock.sendall(encode(header, payload))
            head, body = recv_frame(self._sock)
        except TimeoutError:
            self._fail()
            raise CollectiveTimeoutError(name, self.rank, timeout,
                                         "the simulated engine did not answer") from None
        except (ConnectionError, OSError) as e:
            self._fail()
            raise TransportError(f"rank {self.rank}: simulation server lost: {e}") from e
        err = head.get("error")
        if err is None:
            return head, body
        detail = head.get("detail", "")
        if err in ("timeout", "peer"):
            raise CollectiveTimeoutError(name, self.rank, timeout, detail)
        if err == "engine":
            raise TransportError(f"rank {self.rank}: {detail}")
        if err == "mismatch":
            raise CountMismatchError("count", detail)
        if err in ("world_size", "rank"):
            raise UnsupportedError(err, detail)
        raise BackendUnavailableError(f"simulation server: {err}: {detail}")

    def _fail(self) -> None:
        # The stream may be out of step now: nothing more can go over it.
        self._closed = True
        with contextlib.suppress(OSError):
            self._sock.close()

    def _next_seq(self) -> int:
        with self._lock:
            self._seq += 1
            return self._seq

    # ------------------------------------------------------------------ the backend
    def _program(self, name: str, program: list[Instr], *, m: int, blocks: int,
                 dt: np.dtype, op: str | None, get_in: Any, put_out: Any, result: Any,
                 keep: list[UserBuffer], async_op: bool, out: np.ndarray | None = None,
                 check_lengths: bool = True) -> Any:
        """The software backend's segmenting (same seg/coll_id arithmetic), each segment
        run by the simulated engines. ``out`` is not bound here: the node's memory is the
        simulator's, so every segment's OUT is read back and ``put_out`` stores it.
        ``check_lengths`` has no effect: the server compares the ranks' calls instead."""
        dtype = DType.from_numpy(dt)
        rop = ReduceOp.from_name(op) if op else ReduceOp.SUM
        words = len(assemble(program))
        if words > self.imem_words:
            raise UnsupportedError("count", f"{name}'s program for this size needs {words} "
                                   f"instruction words; the simulated engine holds "
                                   f"{self.imem_words}")
        seg, nseg, c0 = self._segments(program, m=m, blocks=blocks, dt=dt)
        self.last_cycles = 0
        for k in range(nseg):
            lo, hi = k * seg, min(m, (k + 1) * seg)
            cnt = blocks * (hi - lo)
            inbuf = np.ascontiguousarray(get_in(lo, hi))
            writes = collective_writes(self.rmap, program, buffers=self.buffers, count=cnt,
                                       dtype=dtype, op=rop)
            head, out = self._call(
                {"op": "collective", "seq": self._next_seq(), "coll_id": (c0 + 1 + k) & 0xFFFF,
                 "name": name, "count": cnt, "dtype": dt.str, "writes": writes,
                 "out_bytes": cnt * dt.itemsize},
                inbuf.tobytes(), name, self.deadline_s)
            self.last_cycles += int(head["cycles"])
            put_out(np.frombuffer(out, dt, cnt), lo, hi)
        self.total_cycles += self.last_cycles
        for ub in keep:
            if ub.finish is not None:
                ub.finish()
        return SimHandle(result) if async_op else result

    def _ctx(self) -> Any:
        raise UnsupportedError("algo", "the sim backend runs library sequencer programs only; "
                               "host schedules (the 'tree' algorithms) have none")

    def _alltoallv(self, name: str, *args: Any, **kwargs: Any) -> Any:
        raise UnsupportedError("sendcounts", f"{name} has no sequencer program, so the sim "
                               "backend cannot run it")

    def send(self, buf: Any, dst: int, *, async_op: bool = False) -> Any:
        raise UnsupportedError("dst", "send/recv have no sequencer program on the sim backend")

    def recv(self, buf: Any, src: int, *, async_op: bool = False) -> Any:
        raise UnsupportedError("src", "send/recv have no sequencer program on the sim backend")

    def barrier(self, *, async_op: bool = False) -> Any:
        self._check_open()
        if self.sim_ranks is not None:
            raise UnsupportedError("barrier", "a mixed world's barrier would need the "
                                   "software ranks' ring schedule, which the simulated "
                                   "nodes lack; a one-element allreduce synchronises")
        self._call({"op": "barrier", "seq": self._next_seq()}, b"", "barrier", self.deadline_s)
        return SimHandle(None) if async_op else None

    # ------------------------------------------------------------------ introspection
    def sim_stats(self) -> dict[str, Any]:
        """The server's run summary so far (cycles, frames dropped, drops, retransmits)."""
        head, _ = self._call({"op": "stats"}, b"", "stats", self.deadline_s)
        head.pop("ok", None)
        return head

    def _node_stats(self, s: dict[str, Any]) -> dict[str, Any]:
        # A mixed run's summary lists the simulated ranks' nodes only.
        return next(n for n in s["per_node"] if n["node"] == self.rank)

    def drop_counters(self) -> dict[str, int]:
        return dict(self._node_stats(self.sim_stats())["drops"])

    def stats(self) -> dict[str, int]:
        s = self.sim_stats()
        return {"cycles": s["cycles"], "retransmits": self._node_stats(s)["retransmits"],
                "switch_dropped": s["switch_dropped"], "last_cycles": self.last_cycles,
                "total_cycles": self.total_cycles}

    def close(self, *, linger_s: float | None = None) -> None:
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(OSError):
            self._sock.close()


