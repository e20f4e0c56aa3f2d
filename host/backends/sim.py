"""The ``sim`` backend: each rank drives one node of a Verilator-simulated cluster.

``fpgaccl run -n N --backend sim`` starts one simulation server
(:mod:`fpgaccl.sim.server`: the standard 4-node, 64-bit cluster of full HDL nodes =
``hw/node.py`` joined by the hardware switch) and hands each rank its Unix socket in
``FPGACCL_SIM_SOCKET``. ``Communicator(rank, world, backend="sim")`` (or
``fpgaccl.init()`` under ``--backend sim``) connects and claims node ``rank``; from then
on it is the register-driven backend (:mod:`.registers`) over a :class:`ClusterPort`:
each segment goes to the server as the program's register writes plus the IN bytes, and
the server returns OUT as the HDL engine wrote it. Results are bit-identical to the
software backend whenever both cut the same segments: always for vectors that fit one
segment (``stage_bytes``, 1 MiB here, less the chunk padding), and for any size when the
software communicator is given the same ``stage_bytes``.

Limits: world_size <= 4 (the standard cluster), programs up to the engine's 256
instruction-memory words, and only calls with a library program: host schedules (the
``tree`` algorithms, alltoallv's ``direct``) raise UnsupportedError. alltoallv runs as
``padded`` (the alltoall program), barrier as its program, send/recv as the two-rank
``p2p_send``/``p2p_recv`` programs, which the server starts as each end asks (a send
completes once its receiver's program runs). IN and OUT travel
through the memory backdoor one 64-bit word per clock, driven from Python (roughly
10-30k words per wall second): keep simulated collectives to a few thousand elements
per call. Calls run in order on the communicator's own thread (:mod:`.registers`).

Sub-communicators (``comm.split``): each member opens another connection to the server
and sends ``join`` as its node in the new communicator (``nodes``: the node of each of its
ranks, ``comm``: a name the members agreed on); its programs name peers by node, and the
server starts its collectives once every member has made them and their nodes are free.
A mixed world's simulated ranks cannot split.

Mixed runs (``fpgaccl run -n 4 --sim-ranks 2,3``): the ranks listed drive simulated
nodes, the others run the software backend, and all of them make one world. A simulated
rank then also takes part in the software ranks' TCP rendezvous (MASTER_ADDR/PORT),
advertising its node as a software engine advertises itself: the node's IP (the
loopback address the rank would have bound on the software backend), port 4791, QPN
``0x100 + peer``, its PSNs, and its memory key and IN/OUT/TMP/TMP2 addresses. The server
programs the node from the table and bridges the switch ports of the software ranks to
their UDP sockets (:mod:`fpgaccl.sim.bridge`). Both backends cut the same segments
(``stage_bytes``: the smallest advertised) with the same ``coll_id`` numbers, so a
collective spans both. Only library programs cross (barrier is one; alltoallv must be
``algo="padded"`` on every rank); send/recv and the host schedules (``tree``) raise
UnsupportedError on the simulated ranks.

Requests (frames of :mod:`fpgaccl.proto.framing`): ``hello {node, world}``,
``collective {seq, coll_id, name, count, dtype, writes, out_bytes}`` + IN bytes,
``barrier {seq}``, ``join {node, nodes, comm}``, ``stats``, ``shutdown``, and for mixed
runs ``hello {node, world, sim_ranks, ip}`` and ``connect {table}``; replies carry ``ok``
or ``error``/``detail``.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
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
from fpgaccl.proto.framing import connect_unix, encode, recv_frame
from fpgaccl.proto.opcodes import ROCEV2_UDP_PORT
from fpgaccl.proto.plans import QPN_BASE, Writes
from fpgaccl.proto.regmap import default_map
from fpgaccl.proto.signature import Signature

from ..executor import mismatch_error
from ..rendezvous import bind_ip, exchange, is_loopback, master
from .registers import RegisterBackend, node_mismatch

SOCKET_ENV = "FPGACCL_SIM_SOCKET"
SIM_RANKS_ENV = "FPGACCL_SIM_RANKS"
"""Mixed runs: the comma-separated ranks that drive simulated nodes."""
SIM_MAX_NODES = 4
"""Nodes of the standard cluster (:func:`fpgaccl.sim.hdl.cluster.build_standard`)."""


class ClusterPort:
    """Node ``rank`` of the simulation server's cluster, reached over its Unix socket."""

    native_barrier = True

    def __init__(self, rank: int, world_size: int, *, sim_socket: str | None,
                 stage_bytes: int, timeout_s: float, sim_ranks: list[int] | None,
                 master_addr: str | None, master_port: int | None) -> None:
        path = sim_socket or os.environ.get(SOCKET_ENV)
        if not path:
            raise BackendUnavailableError(
                f"backend 'sim' needs a simulation server: start the ranks with "
                f"`fpgaccl run -n N --backend sim -- ...` or set {SOCKET_ENV}")
        self.rank, self.world_size, self.sim_ranks = rank, world_size, sim_ranks
        hello: dict[str, Any] = {"op": "hello", "node": rank, "world": world_size}
        if sim_ranks is not None:
            host, port = master(master_addr, master_port)
            if os.environ.get("FPGACCL_BIND_IP") is None and not is_loopback(host):
                raise UnsupportedError("sim_ranks", "mixed runs bridge simulated nodes "
                                       "to software ranks on this host only (loopback)")
            hello.update(sim_ranks=sim_ranks, ip=bind_ip(rank, host, port))
        self._connect(path, timeout_s)
        try:
            head, _ = self._call(hello, b"", "init", timeout_s)
            if sim_ranks is not None:
                stage_bytes = self._join(head, hello["ip"], host, port, timeout_s)
        except BaseException:
            self._sock.close()
            raise
        self._configure(head, stage_bytes)

    @property
    def can_split(self) -> bool:
        # A mixed world's software ranks would need engines of the nodes' own.
        return self.sim_ranks is None

    def open_sub(self, node: int, nodes: list[int], comm: str) -> ClusterPort:
        """Node ``node`` again, as a member of the sub-communicator ``comm`` whose ranks
        are ``nodes``: a connection of its own, whose calls the server starts once every
        member has made them and their nodes are free."""
        sub = ClusterPort.__new__(ClusterPort)
        sub.rank, sub.world_size, sub.sim_ranks = node, len(nodes), None
        sub._connect(self._path, self._timeout_s)
        try:
            head, _ = sub._call({"op": "join", "node": node, "nodes": nodes, "comm": comm},
                                b"", "split", self._timeout_s)
        except BaseException:
            sub._sock.close()
            raise
        sub._configure(head, self.stage_bytes)
        return sub

    def _connect(self, path: str, timeout_s: float) -> None:
        self._path, self._timeout_s = path, timeout_s
        self._broken = False
        self._lock = threading.Lock()
        self._seq = 0
        self._sock = connect_unix(path, timeout_s, "simulation server")

    def _configure(self, head: dict, stage_bytes: int) -> None:
        self.nodes = head["nodes"]
        self.clock_mhz = 1000 / head.get("clock_ns", 4)
        stage_bytes = min(int(stage_bytes), int(head["stage_bytes"]))
        self.stage_bytes = max(4096, stage_bytes - stage_bytes % 4096)
        self.buffers = [int(b) for b in head["buffers"]]
        self.imem_words = int(head["imem_words"])
        self.rmap = default_map(qps=int(head["qps"]), imem_words=self.imem_words)

    def _join(self, head: dict, ip: str, master_addr: str, master_port: int,
              timeout: float) -> int:
        """Mixed runs: the software ranks' rendezvous, on behalf of this rank's node, then
        the node's connection from the table. Returns the world's segment size."""
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

    def _call(self, header: dict, payload: bytes, name: str, timeout: float
              ) -> tuple[dict, bytes]:
        with self._lock:
            if self._broken:
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
            regs = {self.rmap.address(f"coll.{r}"): v
                    for r, v in head.get("registers", {}).items()}
            if (e := node_mismatch(self.rmap, head.get("status", {"error": 0}),
                                   regs.__getitem__)) is not None:
                raise e
            raise TransportError(f"rank {self.rank}: {detail}")
        if err == "mismatch":
            raise CountMismatchError("count", detail)
        if err == "signature":
            a, b = (Signature.unpack(bytes.fromhex(r)) for r in head["records"])
            raise mismatch_error(a, b)
        if err in ("world_size", "rank"):
            raise UnsupportedError(err, detail)
        raise BackendUnavailableError(f"simulation server: {err}: {detail}")

    def _fail(self) -> None:
        # The stream may be out of step now: nothing more can go over it.
        self._broken = True
        with contextlib.suppress(OSError):
            self._sock.close()

    def _next_seq(self) -> int:
        with self._lock:
            self._seq += 1
            return self._seq

    # ------------------------------------------------------------------ NodePort
    def execute(self, name: str, coll_id: int, writes: Writes, inbuf: bytes,
                out_bytes: int, signature: dict[str, Any], deadline_s: float
                ) -> tuple[bytes, int]:
        if signature.get("group") is not None and self.sim_ranks is not None:
            raise UnsupportedError("dst" if name == "send" else "src", "send/recv in a "
                                   "world that mixes backends: the software ranks' are "
                                   "host schedules, the simulated nodes' programs")
        # Two-rank programs (send/recv) start at once, outside the world's sequence.
        seq = None if signature.get("group") is not None else self._next_seq()
        head, out = self._call(
            {"op": "collective", "seq": seq, "coll_id": coll_id & 0xFFFF,
             **signature, "writes": writes, "out_bytes": out_bytes},
            inbuf, name, deadline_s)
        return out, int(head["cycles"])

    def barrier(self, deadline_s: float) -> None:
        if self.sim_ranks is not None:
            raise UnsupportedError("barrier", "a mixed world's barrier would need the "
                                   "software ranks' ring schedule, which the simulated "
                                   "nodes lack; a one-element allreduce synchronises")
        self._call({"op": "barrier", "seq": self._next_seq()}, b"", "barrier", deadline_s)

    def summary(self, timeout_s: float) -> dict[str, Any]:
        """The server's run summary so far (cycles, frames dropped, drops, retransmits)."""
        head, _ = self._call({"op": "stats"}, b"", "stats", timeout_s)
        head.pop("ok", None)
        return head

    def _node(self, s: dict[str, Any]) -> dict[str, Any]:
        # A mixed run's summary lists the simulated ranks' nodes only.
        return next(n for n in s["per_node"] if n["node"] == self.rank)

    def drop_counters(self) -> dict[str, int]:
        return dict(self._node(self.summary(60.0))["drops"])

    def stats(self) -> dict[str, int]:
        s = self.summary(60.0)
        return {"cycles": s["cycles"], "retransmits": self._node(s)["retransmits"],
                "switch_dropped": s["switch_dropped"]}

    def close(self) -> None:
        self._broken = True
        with contextlib.suppress(OSError):
            self._sock.close()


def open_sim(rank: int, world_size: int, *, sim_socket: str | None = None,
             stage_bytes: int | None = None, rendezvous_timeout_s: float = 600.0,
             pcap: Any = None, impair: Any = None, sim_ranks: Any = None,
             master_addr: str | None = None, master_port: int | None = None,
             **_software_only: Any) -> RegisterBackend:
    """The ``sim`` backend for ``rank`` (options the software engine alone has are
    accepted and have no effect, so one ``fpgaccl.init()`` serves every backend)."""
    from fpgaccl.sim.server import SIM_STAGE_BYTES
    if world_size > SIM_MAX_NODES:
        raise UnsupportedError("world_size", f"{world_size} ranks; the simulated cluster "
                               f"has {SIM_MAX_NODES} nodes")
    if impair:
        raise UnsupportedError("impair", "the sim backend's links are the HDL switch's "
                               "(its loss register), not host-side impairments")
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
    port = ClusterPort(rank, world_size, sim_socket=sim_socket,
                       stage_bytes=SIM_STAGE_BYTES if stage_bytes is None else stage_bytes,
                       timeout_s=rendezvous_timeout_s, sim_ranks=sim_ranks,
                       master_addr=master_addr, master_port=master_port)
    return RegisterBackend("sim", rank, world_size, port, barrier_at_close=False)
