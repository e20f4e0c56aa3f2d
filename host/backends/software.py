"""The ``software`` backend: the engine in Python, numpy and C, real RoCEv2 over UDP.

Each rank binds UDP 4791 on an address of its own, creates one RC queue pair per peer,
exchanges QP numbers, PSNs, addresses and keys at the TCP rendezvous, and then runs the
Communicator's programs with :func:`fpgaccl.host.executor.execute` on its engine
thread; host schedules and point-to-point transfers go over the per-peer rings.
"""

from __future__ import annotations

import contextlib
import socket
import warnings
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fpgaccl.proto.drops import DropReason
from fpgaccl.proto.isa import Buf
from fpgaccl.proto.opcodes import ROCEV2_UDP_PORT
from fpgaccl.proto.signature import Signature

from .. import algorithms as alg
from .. import wire
from ..engine import (
    PEER_TIMEOUT_S,
    RETRY_LIMIT,
    SOCKET_BUFFER_BYTES,
    Engine,
    Job,
    software_window,
)
from ..executor import DEFAULT_STAGE_BYTES, CollectiveRegion, SignatureCheck, execute
from ..link import ImpairedLink
from ..pcap import PcapWriter
from ..rendezvous import bind_ip as choose_bind_ip
from ..rendezvous import exchange, master
from ..schedule_check import ScheduleCheck
from .base import Program, ProgramRun


class _Refused(deque):
    """The job queue of an aborted engine: what a racing call submits fails at once."""

    def __init__(self, error_of: Callable[[str], BaseException]) -> None:
        super().__init__()
        self._error_of = error_of

    def append(self, job: Job) -> None:
        job.finish(self._error_of(job.name))


class SoftwareBackend:
    """One rank's software engine, connected to every peer."""

    name = "software"
    host_schedules = True
    p2p_programs = False  # send/recv are host schedules here
    clock_mhz = None

    def __init__(self, rank: int, world_size: int, *, master_addr: str | None = None,
                 master_port: int | None = None, bind_ip: str | None = None,
                 mtu: int = 4096, rto_s: float = 0.05,
                 impair: str | ImpairedLink | None = None, pcap: str | Path | None = None,
                 slot_bytes: int = 256 * 1024, slots: int = 8,
                 initial_psn: int | None = None, rendezvous_timeout_s: float = 60.0,
                 stage_bytes: int = DEFAULT_STAGE_BYTES,
                 socket_buffer_bytes: int = SOCKET_BUFFER_BYTES,
                 peer_timeout_s: float | None = PEER_TIMEOUT_S,
                 retry_limit: int | None = RETRY_LIMIT, port: int = ROCEV2_UDP_PORT,
                 rendezvous: Callable[[dict], list[dict]] | None = None) -> None:
        """``port``: the UDP port the engine binds (0: one the kernel picks; a
        sub-communicator's engine shares its parent's address). ``rendezvous``: a
        function from this rank's record to every rank's, instead of the TCP rendezvous
        on ``master_addr``/``master_port`` (a split agrees through its parent)."""
        self.rank, self.world_size = rank, world_size
        # What a sub-communicator's engine is built with (:meth:`split_backend`).
        self._options: dict[str, Any] = dict(
            mtu=mtu, rto_s=rto_s, impair=impair if isinstance(impair, str) else None,
            slot_bytes=slot_bytes, slots=slots, rendezvous_timeout_s=rendezvous_timeout_s,
            stage_bytes=stage_bytes, socket_buffer_bytes=socket_buffer_bytes,
            peer_timeout_s=peer_timeout_s, retry_limit=retry_limit)
        master_addr, master_port = master(master_addr, master_port)
        bind_ip = choose_bind_ip(rank, master_addr, master_port, bind_ip)
        if isinstance(impair, str):
            impair = ImpairedLink.parse(impair, seed=rank)
        self.link = impair
        self._pcap = PcapWriter(pcap) if pcap else None
        try:
            self.engine = Engine(rank, bind_ip, port=port, mtu=mtu, slot_bytes=slot_bytes,
                                 slots=slots, rto_s=rto_s, link=impair,
                                 tap=self._pcap.tap if self._pcap else None,
                                 socket_buffer_bytes=socket_buffer_bytes,
                                 peer_timeout_s=peer_timeout_s, retry_limit=retry_limit)
        except BaseException:
            self._close_pcap()
            raise
        try:
            self._connect(master_addr, master_port, initial_psn, stage_bytes,
                          rendezvous_timeout_s, socket_buffer_bytes, rendezvous)
            self.engine.start()
        except BaseException:
            # A world that did not form: its sockets and address go back at once, so
            # that this process may try again. The first error is the one to see.
            with contextlib.suppress(Exception):
                self.engine.stop()
            self._close_pcap()
            raise

    def _connect(self, master_addr: str, master_port: int, initial_psn: int | None,
                 stage_bytes: int, timeout_s: float, socket_buffer_bytes: int,
                 rendezvous: Callable[[dict], list[dict]] | None) -> None:
        rank, world_size, engine = self.rank, self.world_size, self.engine
        rng = np.random.default_rng()
        psn0 = {}
        qps = {}
        for peer in range(world_size):
            if peer == rank:
                continue
            qp = engine.create_qp(peer)
            psn0[peer] = (int(rng.integers(0, wire.PSN_MOD)) if initial_psn is None
                          else initial_psn & wire.PSN_MASK)
            qps[str(peer)] = {"qpn": qp.qpn, "psn": psn0[peer], "va": qp.ring.va,
                              "rkey": qp.ring.rkey}
        self.region = CollectiveRegion(engine, stage_bytes)
        engine.plan_rx(world_size - 1)
        info = {"ip": engine.addr[0], "port": engine.addr[1], "qps": qps,
                "coll": self.region.info(), "backend": "software",
                "rcvbuf": engine.rcvbuf, "gro": engine.gro, "rx_per_peer": engine.rx_per_peer}
        if rendezvous is not None:
            table = rendezvous(info)
        else:
            table = exchange(rank, world_size, (socket.gethostbyname(master_addr),
                                                master_port), info, timeout_s)
        for peer, qp in engine.by_peer.items():
            theirs = table[peer]["qps"][str(rank)]
            software = table[peer].get("backend") == "software"
            # The one port the peer sends from: a software engine's bound port, an HDL
            # node's per-QP source port.
            qp.connect(remote_qpn=theirs["qpn"], addr=(table[peer]["ip"], table[peer]["port"]),
                       local_ip=engine.addr[0], send_psn=psn0[peer],
                       recv_psn=theirs["psn"], remote_va=theirs["va"],
                       remote_rkey=theirs["rkey"],
                       peer_sport=(table[peer]["port"] if software
                                   else wire.hdl_sport(theirs["qpn"])))
            if software:
                qp.ack_delay = engine.ack_delay_s
                qp.selective = True  # it holds early packets (proto/reliability.py)
        engine.open_peer_sockets()
        # Only software peers: a bigger send window (an HDL node's receive path has no
        # socket buffer to absorb one).
        if all(t.get("backend") == "software" for t in table):
            engine.window = max(engine.window, software_window(engine.mtu))
        else:
            # A simulated node's clock runs far slower than the wall clock: its silence
            # says nothing of its liveness (the deadline still bounds a call's waits).
            engine.peer_timeout_s = None
        peers = [(int(t["rcvbuf"]), bool(t.get("gro")), bool(t.get("rx_per_peer")))
                 for p, t in enumerate(table) if p != rank and "rcvbuf" in t]
        smallest = min((b for b, _, _ in peers), default=0)
        if engine.fit_window(peers, world_size - 1) and rank == 0 and \
                smallest < 2 * socket_buffer_bytes:
            # Smaller buffers than this rank asked for: a kernel cap (or a peer's choice).
            warnings.warn(
                f"fpgaccl: the smallest UDP receive buffer of the world "
                f"({smallest // 2} bytes granted, {socket_buffer_bytes} asked "
                f"for) holds a send window of only {engine.window * engine.mtu} "
                "bytes per peer, which slows large collectives. The kernel grants at most "
                f"net.core.rmem_max: `sysctl -w net.core.rmem_max={socket_buffer_bytes}`, or "
                "CAP_NET_ADMIN, lifts that cap", RuntimeWarning, stacklevel=4)
        self.peers = [(t["ip"], t["port"]) for t in table]
        # Signatures travel in receive rings: only software peers have them.
        self.software_peers = frozenset(p for p, t in enumerate(table)
                                        if p != rank and t.get("backend") == "software")
        self.remotes = {p: CollectiveRegion.remote(table[p]["coll"])
                        for p in range(world_size) if p != rank}
        # Every rank cuts the same segments: from the smallest region of the world.
        self.stage_bytes = min(int(t["coll"]["stage_bytes"]) for t in table)

    def split_backend(self, rank: int, world_size: int,
                      rendezvous: Callable[[dict], list[dict]]) -> SoftwareBackend:
        """A new engine for ``rank`` of a sub-communicator of ``world_size`` ranks: its
        own UDP port on this engine's address, its own queue pairs, keys and PSNs, with
        this engine's options (no pcap; an ``impair`` given as an object is not shared
        between engine threads, one given as a string is parsed again)."""
        return SoftwareBackend(rank, world_size, bind_ip=self.engine.addr[0], port=0,
                               rendezvous=rendezvous, **self._options)

    @property
    def staging(self) -> CollectiveRegion:
        return self.region

    @property
    def barrier_at_close(self) -> bool:
        # The barrier is a host schedule: HDL peers (sim, board) have no program for it.
        return self.engine.failed is None and \
            len(self.software_peers) == self.world_size - 1

    # ------------------------------------------------------------------ calls
    def run(self, run: ProgramRun, deadline_s: float) -> Job:
        engine, region, remotes, rank = self.engine, self.region, self.remotes, self.rank
        bind = run.bind

        software = self.software_peers

        def job() -> Program:
            sig = None
            if run.signature is not None and run.segments:
                # One record for the whole call: segments after the first agree if it does.
                sig = SignatureCheck(engine, run.signature, run.program,
                                     run.segments[0].coll_id, software,
                                     [s.coll_id for s in run.segments])
            try:
                for s in run.segments:
                    direct = None if bind is None else bind[s.lo:s.hi]
                    yield from execute(engine, region, remotes, run.program, rank=rank,
                                       coll_id=s.coll_id, count=s.count, dtype=run.dtype,
                                       op=run.op, inbuf=run.get_in(s.lo, s.hi), outbuf=direct,
                                       check_lengths=run.check_lengths, signatures=sig)
                    if direct is None:
                        run.put_out(region.view(Buf.OUT, run.np_dtype, s.count), s.lo, s.hi)
            except GeneratorExit:
                # The transport failed under the call (a peer that raised the same
                # mismatch and left): a mismatch already known is still what to report.
                if sig is not None and sig.notice() is not None:
                    raise sig.error from None
                raise
            finally:
                if sig is not None and sig.error is not None:
                    engine.forget_calls(s.coll_id for s in run.segments)

        return engine.submit(run.name, job(), deadline_s, blocking=run.blocking)

    def schedule(self, name: str, body: Callable[[alg.Ctx], Program], coll_id: int,
                 deadline_s: float, signature: Signature | None = None,
                 counts: tuple[Sequence[int], Sequence[int]] | None = None, *,
                 blocking: bool = False) -> Job:
        engine = self.engine
        ctx = alg.Ctx(engine, self.rank, self.world_size, coll_id)
        if signature is None:
            return engine.submit(name, body(ctx), deadline_s, blocking=blocking)

        def job() -> Program:
            # Built on the engine thread, which alone posts to the queue pairs.
            ctx.check = ScheduleCheck(engine, coll_id, signature, self.world_size,
                                      self.software_peers, counts)
            yield from ctx.check.run(body(ctx))

        return engine.submit(name, job(), deadline_s, blocking=blocking)

    def send(self, peer: int, seq: int, data: np.ndarray, deadline_s: float, *,
             blocking: bool = False) -> Job:
        engine = self.engine

        def job() -> Program:
            yield engine.send(peer, seq, wire.STEP_P2P, memoryview(data.view(np.uint8)))

        return engine.submit("send", job(), deadline_s, ordered=False, blocking=blocking)

    def recv(self, peer: int, seq: int, out: np.ndarray, deadline_s: float, *,
             blocking: bool = False) -> Job:
        engine = self.engine

        def job() -> Program:
            yield engine.recv(peer, seq, wire.STEP_P2P, out, None, "buf")

        return engine.submit("recv", job(), deadline_s, ordered=False, blocking=blocking)

    def barrier(self, coll_id: int, deadline_s: float) -> Job:
        return self.schedule("barrier", alg.barrier_dissemination, coll_id, deadline_s)

    # ------------------------------------------------------------------ introspection
    def drop_counters(self) -> dict[str, int]:
        return {r.name: self.engine.drops[r] for r in DropReason}

    def stats(self) -> dict[str, int]:
        out = dict(self.engine.stats)
        if self.link is not None:
            out.update({f"link_{k}": v for k, v in self.link.stats.items()})
        return out

    def close(self, linger_s: float | None = None) -> None:
        """Keep answering retransmissions briefly, then stop the engine."""
        linger = max(0.05, 4 * self.engine.rto_s) if linger_s is None else linger_s
        if self.world_size > 1:
            self.engine.idle_for(linger)
        self.engine.stop()
        self._close_pcap()

    def abort(self, error_of: Callable[[str], BaseException]) -> None:
        """Stop the engine at once (its ports are free when this returns), then fail
        every call still queued or running with ``error_of(its name)``: with the engine
        thread gone, nothing else touches the jobs."""
        engine = self.engine
        engine.failed = engine.failed or error_of("communicator")  # later submissions
        jobs = engine.jobs
        queued, jobs.submitted = jobs.submitted, _Refused(error_of)
        engine.stop()
        jobs.close_running(lambda job: error_of(job.name))
        while queued:
            job = queued.popleft()
            job.finish(error_of(job.name))
        self._close_pcap()

    def _close_pcap(self) -> None:
        if self._pcap is not None:
            self._pcap.close()
