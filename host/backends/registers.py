"""The register-driven backend: the runtime programs an HDL engine through its registers
and memory, one segment at a time. The simulated cluster (``sim``) and a board
(``board``) are this one backend; what differs is only the :class:`NodePort`, i.e. how
register writes, IN and OUT reach the engine and how a run is started and awaited.

Per segment: the program and its context as register writes
(:func:`fpgaccl.proto.plans.collective_writes`), IN stored into the engine's IN, the run
started and awaited, OUT read back. Programs, segments and ``coll_id`` numbers are the
Communicator's, as on the software backend, so results are bit-identical to it.
Calls run in order on the communicator's own thread (:mod:`.serial`), so calls on
several communicators may be issued in any order; the engine's memory is not the
caller's, so a bound result array is filled through ``put_out`` like any other.

Sub-communicators (where the port can open one: the simulated cluster) reach the same
engines: an engine has a queue pair per node of the world, so a sub-communicator's
programs name their peers by node (``nodes``: the node of each of its ranks) and the
port's server runs each engine's programs one at a time.
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, Protocol

import numpy as np

from fpgaccl.errors import UnsupportedError
from fpgaccl.proto import programs as lib
from fpgaccl.proto.isa import PEER_OPS, Buf, Instr, assemble
from fpgaccl.proto.plans import Writes, collective_writes
from fpgaccl.proto.reduce import DType, ReduceOp
from fpgaccl.proto.regmap import RegisterMap, StopCause
from fpgaccl.proto.signature import Signature

from ..executor import digest_mismatch_error
from .base import Finished, Pending, Program, ProgramRun, Segment
from .serial import SerialCalls


class NodeMismatch(Exception):
    """What a :class:`NodePort` raises when its node stopped the program on a signature
    mismatch (``ctrl.status.cause`` :attr:`StopCause.SIGNATURE`): the peer (rank) whose
    GRANT carried another digest, and that digest. The backend turns it into the
    :class:`~fpgaccl.errors.CollectiveMismatchError` the software backend raises."""

    def __init__(self, peer: int, digest: int) -> None:
        super().__init__(f"rank {peer} granted with signature digest {digest:#x}")
        self.peer = peer
        self.digest = digest


def node_mismatch(rmap: RegisterMap, status: dict[str, int],
                  read: Callable[[int], int]) -> NodeMismatch | None:
    """The :class:`NodeMismatch` a decoded ``ctrl.status`` stands for, reading the
    latched peer and digest through ``read(address)``; None for any other status."""
    if not status["error"] or status["cause"] != StopCause.SIGNATURE:
        return None
    peer = rmap["coll"]["mismatch_peer"].decode(read(rmap.address("coll.mismatch_peer")))
    digest = read(rmap.address("coll.peer_sig_lo")) | read(rmap.address("coll.peer_sig_hi")) << 32
    return NodeMismatch(peer["peer"], digest)


class NodePort(Protocol):
    """How a register-driven backend reaches its engine."""

    clock_mhz: float
    rmap: RegisterMap
    imem_words: int
    buffers: Sequence[int]
    """The engine's addresses of IN, OUT, TMP and TMP2 (the program's context)."""
    stage_bytes: int
    native_barrier: bool
    """Whether :meth:`barrier` is the port's own; otherwise the backend synchronises
    with a one-element allreduce."""

    def execute(self, name: str, coll_id: int, writes: Writes, inbuf: bytes,
                out_bytes: int, signature: dict[str, Any], deadline_s: float
                ) -> tuple[bytes, int]:
        """Load ``writes``, store IN, run ``coll_id`` to completion; (OUT, cycles)."""

    def barrier(self, deadline_s: float) -> None: ...

    def drop_counters(self) -> dict[str, int]: ...

    def stats(self) -> dict[str, int]: ...

    def close(self) -> None: ...

    # Optional: ``can_split`` (bool) and ``open_sub(node, nodes, comm)`` -> a NodePort of
    # node ``node`` in the sub-communicator named ``comm`` whose ranks are ``nodes``.


class StagingArea:
    """Host memory holding one segment's IN/OUT/TMP/TMP2, as the software region's
    ``view`` lays them out (so the Communicator gathers blocked IN the same way)."""

    def __init__(self, stage_bytes: int) -> None:
        self.stage_bytes = stage_bytes
        self.mem = np.zeros(4 * stage_bytes, np.uint8)

    def view(self, buf: Buf, dtype: Any, count: int) -> np.ndarray:
        dt = np.dtype(dtype)
        off = int(buf) * self.stage_bytes
        return self.mem[off:off + count * dt.itemsize].view(dt)


class RegisterBackend:
    """A :class:`~fpgaccl.host.backends.base.Backend` over a :class:`NodePort`."""

    host_schedules = False
    p2p_programs = True

    def __init__(self, name: str, rank: int, world_size: int, port: NodePort, *,
                 barrier_at_close: bool, nodes: Sequence[int] | None = None) -> None:
        self.name, self.rank, self.world_size = name, rank, world_size
        self.port = port
        self.barrier_at_close = barrier_at_close
        self.nodes = None if nodes is None else tuple(nodes)
        """The node of each rank (a sub-communicator's); None: rank k is node k."""
        self.clock_mhz = port.clock_mhz
        self.stage_bytes = port.stage_bytes
        self.staging = StagingArea(port.stage_bytes)
        self.last_cycles = 0
        self.total_cycles = 0
        self._calls = SerialCalls(f"fpgaccl-{name}-rank{rank}")
        self._port_lock = threading.Lock()   # the caller's stats beside the calls' runs
        if getattr(port, "can_split", False):
            self.split_backend = self._split_backend

    def _node(self, rank: int) -> int:
        return rank if self.nodes is None else self.nodes[rank]

    def _on_nodes(self, program: Sequence[Instr]) -> list[Instr]:
        if self.nodes is None:
            return list(program)
        return [replace(i, peer=self.nodes[i.peer]) if i.op in PEER_OPS else i
                for i in program]

    def run(self, run: ProgramRun, deadline_s: float) -> Pending:
        words = len(assemble(run.program))
        if words > self.port.imem_words:
            raise UnsupportedError("count", f"{run.name}'s program for this size needs {words} "
                                   f"instruction words; the engine holds {self.port.imem_words}")
        return self._calls.submit(run.name, deadline_s, lambda: self._run(run, deadline_s))

    def _run(self, run: ProgramRun, deadline_s: float) -> None:
        port = self.port
        program = self._on_nodes(run.program)
        dt = run.np_dtype
        self.last_cycles = 0
        digest = 0 if run.signature is None else run.signature.digest
        for s in run.segments:
            writes = collective_writes(port.rmap, program, buffers=port.buffers,
                                       count=s.count, dtype=run.dtype, op=run.op,
                                       digest=digest)
            inbuf = np.ascontiguousarray(run.get_in(s.lo, s.hi))
            sig: dict[str, Any] = {"name": run.name, "count": s.count, "dtype": dt.str}
            if run.signature is not None:
                sig["signature"] = run.signature.pack().hex()
            if run.peers is not None:
                sig["group"] = [self._node(p) for p in run.peers]
            try:
                with self._port_lock:
                    out, cycles = port.execute(run.name, s.coll_id, writes, inbuf.tobytes(),
                                               s.count * dt.itemsize, sig, deadline_s)
            except NodeMismatch as e:
                # Nothing reached the caller's buffers: OUT is put only after a run. The
                # node names the peer by its queue pair, i.e. by node.
                peer = e.peer if self.nodes is None else self.nodes.index(e.peer)
                raise digest_mismatch_error(self.rank, digest, peer, e.digest) from None
            self.last_cycles += cycles
            run.put_out(np.frombuffer(out, dt, s.count), s.lo, s.hi)
        self.total_cycles += self.last_cycles

    def schedule(self, name: str, body: Callable[[Any], Program], coll_id: int,
                 deadline_s: float, signature: Signature | None = None,
                 counts: tuple[Sequence[int], Sequence[int]] | None = None, *,
                 blocking: bool = False) -> Finished:
        raise UnsupportedError("algo", f"{name}: the {self.name} backend runs sequencer "
                               "programs only; host schedules have none")

    def send(self, peer: int, seq: int, data: np.ndarray, deadline_s: float, *,
             blocking: bool = False) -> Finished:
        raise UnsupportedError("dst", f"the {self.name} backend sends with the p2p_send "
                               "program (Communicator.send), not a host schedule")

    def recv(self, peer: int, seq: int, out: np.ndarray, deadline_s: float, *,
             blocking: bool = False) -> Finished:
        raise UnsupportedError("src", f"the {self.name} backend receives with the p2p_recv "
                               "program (Communicator.recv), not a host schedule")

    def barrier(self, coll_id: int, deadline_s: float) -> Pending:
        if self.port.native_barrier:
            def enter() -> None:
                with self._port_lock:
                    self.port.barrier(deadline_s)
            return self._calls.submit("barrier", deadline_s, enter)
        # A one-element allreduce returns once every rank has entered.
        one = np.zeros(1, np.int32)
        out = np.empty(1, np.int32)

        def put_out(res: np.ndarray, lo: int, hi: int) -> None:
            out[lo:hi] = res

        program = tuple(lib.rd_allreduce(self.rank, self.world_size))
        return self.run(ProgramRun("barrier", program, DType.INT32, one.dtype, ReduceOp.SUM,
                                   [Segment(coll_id, 0, 1, 1)], lambda lo, hi: one[lo:hi],
                                   put_out), deadline_s)

    def drop_counters(self) -> dict[str, int]:
        with self._port_lock:
            return self.port.drop_counters()

    def stats(self) -> dict[str, int]:
        with self._port_lock:
            port = self.port.stats()
        return {**port, "last_cycles": self.last_cycles, "total_cycles": self.total_cycles}

    def _split_backend(self, rank: int, world_size: int,
                       rendezvous: Callable[[dict], list[dict]]) -> RegisterBackend:
        """A sub-communicator over the same engines: the members tell each other their
        nodes, and take its new rank 0's random token as the communicator's name."""
        records = rendezvous({"node": self._node(self.rank), "token": secrets.token_hex(8)})
        nodes = [int(r["node"]) for r in records]
        port = self.port.open_sub(nodes[rank], nodes,  # type: ignore[attr-defined]
                                  records[0]["token"])
        return RegisterBackend(self.name, rank, world_size, port,
                               barrier_at_close=self.barrier_at_close, nodes=nodes)

    def abort(self, error_of: Callable[[str], BaseException]) -> None:
        """Fail the queued calls and the one running with ``error_of(its name)`` at once:
        the port is closed under it."""
        self._calls.stop(error_of, wait=False)
        self.port.close()

    def close(self, linger_s: float | None = None) -> None:
        self._calls.stop()      # the calls issued before run first
        self.port.close()
