"""The software offload engine: one UDP socket on port 4791, queue pairs, a sequencer.

A single engine thread owns all transport state (as the hardware's pipelines do), so
nothing in the data path takes a lock. The host thread hands it *programs* (generators: the
sequencer executor of :mod:`fpgaccl.host.executor` running a :mod:`fpgaccl.proto.programs`
program, or a schedule of :mod:`fpgaccl.host.algorithms`) through a queue
and a wake-up socket, then waits on the program's :class:`Job`. Programs run one after
another in submission order, which every rank shares, like a hardware command queue.

The engine's jobs live in modules of their own, which it holds: :mod:`.udp` (sockets,
batched sends), :mod:`.receive` (checks and dispatch of what arrives, ``fp_bulk``),
:mod:`.jobs` (the submitted programs and their deadlines) and :mod:`.matching` (posted
receives). The engine itself wires them to its queue pairs and runs the loop.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from fpgaccl.errors import InvalidArgumentError, PeerDeadError, TransportError
from fpgaccl.proto.drops import DropReason
from fpgaccl.proto.opcodes import ROCEV2_UDP_PORT
from fpgaccl.proto.plans import QPN_BASE

from . import native, wire
from .alarm import make_alarm
from .jobs import SEQUENCE_POLL_S, Job, Jobs, Latch, Program
from .matching import Matcher
from .qp import Completion, MemoryRegion, Message, QueuePair, RowPool
from .receive import Receiver
from .udp import SOCKET_BUFFER_BYTES, SocketError, Udp, packets_that_fit

VALID_MTUS = (256, 512, 1024, 2048, 4096, 9000)
JUMBO_PAYLOAD = 8192
"""Payload per packet for the 9000-byte jumbo MTU: the largest power of two whose
datagram (IPv4 + UDP + BTH + RETH + ImmDt + ICRC) fits in 9000 bytes."""

ACK_DELAY_S = 0.002
SOFTWARE_WINDOW_BYTES = 1 << 20
"""Send window when every peer is a software engine: three peers at once fit its 4 MiB
socket buffer, and on a shared CPU a descheduled receiver then stalls its sender less.
A peer whose socket buffer is smaller gets less (:meth:`Engine.fit_window`)."""
SOFTWARE_WINDOW_PACKETS = 256
"""...and at most this many packets: a receiver's cost is per packet, so below a 4 KiB
MTU a 1 MiB window only queues. At a 1 KiB MTU, 1024 packets in flight made the round
trip 3-15 ms and each loss's repair wait as long (bench/loss.py; 256: 0.5-1 ms)."""


def software_window(mtu: int) -> int:
    """The send window toward software peers, in packets of ``mtu``."""
    return min(SOFTWARE_WINDOW_BYTES // mtu, SOFTWARE_WINDOW_PACKETS)
MIN_WINDOW = 8
"""Packets: the smallest send window a constructor gives (a fitted one may be smaller)."""
PEER_TIMEOUT_S = 1.25
"""A peer that ACKs nothing of what is outstanding to it (or answers no probe) for this
long is dead. Counted only while it owes an ACK: a slow peer that ACKs anything is never
dead, however long the call. A waiting job probes, every ``PEER_TIMEOUT_S / 5``, each
peer it has not heard from for that long, so a killed rank is found by every other one
within about 1.8 s."""
RETRY_LIMIT = 7
"""Retransmit-timer expiries without an ACK that moves the window before the queue pair
fails (the HDL requester's ``max_retries``), where ``peer_timeout_s`` is None: with a
peer timeout that judges the silence, and the backoff is capped so that it spans
:data:`~fpgaccl.host.qp.TRIES_PER_PEER_TIMEOUT` tries."""
LIVENESS_POLL_S = 0.05
PARK_S = 0.02
"""How often, at most, the engine thread looks whether a caller still drives the loop
(at most a quarter of ``rto_s``: what peers send meanwhile waits no longer than that).
Each look takes the GIL from the caller: every 2 ms cost a 4-rank 8 B allreduce ~40 %
more CPU a call than every 20 ms in one interleaved run (1352 against 800 us)."""
HANDBACK_S = 0.0005
"""A caller that lets the loop go sets the engine thread's alarm at most this far ahead
(sooner where the loop's own timers say so) rather than waking it: one that waits or
calls again right after (a loop of small calls, every blocking torch call) takes the
loop back first, and no thread is woken for it; otherwise the sockets go unread no
longer than this (peers' next messages, which a 4 MiB socket buffer must not overflow
with)."""
SPIN_S = 50e-6
"""How long a caller that drives the loop (:meth:`Engine._drive`) yields and looks
again before it sleeps in poll: about two one-way hops on loopback here. Only while the
machine has a core to spare (its load average below its cores, looked at once a
second): on an overloaded one the peer is not running either, and a spinner only takes
its turn (one interleaved run, 8 B, 4 ranks, load 23 on 2 cores: 7.3-8.1 ms a call
without the spin, 8.5-8.8 with)."""
STALL_S = 0.25
"""A loop turn this much after the last (its waits are at most 50 ms) means this engine
was not running: peers then get this long to answer before any silence is judged."""


class Engine:
    def __init__(self, rank: int, bind_ip: str, *, port: int = ROCEV2_UDP_PORT, mtu: int = 4096,
                 slot_bytes: int = 256 * 1024, slots: int = 8, window_bytes: int = 512 * 1024,
                 rto_s: float = 0.05, link: Callable | None = None,
                 tap: Callable | None = None, native_path: bool = True,
                 socket_buffer_bytes: int = SOCKET_BUFFER_BYTES,
                 peer_timeout_s: float | None = PEER_TIMEOUT_S,
                 retry_limit: int | None = RETRY_LIMIT) -> None:
        if mtu not in VALID_MTUS:
            raise InvalidArgumentError("mtu", f"{mtu} is not one of {VALID_MTUS}")
        if type(socket_buffer_bytes) is not int or not 65536 <= socket_buffer_bytes <= 1 << 30:
            raise InvalidArgumentError("socket_buffer_bytes", f"{socket_buffer_bytes!r}: an "
                                       "int from 65536 to 2**30 bytes")
        if peer_timeout_s is not None and (isinstance(peer_timeout_s, bool) or not isinstance(
                peer_timeout_s, (int, float)) or not 0 < peer_timeout_s < float("inf")):
            raise InvalidArgumentError("peer_timeout_s", f"{peer_timeout_s!r}: seconds > 0, "
                                       "or None for no peer timeout")
        if retry_limit is not None and (type(retry_limit) is not int or retry_limit < 0):
            raise InvalidArgumentError("retry_limit", f"{retry_limit!r}: an int >= 0, or None")
        self.rank = rank
        self.bind_ip = bind_ip
        self.peer_timeout_s = peer_timeout_s
        self.retry_limit = retry_limit
        self.mtu = JUMBO_PAYLOAD if mtu == 9000 else mtu
        self.slot_bytes = max(slot_bytes - slot_bytes % self.mtu, self.mtu)
        self.slots = slots
        self.window = max(MIN_WINDOW, window_bytes // self.mtu)
        self.rto_s = rto_s
        self.stats: Counter[str] = Counter()
        self.drops = [0] * len(DropReason)
        self.mrs: dict[int, MemoryRegion] = {}
        self.qps: dict[int, QueuePair] = {}  # by local QPN
        self.by_peer: dict[int, QueuePair] = {}
        # coll_ids of calls that failed on a signature mismatch: their peers' grants and
        # messages, late or left over, are no events for later calls.
        self.dead_colls: set[int] = set()
        self.arrivals_dirty = False
        self.events = 0
        """GRANTs and ring messages taken so far: what a waiter that looks at them (a
        call's signature check) compares to know that nothing new came."""
        self._rng = np.random.default_rng()
        self.socket_buffer_bytes = socket_buffer_bytes
        # The C loops (host/fastpath.c), unless turned off or unavailable.
        self.fastpath = native.load() if native_path else None
        udp = self.udp = Udp(bind_ip, port, socket_buffer_bytes, self.stats, link=link,
                             tap=tap, fastpath=self.fastpath, no_gso=self._no_gso)
        self.sock = udp.sock
        self.addr = udp.addr
        self.rcvbuf = udp.rcvbuf
        """What the kernel lets this socket queue (its accounting, 2x what was granted)."""
        self.gro = udp.gro
        self._native_tx = udp.native_tx
        self._rx_socks = udp.rx_socks  # the shared socket, then each peer's (if any)
        # Bound here, so a queue pair's send costs the one attribute lookup it always did.
        self.transmit = udp.transmit
        self.transmit_many = udp.transmit_many
        self.transmit_run = udp.transmit_run
        self.transmit_rows = udp.transmit_rows
        self.transmit_gather = udp.transmit_gather
        self.sockaddr = udp.sockaddr
        self._fit: tuple[list[tuple[int, bool, bool]], int] | None = None
        self.rx_per_peer = False
        """Whether each peer's datagrams queue on a socket of their own (:meth:`plan_rx`)."""
        try:
            self._wake_r, self._wake_w = socket.socketpair()
        except OSError:
            udp.close()  # (EMFILE, say): the address must not stay bound
            raise
        self._wake_r.setblocking(False)
        self._alarm = make_alarm()
        """Set by a caller that lets the loop go, for the engine thread's next timer
        (None without timerfd: the caller then wakes the thread at once)."""
        self.jobs = Jobs(self)
        self.seq_due = True
        """Set by whatever may complete a waitable of a job; the loop then runs the
        sequencer (most turns of a large transfer move packets that complete nothing)."""
        self._stop = False
        self.failed: BaseException | None = None
        self._qp_error: BaseException | None = None  # the first queue pair's failure
        self.receiver = Receiver(udp, self.qps, self.stats, self.drops, self.fastpath,
                                 self._poll_ms)
        self.matcher = Matcher(self.by_peer, self.slot_bytes)
        self._thread: threading.Thread | None = None
        self._thread_id = 0
        # The loop's state belongs to whoever holds _loop_lock: the engine thread, or a
        # caller that waits for its job (_drive).
        self._loop_lock = threading.Lock()
        self._handoff = False  # a caller waits for the loop: the engine thread lets go
        self._running = False  # the engine thread is up (callers may drive)
        self._sleep_until = 0.0  # when the engine thread's sleep ends; 0 while awake
        self._qps: list[QueuePair] = []
        self._drive_waiter: Callable[[int], bool] | None = None
        self._bulk: native.Bulk | None = None
        self._bulk_stop = 0  # why fp_bulk returned, when the last turn ended in it
        self._seq_at = self._live_at = self._turn_at = 0.0
        self.row_pool = RowPool()
        self.borrowed: dict[int, Message] = {}  # by id()

    @property
    def gso(self) -> bool:
        """Whether runs of datagrams leave in one system call (UDP_SEGMENT)."""
        return self.udp.gso

    @property
    def zero_copy(self) -> bool:
        """Whether sequencer SENDs may read their payload where it lies until the peer
        ACKs it (Message.borrowed): where the C send path gathers datagrams."""
        return self._native_tx

    # ------------------------------------------------------------------ set-up
    def create_qp(self, peer: int) -> QueuePair:
        # The HDL node's convention (proto/plans.py): QP i talks to rank i, QPN 0x100 + i.
        qpn = QPN_BASE + peer
        ring = np.zeros(self.slot_bytes * self.slots, np.uint8)
        rkey = int(self._rng.integers(1, 1 << 32))
        while rkey in self.mrs:
            rkey = int(self._rng.integers(1, 1 << 32))
        mr = MemoryRegion(rkey, ring, qpn)
        self.mrs[rkey] = mr
        qp = QueuePair(self, peer, qpn, slot_bytes=self.slot_bytes, slots=self.slots, ring=mr)
        self.qps[qpn] = qp
        self.by_peer[peer] = qp
        self.matcher.add_peer(peer)
        return qp

    def plan_rx(self, peers: int) -> bool:
        """Decide, before the rendezvous tells the peers, whether each of ``peers`` peers
        gets a receive socket of its own (:meth:`open_peer_sockets`): where the shared
        socket's buffer cannot queue a full software window from every peer at once (a
        kernel cap, or a large world). Each peer then has the whole of a buffer, instead of
        a share sized for all of them sending together, which a ring never does: on a
        stock kernel without CAP_NET_ADMIN, a 4-rank ring's window triples."""
        fits = packets_that_fit(self.rcvbuf, self.mtu, self.gro)
        # Bound to the wildcard address, a connected socket would take the route's source
        # address and leave the shared one's: its peer's datagrams would not reach it.
        self.rx_per_peer = (peers > 1 and self.addr[0] != "0.0.0.0"
                            and fits < peers * software_window(self.mtu))
        return self.rx_per_peer

    def open_peer_sockets(self) -> None:
        """With :attr:`rx_per_peer`, a socket for each connected peer on this engine's
        address, connected to the peer's (:meth:`Udp.open_peer_sockets`)."""
        if self.rx_per_peer:
            self.udp.open_peer_sockets([qp.addr for qp in self.by_peer.values()])

    def fit_window(self, peers: Sequence[tuple[int, bool, bool]], senders: int) -> bool:
        """Shrink the send window so that ``senders`` engines sending to one peer at once
        (a full window each, as a gather of isends does) fit its receive buffer: a window
        the buffer cannot take is dropped in part, and go-back-N then resends it whole
        into the same buffer (a 64 MiB allreduce took 7.1 s instead of 0.14 s that way on
        a stock kernel). ``peers``: each peer's ``rcvbuf``, ``gro`` and ``rx_per_peer`` (a
        buffer for each sender). True if the window shrank. Fitted again if this engine
        stops coalescing (:meth:`_no_gso`)."""
        self._fit = (list(peers), senders)
        if not peers:
            return False
        fits = min(packets_that_fit(rcvbuf, self.mtu, self.gso and gro)
                   // (1 if own else max(1, senders)) for rcvbuf, gro, own in peers)
        if fits >= self.window:
            return False
        self.window = max(2, fits)  # AckReq every window // 2 packets: at least 1
        return True

    def _no_gso(self) -> None:
        """This path cannot segment: one datagram per message from now on, each charged
        alone at the peer, so the window is fitted again."""
        self.udp.gso = False
        if self._fit is not None:
            self.fit_window(*self._fit)

    def start(self) -> None:
        self._bulk = self.receiver.bulk_setup(self._wake_r.fileno(), self.mtu)
        self._thread = threading.Thread(target=self._run, name=f"fpgaccl-engine-{self.rank}",
                                        daemon=True)
        self._thread.start()
        self._thread_id = self._thread.ident or 0

    def stop(self) -> None:
        self._stop = True
        self._wake()
        if self._thread is not None:
            self._thread.join(5)
        # A caller may be driving the loop (abort() comes from another thread): close the
        # sockets only once it has seen _stop and let go, never under its feet.
        held = threading.get_ident() != self._thread_id and self._loop_lock.acquire(timeout=5)
        try:
            self.udp.close()
            self._wake_r.close()
            self._wake_w.close()
            if self._alarm is not None:
                self._alarm.close()
        finally:
            if held:
                self._loop_lock.release()

    @property
    def ack_delay_s(self) -> float:
        """How long a software peer's sequencer-message ACK may wait to be coalesced:
        well inside the retransmit timeout, so it never makes the sender resend."""
        return min(ACK_DELAY_S, self.rto_s / 10)

    def idle_for(self, seconds: float) -> None:
        """Keep answering retransmissions for a while (used at close)."""
        time.sleep(seconds)

    # ------------------------------------------------------------------ host side
    def submit(self, name: str, program: Program, deadline_s: float, *,
               ordered: bool = True, blocking: bool = False) -> Job:
        """Queue ``program``. Ordered jobs (collectives) run one at a time in submission
        order; an unordered one (a send or a recv) runs beside them (:mod:`.jobs`).
        ``blocking``: the caller waits for the job at once, so where the loop is free it
        runs the job to its end here and lets the loop go once, not twice."""
        job = Job(name, program, deadline_s, ordered=ordered)
        job.event.driver = self._drive
        failed = self.failed
        if isinstance(failed, PeerDeadError):  # still the dead peer's to name
            job.finish(PeerDeadError(name, self.rank, failed.peer, failed.deadline_s,
                                     f"found earlier: {failed.reason}"))
            return job
        if failed is not None:
            job.finish(TransportError(f"communicator unusable after an earlier failure: "
                                      f"{failed}"))
            return job
        self.jobs.submitted.append(job)
        if self._running and threading.get_ident() != self._thread_id and \
                self._loop_lock.acquire(False):
            # The loop is free: start the job here (its first messages leave now), and
            # leave the rest to whoever waits for it, or to the engine thread, which the
            # replies wake; no wake-up of that thread on every call.
            if blocking:
                self._drive_held(job.event, None)
                return job
            try:
                turn = self._turn
                while turn(False) and not self._stop and not job.event.is_set():
                    pass
            except BaseException as e:
                self._die(e)
            finally:
                self._let_go()
        else:
            self._wake()
        return job

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_w.send(b"\0")

    # ------------------------------------------------------------------ used by programs
    def send(self, peer: int, coll_id: int, step: int, data: memoryview) -> Completion:
        """Post a transfer; it completes when the peer has acknowledged every byte."""
        qp = self.by_peer[peer]
        sb = self.slot_bytes
        n = len(data)
        nmsg = max(1, -(-n // sb))
        comp = Completion(nmsg, peer, "ACKs of what it was sent")
        for i in range(nmsg):
            final = i == nmsg - 1
            imm = wire.pack_imm(coll_id, step | (wire.STEP_FINAL if final else 0))
            qp.post(Message(data[i * sb:(i + 1) * sb], imm, comp))
        return comp

    def recv(self, peer: int, coll_id: int, step: int, dest: np.ndarray, ufunc: Any | None = None,
             what: str = "recvbuf") -> Completion:
        """Post a receive: copy (or combine with ``ufunc``) a transfer into ``dest``."""
        comp = self.matcher.post(peer, coll_id, step, dest, ufunc, what)
        self.arrivals_dirty = True
        return comp

    def _match(self) -> None:
        self.arrivals_dirty = False
        if self.matcher.match():
            self.seq_due = True

    # ------------------------------------------------------------------ borrowed memory
    def protect(self, lo: int, hi: int) -> None:
        """Addresses ``[lo, hi)`` are about to be written: every borrowed message that
        may still read them takes its own copy first."""
        for key in [k for k, m in self.borrowed.items() if m.overlaps(lo, hi)]:
            self.borrowed.pop(key).own()
            self.stats["borrow_copies"] += 1

    def forget_calls(self, coll_ids: Iterable[int]) -> None:
        """Calls that failed on a signature mismatch: drop their grants, messages and
        posted receives that no program or schedule took, and those still to come
        (until a call reuses the id)."""
        dead = self.dead_colls
        dead.update(c & 0xFFFF for c in coll_ids)
        self.matcher.cancel(dead)
        for qp in self.by_peer.values():
            for q in (qp.grants, qp.landed):
                if any(e[0] in dead for e in q):
                    keep = [e for e in q if e[0] not in dead]
                    q.clear()
                    q.extend(keep)
            if qp.arrived:
                qp.give_back_arrived(lambda a: a.coll_id in dead and
                                     a.step & ~wire.STEP_FINAL != wire.STEP_P2P)

    def protect_all(self) -> None:
        """The borrowed memory goes back to its owner (a program ends): every message
        that may still read it takes its own copy."""
        for msg in list(self.borrowed.values()):
            msg.own()
            self.stats["borrow_copies"] += 1
        self.borrowed.clear()

    def release(self, msg: Message) -> None:
        """``msg`` is ACKed whole: nothing reads its payload again."""
        self.borrowed.pop(id(msg), None)
        msg.src = None

    # ------------------------------------------------------------------ engine thread
    def drop(self, reason: DropReason) -> None:
        self.drops[reason] += 1

    def qp_failed(self, qp: QueuePair, error: BaseException,
                  per_job: Callable[[Job], BaseException] | None = None) -> None:
        self._qp_error = self._qp_error or error  # jobs not yet started fail with it too
        self.jobs.close_running(per_job or (lambda job: error))
        self.failed = error

    def peer_dead(self, qp: QueuePair, reason: str, notify: bool = True) -> None:
        """``qp``'s peer stopped answering: every call fails, naming it. A world missing
        a rank cannot run a collective again, so the engine stays failed, as after any
        queue pair's failure. ``notify``: tell the other software peers (a dead-peer
        notice, proto/reliability.py), so that they name this rank too, not the one
        that exits on the error first."""
        if qp.error is not None:
            return
        timeout = self.peer_timeout_s or 0.0

        def dead(job: Job | None) -> PeerDeadError:
            return PeerDeadError(job.name if job else "transport", self.rank, qp.peer,
                                 timeout, reason)

        qp.error = dead(None)
        self.stats["peers_dead"] += 1
        if notify:
            for other in self.by_peer.values():
                if other is not qp and other.error is None and other.selective:
                    self.stats["dead_notices"] += 1
                    other.send_ack(wire.PEER_DEAD_SYNDROME, (other.epsn - 1) & wire.PSN_MASK,
                                   qp.peer)
        self.qp_failed(qp, qp.error, dead)

    def peer_reported_dead(self, by: QueuePair, rank: int) -> None:
        """``by``'s peer found ``rank`` dead (a dead-peer notice): fail the same way."""
        self.stats["dead_notices_rx"] += 1
        qp = self.by_peer.get(rank)
        if qp is not None and qp is not by:
            self.peer_dead(qp, f"rank {by.peer} found it dead", notify=False)

    def socket_errors(self, errors: list[SocketError], now: float) -> None:
        """What the kernel queued on the sockets (:meth:`Udp.read_errors`). An ICMP port
        unreachable for a peer's address says its process is gone (its socket closed): a
        killed rank on a live host is found in one probe interval, not a peer timeout
        (check_liveness). Counted under ``port_unreachable`` (else
        ``socket_errors_other``); other errors are left to the timers."""
        closed = False
        for e in errors:
            if not e.port_closed:
                self.stats["socket_errors_other"] += 1
                continue
            self.stats["port_unreachable"] += 1
            closed = True
            for qp in self.by_peer.values():
                if qp.addr == e.dst:
                    qp.closed_at = now
        if closed:
            self.check_liveness(now)

    def check_liveness(self, now: float) -> None:
        """Fail the queue pair of a peer that has owed an ACK for ``peer_timeout_s``, or
        for one probe interval since its port was found closed (an ICMP port
        unreachable after we last heard from it). The silence is what decides: anyone
        on the network can forge an ICMP message, but not a live peer's silence. Called
        only on a turn whose receive found nothing: what has arrived is read before a
        silence is judged."""
        timeout = self.peer_timeout_s
        if timeout is None:
            return
        quiet = self.jobs.probe_s()
        for qp in self.by_peer.values():
            if qp.error is None and (qp.outstanding or qp.probed):
                if qp.closed_at > qp.heard_at and now - qp.heard_at >= quiet:
                    self.peer_dead(qp, "ICMP port unreachable: its process is gone")
                    return
                silent = qp.silent_for(now)
                if silent > timeout:
                    what = (f"{qp.inflight} packet(s) unACKed" if qp.outstanding
                            else "a liveness probe unanswered")
                    self.peer_dead(qp, f"{what} for {silent:.2f} s")
                    return

    def probe(self, peers: Any, now: float) -> None:
        """A job waits on ``peers`` (ranks): ask those we owe nothing for an ACK, so a
        dead one is found even where nothing of ours is outstanding to it."""
        if self.peer_timeout_s is None:
            return
        quiet = self.jobs.probe_s()  # heard from within one probe interval: alive
        for peer in peers:
            qp = self.by_peer.get(peer)
            if qp is not None:
                qp.probe(now, quiet)

    def _run(self) -> None:
        lock = self._loop_lock
        try:
            poller = select.poll()
            for sock in self._rx_socks:
                poller.register(sock, select.POLLIN)
            poller.register(self._wake_r, select.POLLIN)
            parked = select.poll()
            parked.register(self._wake_r, select.POLLIN)
            wake_fd = self._wake_r.fileno()
            alarm = self._alarm
            alarm_fd = -1
            if alarm is not None:
                alarm_fd = alarm.fileno()
                poller.register(alarm_fd, select.POLLIN)
                parked.register(alarm_fd, select.POLLIN)
            park_s = min(PARK_S, self.rto_s / 4)
            park_ms = max(1, int(park_s * 1000))
            self._running = True
            while not self._stop:
                if not lock.acquire(False):
                    # A caller drives the loop and reads the sockets: wait on the
                    # wake-ups alone, and look again soon (the caller wakes no one when
                    # it lets go, so a call costs this thread no wake-up).
                    self._sleep_until = time.monotonic() + park_s
                    for fd, _ in parked.poll(park_ms):
                        if fd == wake_fd:
                            self._drain_wake()
                        else:
                            alarm.clear()
                    continue
                try:
                    turn = self._turn
                    while turn() and not self._handoff and not self._stop:
                        pass
                    now = time.monotonic()
                    ms = self._poll_ms(now)
                    self._sleep_until = now + ms / 1000
                finally:
                    lock.release()
                # Yield before sleeping: on a shared CPU the peer this loop waits for
                # often runs then, and its datagram is here without the wake-up's cost
                # to both (the sender's system call wakes a sleeping receiver).
                os.sched_yield()
                events = poller.poll(0) or poller.poll(ms)
                self._sleep_until = 0.0
                if not events:
                    self.stats["poll_expired"] += 1
                    continue
                for fd, ev in events:
                    if fd == wake_fd:
                        # Drain the wake-ups only when there are some: one system call
                        # fewer on every datagram-driven wake.
                        self._drain_wake()
                    elif fd == alarm_fd:
                        alarm.clear()
                    elif ev & select.POLLERR:
                        self.udp.errors_pending = True
        except BaseException as e:  # the engine must never die silently
            self._die(e)
        finally:
            self._running = False

    def _die(self, error: BaseException) -> None:
        self.failed = error
        self._stop = True
        self.jobs.finish_all(error)

    def _turn(self, bulk: bool = True) -> bool:
        """One turn of the loop, by whichever thread holds ``_loop_lock``: take what
        arrived, send what is due, resume the jobs whose waits are over. Whether it did
        anything (True: turn again); when it did not, it may have waited in ``fp_bulk``
        (not with ``bulk`` False)."""
        if len(self._qps) != len(self.by_peer):
            self._qps = list(self.by_peer.values())
        qps = self._qps
        jobs = self.jobs
        if self._bulk_stop:
            # What had arrived, fp_bulk took or left to the receiver's dispatch; after
            # the latter, this turn is one whose receive found datagrams (a landed
            # message may have queued a credit or a grant to send).
            busy = self._bulk_stop == native.BULK_BATCH
            self._bulk_stop = 0
        else:
            busy = self.receiver.receive()
        now = time.monotonic()
        if self.udp.errors_pending:
            self.socket_errors(self.udp.read_errors(), now)
        if now - self._turn_at > STALL_S:
            self._live_at = now + STALL_S  # our own stall is no peer's silence
        self._turn_at = now
        # Guards before the per-QP calls: this loop runs hundreds of times a
        # collective, and most turns find nothing for most QPs.
        for qp in qps:
            if qp.pending_reports or qp.again_at:
                qp.run_reports(now)
            if qp.ack_pending or qp.ack_due:
                qp.flush_ack(now)
            if qp.has_work() and qp.pump(now):
                busy = True
            if qp.outstanding:
                qp.check_timer(now, self.rto_s)
        if self.arrivals_dirty:
            self._match()
        if not busy and now >= self._live_at:
            self._live_at = now + LIVENESS_POLL_S
            self.check_liveness(now)
        if jobs.submitted or (jobs.running and (self.seq_due or now >= self._seq_at)):
            self.seq_due = False
            self._seq_at = now + SEQUENCE_POLL_S
            if jobs.sequence(now):
                # What a job posted or yields next may be done already.
                self.seq_due = busy = True
        if not busy and bulk and self._bulk is not None:
            stop = self.receiver.bulk(self._bulk, qps, now)
            if stop:  # it waited, doing the steady state's work meanwhile
                self._bulk_stop = stop
                if stop == native.BULK_WAKE:
                    self._drain_wake()
                return True
        return busy

    def _drive(self, latch: Latch, timeout: float | None) -> None:
        """Run the loop on the calling thread until ``latch`` is set (or ``timeout``
        seconds pass): the caller that waits for its job moves it itself, with no hop
        to the engine thread and back. The engine thread keeps the loop whenever no
        caller waits (between calls, for asynchronous ones). Returns at once where the
        engine thread is not running (not yet started, failed or stopped)."""
        if not self._running or threading.get_ident() == self._thread_id:
            return
        lock = self._loop_lock
        if not lock.acquire(False):
            # The engine thread is in a turn (or waits in fp_bulk, which a wake-up ends):
            # it lets the loop go at the end of the turn.
            self._handoff = True
            self._wake()
            got = lock.acquire() if timeout is None else lock.acquire(timeout=max(timeout, 0))
            if not got:
                self._handoff = False
                return
        self._handoff = False
        self._drive_held(latch, timeout)

    def _drive_held(self, latch: Latch, timeout: float | None) -> None:
        """:meth:`_drive` once this thread holds the loop; lets it go at the end."""
        end = None if timeout is None else time.monotonic() + timeout
        try:
            wait = self._drive_waiter or self._drive_wait()
            turn = self._turn
            while not latch.is_set() and not self._stop:
                if turn():
                    continue
                now = time.monotonic()
                ms = self._poll_ms(now)
                if end is not None:
                    if now >= end:
                        break
                    ms = min(ms, max(1, int((end - now) * 1000)))
                if not wait(ms):
                    self.stats["drive_sleeps_expired"] += 1
        except BaseException as e:
            self._die(e)
        finally:
            self._let_go()

    def _let_go(self) -> None:
        """Release the loop a caller held: what is due at once (an ACK, a credit) is sent
        here first. The engine thread is woken only where it sleeps past its next timer,
        and then by its alarm, when that timer is due or :data:`HANDBACK_S` from now,
        whichever comes first. A caller that calls, or waits, again sooner takes the loop
        back with no thread woken at all."""
        try:
            if not self._stop and (self.jobs.submitted or any(
                    qp.ack_pending or qp.has_work() for qp in self._qps)):
                while self._turn(False) and not self._stop:
                    pass
            now = time.monotonic()
            due = self._poll_ms(now) / 1000
            late = self._sleep_until > now + due
            if late and self._alarm is not None and not self._stop:
                self._alarm.set(min(due, HANDBACK_S))
                late = False
        except BaseException as e:
            self._die(e)
            late = True
        finally:
            self._loop_lock.release()
        if late:
            self._wake()

    def _drive_wait(self) -> Callable[[int], bool]:
        """``wait(ms)`` for a driving caller: whether a receive socket or the wake-up
        socket became readable within ``ms`` (the wake-ups drained). With the C fast
        path a spin of ``SPIN_S`` comes first, in C, so that it holds no GIL."""
        fds = [s.fileno() for s in self._rx_socks] + [self._wake_r.fileno()]
        wake_bit = 1 << (len(fds) - 1)
        fp = self.fastpath
        if fp is not None and len(fds) <= 32:
            arr = (ctypes.c_int32 * len(fds))(*fds)
            n = len(fds)
            fp_wait = fp.wait
            spin = [0, 0.0]  # nanoseconds, and when the load was last looked at
            cores = os.cpu_count() or 1

            def wait(ms: int) -> bool:
                now = time.monotonic()
                if now >= spin[1]:
                    spin[1] = now + 1.0
                    spin[0] = int(SPIN_S * 1e9) if os.getloadavg()[0] < cores else 0
                got = fp_wait(arr, n, spin[0], ms)
                if got < 0:
                    raise OSError(-got, os.strerror(-got))
                if got & wake_bit:
                    self._drain_wake()
                if got & native.SOCKET_ERROR_BIT:
                    self.udp.errors_pending = True
                return got != 0
            self._drive_waiter = wait
            return wait
        poller = select.poll()
        for fd in fds:
            poller.register(fd, select.POLLIN)
        wake_fd = fds[-1]

        def wait_py(ms: int) -> bool:
            events = poller.poll(ms)
            for fd, ev in events:
                if fd == wake_fd:
                    self._drain_wake()
                elif ev & select.POLLERR:
                    self.udp.errors_pending = True
            return bool(events)
        self._drive_waiter = wait_py
        return wait_py

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except BlockingIOError:
            pass

    def _poll_ms(self, now: float) -> int:
        wait = 0.05
        for qp in self.by_peer.values():
            if qp.outstanding:
                wait = min(wait, max(0.0, qp.last_progress + qp.timer_wait(self.rto_s) - now),
                           max(0.0, qp.deferred_due() - now))
            if qp.ack_due > 0:
                wait = min(wait, max(0.0, qp.ack_due - now))
            if qp.pending_reports or qp.again_at:
                wait = min(wait, max(0.0, qp.reports_due() - now))
        job_wait = self.jobs.wait_s(now)
        if job_wait is not None:
            wait = min(wait, job_wait)
        return max(1, int(wait * 1000))
