"""The software offload engine: one UDP socket on port 4791, queue pairs, a sequencer.

A single engine thread owns all transport state (as the hardware's pipelines do), so
nothing in the data path takes a lock. The host thread hands it *programs* (generators: the
sequencer executor of :mod:`fpgaccl.host.executor` running a :mod:`fpgaccl.proto.programs`
program, or a schedule of :mod:`fpgaccl.host.algorithms`) through a queue
and a wake-up socket, then waits on the program's :class:`Job`. Programs run one after
another in submission order, which every rank shares, like a hardware command queue.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import ipaddress
import os
import select
import socket
import struct
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Generator, Sequence
from typing import Any

import numpy as np

from fpgaccl.errors import (
    CollectiveTimeoutError,
    CountMismatchError,
    FpgacclError,
    InvalidArgumentError,
    TransportError,
)
from fpgaccl.proto.drops import DropReason
from fpgaccl.proto.opcodes import ROCEV2_UDP_PORT, SUPPORTED_OPCODES, AethKind, Opcode
from fpgaccl.proto.plans import QPN_BASE

from . import native, wire
from .qp import (
    _MIDDLE,
    _WRITES,
    Arrival,
    Completion,
    GatherRun,
    MemoryRegion,
    Message,
    QueuePair,
    RowPool,
)

Program = Generator[Any, None, None]
"""A collective schedule: yields Completions (or iterables of them) to wait on."""

VALID_MTUS = (256, 512, 1024, 2048, 4096, 9000)
JUMBO_PAYLOAD = 8192
"""Payload per packet for the 9000-byte jumbo MTU: the largest power of two whose
datagram (IPv4 + UDP + BTH + RETH + ImmDt + ICRC) fits in 9000 bytes."""

# Linux UDP segmentation offload (GSO) and receive coalescing (GRO), <linux/udp.h>.
SOL_UDP = 17
UDP_SEGMENT = 103
UDP_GRO = 104
GSO_MAX_SEGMENTS = 64
GSO_MAX_BYTES = 65507  # one UDP payload: 65535 - IPv4 - UDP headers
_RX_SLOTS = 32  # datagrams (or GRO runs) per recvmmsg with the C path: 2 MiB of buffer
_GSO_SIZE = struct.Struct("=H")
_GRO_SIZE = struct.Struct("=i")
_GRO_CMSG_SPACE = socket.CMSG_SPACE(_GRO_SIZE.size)


ACK_DELAY_S = 0.002
SEQUENCE_POLL_S = 0.002
"""The sequencer runs when something it may wait on happened (``Engine.seq_due``: an
ACKed message, a grant or message landed, a receive delivered, a new job) and, failing
that, at least this often, for deadlines."""
BULK_LOOP = True
"""Whether the engine hands the steady state of large transfers to ``fp_bulk`` (the C
loop, :meth:`Engine._bulk`) instead of waiting in poll between its own turns."""
BULK_YIELDS = 1
"""Times ``fp_bulk`` yields the CPU and looks again before it sleeps in poll. A 64 MiB
4-rank allreduce on 2 cores slept about 180 times a call per rank without, 30 with one
yield, and took 117-128 ms a call against 99-110."""
SOFTWARE_WINDOW_BYTES = 1 << 20
"""Send window when every peer is a software engine: three peers at once fit its 4 MiB
socket buffer, and on a shared CPU a descheduled receiver then stalls its sender less.
A peer whose socket buffer is smaller gets less (:meth:`Engine.fit_window`)."""
SOCKET_BUFFER_BYTES = 4 << 20
"""Socket buffers asked for. Linux grants at most ``net.core.rmem_max``/``wmem_max``
(212992 on a stock kernel) unless the process may force more (CAP_NET_ADMIN)."""
MIN_WINDOW = 8
"""Packets: the smallest send window a constructor gives (a fitted one may be smaller)."""
SO_SNDBUFFORCE, SO_RCVBUFFORCE = 32, 33  # <asm-generic/socket.h>; not in Python's socket
BUFFER_HEADROOM = 0.85
"""Share of a receive buffer the send windows may fill: the rest is for ACKs and credits."""


def packet_charge(payload: int, coalesced: bool) -> int:
    """Bytes of a receive buffer's size (as ``SO_RCVBUF`` reads it back) one queued packet
    of ``payload`` bytes takes, rounded up: the kernel charges the whole buffer it sits
    in. A lone datagram's is a power-of-two allocation plus the skb (payload filled 0.20,
    0.40, 0.44, 0.48 and 0.47 of a buffer at 256, 512, 1024, 4096 and 8192 bytes); a GRO
    run's is shared by its packets (0.83-0.87 at 4096). Measured on loopback."""
    if coalesced:
        return payload * 5 // 4
    return (1 << (payload + 400).bit_length()) + 320 + payload // 8


def _bind_error(bind_ip: str, port: int, e: OSError) -> InvalidArgumentError:
    taken = e.errno == errno.EADDRINUSE
    return InvalidArgumentError(
        "bind_ip", f"cannot bind UDP {bind_ip}:{port}: {e.strerror}" + (
            " (another rank on this host? RoCEv2 wants port 4791 on every rank, so "
            "give each local rank its own address: bind_ip= or FPGACCL_BIND_IP)"
            if taken else ""))


class Latch:
    """A one-shot event for one setter (the engine thread) and any waiters: a lock held
    until set. ``threading.Event`` builds a Condition and a fresh lock on every wait; a
    small collective pays for both twice, a bare lock costs one futex each side."""

    __slots__ = ("_lock", "_set")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()
        self._set = False

    def set(self) -> None:
        if not self._set:
            self._set = True
            self._lock.release()

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout: float | None = None) -> bool:
        if self._set:
            return True
        if self._lock.acquire(timeout=-1 if timeout is None else max(timeout, 0.0)):
            self._lock.release()  # the next waiter gets through too
            return True
        return self._set


class Job:
    """One submitted program; the host waits on it."""

    def __init__(self, name: str, program: Program, deadline_s: float, *,
                 ordered: bool = True) -> None:
        self.name = name
        self.ordered = ordered
        self.program = program
        self.deadline_s = deadline_s
        self.event = Latch()
        self.error: BaseException | None = None
        self.started = 0.0
        self.waiting: list[Completion] = []

    def finish(self, error: BaseException | None = None) -> None:
        self.error = error
        self.event.set()


class RecvOp:
    """A posted receive: where the messages of one transfer go and how they combine."""

    __slots__ = ("coll_id", "completion", "dest", "nbytes", "off", "step", "ufunc", "what")

    def __init__(self, coll_id: int, step: int, dest: np.ndarray, ufunc: Any | None,
                 completion: Completion, what: str) -> None:
        self.coll_id = coll_id
        self.step = step
        self.dest = dest
        self.nbytes = dest.nbytes
        self.ufunc = ufunc
        self.off = 0
        self.completion = completion
        self.what = what


class Engine:
    def __init__(self, rank: int, bind_ip: str, *, port: int = ROCEV2_UDP_PORT, mtu: int = 4096,
                 slot_bytes: int = 256 * 1024, slots: int = 8, window_bytes: int = 512 * 1024,
                 rto_s: float = 0.05, link: Callable | None = None,
                 tap: Callable | None = None, native_path: bool = True,
                 socket_buffer_bytes: int = SOCKET_BUFFER_BYTES) -> None:
        if mtu not in VALID_MTUS:
            raise InvalidArgumentError("mtu", f"{mtu} is not one of {VALID_MTUS}")
        if type(socket_buffer_bytes) is not int or not 65536 <= socket_buffer_bytes <= 1 << 30:
            raise InvalidArgumentError("socket_buffer_bytes", f"{socket_buffer_bytes!r}: an "
                                       "int from 65536 to 2**30 bytes")
        self.rank = rank
        self.bind_ip = bind_ip
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
        self.posted: dict[int, list[RecvOp]] = {}
        self.arrivals_dirty = False
        self._rng = np.random.default_rng()
        self._link = link  # impairment shim: (datagram parts, addr, send) -> None
        self._tap = tap  # capture hook: (src_ip, dst_addr, datagram bytes)
        self.socket_buffer_bytes = socket_buffer_bytes
        self.sock = self._udp_socket()
        self.rcvbuf = self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
        """What the kernel lets this socket queue (its accounting, 2x what was granted)."""
        self._fit: tuple[list[tuple[int, bool, bool]], int] | None = None
        # DF + id 0: the IPv4 header the kernel writes is the one our ICRC covers.
        self.sock.setsockopt(socket.IPPROTO_IP, 10, 2)  # IP_MTU_DISCOVER = IP_PMTUDISC_DO
        try:
            self.sock.bind((bind_ip, port))
        except OSError as e:
            self.sock.close()
            raise _bind_error(bind_ip, port, e) from None
        self.sock.setblocking(False)
        self.addr = self.sock.getsockname()
        # On loopback there is no wire: a run of equal-sized datagrams goes to the kernel in
        # one sendmsg (UDP_SEGMENT) and a GRO socket takes it back in one recvmsg. Each
        # datagram is still a complete RoCEv2 packet exactly as sent one by one, and the
        # per-datagram kernel cost (~10 us each way here) is paid once per run. Off a real
        # link, since a segmented datagram leaves with an IPv4 id other than the 0 our ICRC
        # covers, and with a link shim, which impairs datagram by datagram.
        self.gso = link is None and ipaddress.ip_address(self.addr[0]).is_loopback
        self.gro = False
        if self.gso:
            try:
                self.sock.setsockopt(SOL_UDP, UDP_GRO, 1)
                self.gro = True
            except OSError:
                self.gso = False
        self.rx_per_peer = False
        """Whether each peer's datagrams queue on a socket of their own (:meth:`plan_rx`)."""
        self._rx_socks: list[socket.socket] = [self.sock]
        self._rx_ready: select.poll | None = None  # with sockets per peer
        self._rx_by_fd: dict[int, socket.socket] = {}
        try:
            self._wake_r, self._wake_w = socket.socketpair()
        except OSError:
            self.sock.close()  # (EMFILE, say): the address must not stay bound
            raise
        self._wake_r.setblocking(False)
        self._submitted: deque[Job] = deque()
        self._jobs: deque[Job] = deque()
        self.seq_due = True
        """Set by whatever may complete a waitable of a job; the loop then runs the
        sequencer (most turns of a large transfer move packets that complete nothing)."""
        self._seq_at = 0.0
        self._stop = False
        self.failed: BaseException | None = None
        self._qp_error: BaseException | None = None  # the first queue pair's failure
        # The C loops (host/fastpath.c), unless turned off or unavailable. A tap or a link
        # shim sees datagrams one by one, so they keep the Python send path.
        self.fastpath = native.load() if native_path else None
        self._native_tx = self.fastpath is not None and tap is None and link is None
        self._sockaddrs: dict[tuple[str, int], native.SockaddrIn] = {}
        slots = _RX_SLOTS if self.fastpath is not None else 1
        self._rxarr = np.empty(slots * native.SLOT_BYTES, np.uint8)
        self._rxview = memoryview(self._rxarr)
        self._rxaddr = int(self._rxarr.ctypes.data)
        self._rxmeta = np.zeros((4, slots), np.uint32)  # lens, segs, addrs, ports
        self._rxmeta_addr = [int(self._rxmeta[i].ctypes.data) for i in range(4)]
        self._thread: threading.Thread | None = None
        self._ips: dict[str, int] = {}
        self.row_pool = RowPool()
        self.borrowed: dict[int, Message] = {}  # by id()

    @property
    def zero_copy(self) -> bool:
        """Whether sequencer SENDs may read their payload where it lies until the peer
        ACKs it (Message.borrowed): where the C send path gathers datagrams."""
        return self._native_tx

    # ------------------------------------------------------------------ set-up
    def _udp_socket(self) -> socket.socket:
        """A UDP socket with the engine's buffers, forced past the kernel's cap where
        this process may."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        want = self.socket_buffer_bytes
        for opt, force in ((socket.SO_RCVBUF, SO_RCVBUFFORCE),
                           (socket.SO_SNDBUF, SO_SNDBUFFORCE)):
            sock.setsockopt(socket.SOL_SOCKET, opt, want)
            if sock.getsockopt(socket.SOL_SOCKET, opt) < 2 * want:
                # Capped by rmem_max/wmem_max: a process that may, takes it anyway.
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, force, want)
        return sock

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
        self.posted[peer] = []
        return qp

    def plan_rx(self, peers: int) -> bool:
        """Decide, before the rendezvous tells the peers, whether each of ``peers`` peers
        gets a receive socket of its own (:meth:`open_peer_sockets`): where the shared
        socket's buffer cannot queue a full software window from every peer at once (a
        kernel cap, or a large world). Each peer then has the whole of a buffer, instead of
        a share sized for all of them sending together, which a ring never does: on a
        stock kernel without CAP_NET_ADMIN, a 4-rank ring's window triples."""
        fits = int(self.rcvbuf * BUFFER_HEADROOM) // packet_charge(self.mtu, self.gro)
        # Bound to the wildcard address, a connected socket would take the route's source
        # address and leave the shared one's: its peer's datagrams would not reach it.
        self.rx_per_peer = (peers > 1 and self.addr[0] != "0.0.0.0"
                            and fits < peers * (SOFTWARE_WINDOW_BYTES // self.mtu))
        return self.rx_per_peer

    def open_peer_sockets(self) -> None:
        """With :attr:`rx_per_peer`, a socket for each connected peer on this engine's
        address, connected to the peer's: the kernel queues a datagram on the socket
        connected to its source before the shared one, so each peer fills a buffer of
        its own. Every socket's datagrams go through the same checks whichever socket
        they came by; a peer that sends from another address (an HDL node's per-QP
        source port) lands on the shared socket, as before."""
        if not self.rx_per_peer:
            return
        reuse = socket.SO_REUSEPORT
        opened: list[socket.socket] = []
        # SO_REUSEPORT only while the sockets bind: afterwards the address is exclusive
        # again, so a second rank bound to it by mistake is refused (EADDRINUSE) instead
        # of taking some of this one's datagrams. Between its bind and its connect a new
        # socket may take another peer's datagrams; they are read and checked all the same.
        self.sock.setsockopt(socket.SOL_SOCKET, reuse, 1)
        try:
            for qp in self.by_peer.values():
                sock = self._udp_socket()
                opened.append(sock)
                sock.setsockopt(socket.SOL_SOCKET, reuse, 1)
                sock.bind(self.addr)
                sock.connect(qp.addr)
                sock.setblocking(False)
                if self.gro:
                    sock.setsockopt(SOL_UDP, UDP_GRO, 1)
        except OSError:
            for sock in opened:
                sock.close()
            raise
        finally:
            self.sock.setsockopt(socket.SOL_SOCKET, reuse, 0)
        for sock in opened:
            sock.setsockopt(socket.SOL_SOCKET, reuse, 0)
        self._rx_socks.extend(opened)
        self._rx_ready = select.poll()
        for sock in self._rx_socks:
            self._rx_ready.register(sock, select.POLLIN)
            self._rx_by_fd[sock.fileno()] = sock

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
        fits = min(int(rcvbuf * BUFFER_HEADROOM) // packet_charge(self.mtu, self.gso and gro)
                   // (1 if own else max(1, senders)) for rcvbuf, gro, own in peers)
        if fits >= self.window:
            return False
        self.window = max(2, fits)  # AckReq every window // 2 packets: at least 1
        return True

    def _no_gso(self) -> None:
        """This path cannot segment: one datagram per message from now on, each charged
        alone at the peer, so the window is fitted again."""
        self.gso = False
        if self._fit is not None:
            self.fit_window(*self._fit)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"fpgaccl-engine-{self.rank}",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop = True
        self._wake()
        if self._thread is not None:
            self._thread.join(5)
        for sock in self._rx_socks:  # the shared socket first
            sock.close()
        self._wake_r.close()
        self._wake_w.close()

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
               ordered: bool = True) -> Job:
        """Queue ``program``. Ordered jobs (collectives) run one at a time in submission
        order; an unordered one (a send or a recv) runs beside them: see _sequence."""
        job = Job(name, program, deadline_s, ordered=ordered)
        if self.failed is not None:
            job.finish(TransportError(f"communicator unusable after an earlier failure: "
                                      f"{self.failed}"))
            return job
        self._submitted.append(job)
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
        comp = Completion(nmsg)
        for i in range(nmsg):
            final = i == nmsg - 1
            imm = wire.pack_imm(coll_id, step | (wire.STEP_FINAL if final else 0))
            qp.post(Message(data[i * sb:(i + 1) * sb], imm, comp))
        return comp

    def recv(self, peer: int, coll_id: int, step: int, dest: np.ndarray, ufunc: Any | None = None,
             what: str = "recvbuf") -> Completion:
        """Post a receive: copy (or combine with ``ufunc``) a transfer into ``dest``."""
        comp = Completion(1)
        self.posted[peer].append(RecvOp(coll_id & 0xFFFF, step, dest, ufunc, comp, what))
        self.arrivals_dirty = True
        return comp

    # ------------------------------------------------------------------ engine thread
    def transmit(self, parts: tuple, addr: tuple[str, int]) -> None:
        if self._tap is not None:
            self._tap(self.addr[0], addr, b"".join(bytes(p) for p in parts))
        if self._link is not None:
            self._link(parts, addr, self._sendmsg)
        else:
            self._sendmsg(parts, addr)

    def transmit_many(self, datagrams: list[tuple], addr: tuple[str, int]) -> None:
        """Send datagrams in order; with GSO, each run of equal sizes (the last of a run
        may be shorter, as UDP_SEGMENT requires) in one system call."""
        if not self.gso or len(datagrams) == 1:
            for parts in datagrams:
                self.transmit(parts, addr)
            return
        tap = self._tap
        run: list = []
        count = total = seg = 0
        for parts in datagrams:
            size = sum(map(len, parts))
            if tap is not None:
                tap(self.addr[0], addr, b"".join(bytes(p) for p in parts))
            if count and (size > seg or count == GSO_MAX_SEGMENTS
                          or total + size > GSO_MAX_BYTES):
                self._sendmsg(run, addr, seg, count)
                run, count, total = [], 0, 0
            if not count:
                seg = size
            run.extend(parts)
            count += 1
            total += size
            if size < seg:  # a shorter datagram can only end a run
                self._sendmsg(run, addr, seg, count)
                run, count, total = [], 0, 0
        if count:
            self._sendmsg(run, addr, seg, count)

    def transmit_run(self, flat: list, k: int, seg: int, addr: tuple[str, int]) -> None:
        """Send ``k`` datagrams of ``seg`` bytes each, three parts per datagram in
        ``flat``: with GSO, as many per system call as one UDP datagram can carry."""
        if not self.gso or self._tap is not None:
            for i in range(0, 3 * k, 3):
                self.transmit(tuple(flat[i:i + 3]), addr)
            return
        per = max(1, min(GSO_MAX_SEGMENTS, GSO_MAX_BYTES // seg))
        for i in range(0, k, per):
            n = min(per, k - i)
            self._sendmsg(flat[3 * i:3 * (i + n)], addr, seg, n)

    def transmit_rows(self, flat: memoryview, k: int, seg: int, addr: tuple[str, int]) -> None:
        """Send ``k`` datagrams of ``seg`` bytes lying back to back in ``flat``: with GSO,
        as many per system call as one UDP datagram can carry, as one buffer."""
        if self._native_tx and not flat.readonly:
            self._send_native(ctypes.addressof(ctypes.c_char.from_buffer(flat)), k, seg, addr)
            return
        if not self.gso or self._tap is not None:
            for b in range(0, k * seg, seg):
                self.transmit((flat[b:b + seg],), addr)
            return
        per = max(1, min(GSO_MAX_SEGMENTS, GSO_MAX_BYTES // seg))
        for i in range(0, k, per):
            n = min(per, k - i)
            self._sendmsg((flat[i * seg:(i + n) * seg],), addr, seg, n)

    def _sendmsg(self, parts: tuple | list, addr: tuple[str, int], seg: int = 0,
                 count: int = 1) -> None:
        anc = [(SOL_UDP, UDP_SEGMENT, _GSO_SIZE.pack(seg))] if count > 1 else ()
        for _ in range(1000):
            try:
                self.sock.sendmsg(parts, anc, 0, addr)
                self.stats["tx_packets"] += count
                return
            except BlockingIOError:
                select.select([], [self.sock], [], 0.01)
            except OSError as e:
                if e.errno in (errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.ENETUNREACH):
                    return  # the peer is gone; its timeout will surface
                if count > 1 and e.errno in (errno.EIO, errno.EINVAL, errno.EOPNOTSUPP,
                                             errno.EMSGSIZE):
                    self._no_gso()
                    self._sendmsg_each(parts, addr, seg)
                    return
                if e.errno == errno.EMSGSIZE:
                    raise TransportError(
                        f"a {sum(len(p) for p in parts)}-byte datagram does not fit the link "
                        f"to {addr[0]} (DF is set, as RoCEv2 requires): choose a smaller mtu"
                    ) from None
                raise

    def _send_native(self, ptr: int, k: int, seg: int, addr: tuple[str, int]) -> None:
        """:meth:`transmit_rows` through ``fp_send_rows``: up to 64 GSO runs (or plain
        datagrams) per sendmmsg (see :meth:`_send_batches`)."""
        send, fd, ref = self.fastpath.send_rows, self.sock.fileno(), self._sockaddr(addr)
        self._send_batches(k, seg, addr,
                           lambda done, per: send(fd, ptr + done * seg, k - done, seg, per, ref))

    def sockaddr(self, addr: tuple[str, int]) -> native.SockaddrIn:
        """``addr`` as a ``struct sockaddr_in`` (kept: one per peer)."""
        sa = self._sockaddrs.get(addr)
        if sa is None:
            sa = self._sockaddrs[addr] = native.sockaddr(addr)
        return sa

    def _sockaddr(self, addr: tuple[str, int]) -> Any:
        return ctypes.byref(self.sockaddr(addr))

    def _send_batches(self, k: int, seg: int, addr: tuple[str, int],
                      send: Callable[[int, int], int]) -> None:
        """Hand ``k`` datagrams of ``seg`` bytes to the kernel through ``send(done, per)``
        (a C sender: the datagrams from ``done`` on, ``per`` to a GSO message; returns how
        many went, or -errno), with :meth:`_sendmsg`'s handling of a full socket buffer,
        a gone peer and a path that cannot segment."""
        done = 0
        for _ in range(1000):
            per = self._gso_per(seg)
            r = send(done, per)
            if r < 0:
                err = -r
                if err in (errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.ENETUNREACH):
                    return  # the peer is gone; its timeout will surface
                if per > 1 and err in (errno.EIO, errno.EINVAL, errno.EOPNOTSUPP,
                                       errno.EMSGSIZE):
                    self._no_gso()
                    continue
                if err == errno.EMSGSIZE:
                    raise TransportError(
                        f"a {seg}-byte datagram does not fit the link to {addr[0]} (DF is "
                        "set, as RoCEv2 requires): choose a smaller mtu")
                raise OSError(err, os.strerror(err))
            done += r
            self.stats["tx_packets"] += r
            if done >= k:
                return
            select.select([], [self.sock], [], 0.01)

    def _gso_per(self, seg: int) -> int:
        """Datagrams of ``seg`` bytes per UDP_SEGMENT message (1 without GSO)."""
        return max(1, min(GSO_MAX_SEGMENTS, GSO_MAX_BYTES // seg)) if self.gso else 1

    def _sendmsg_each(self, parts: list | tuple, addr: tuple[str, int], seg: int) -> None:
        data = b"".join(parts)
        for i in range(0, len(data), seg):
            self._sendmsg((data[i:i + seg],), addr)

    def transmit_gather(self, run: GatherRun, k: int, addr: tuple[str, int]) -> None:
        """Send the first ``k`` packets of ``run`` through ``fp_send_gather`` (see
        :meth:`_send_batches`)."""
        send, fd, ref = self.fastpath.send_gather, self.sock.fileno(), self._sockaddr(addr)
        mtu, bth = run.mtu, wire.BTH_LEN
        meta, row = run.meta.__array_interface__["data"][0], run.meta.shape[1]
        src = run.src_address()
        self._send_batches(k, row + mtu, addr, lambda done, per: send(
            fd, meta + done * row, bth, src + done * mtu, k - done, mtu, per, ref))

    # ------------------------------------------------------------------ borrowed memory
    def protect(self, lo: int, hi: int) -> None:
        """Addresses ``[lo, hi)`` are about to be written: every borrowed message that
        may still read them takes its own copy first."""
        for key in [k for k, m in self.borrowed.items() if m.overlaps(lo, hi)]:
            self.borrowed.pop(key).own()
            self.stats["borrow_copies"] += 1

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

    def drop(self, reason: DropReason) -> None:
        self.drops[reason] += 1

    def qp_failed(self, qp: QueuePair, error: BaseException) -> None:
        self._qp_error = self._qp_error or error  # jobs not yet started fail with it too
        for job in self._jobs:
            # Closed here, on the engine thread: a program's clean-up (its borrowed SENDs
            # taking their own copies) must run before the caller has its buffers back,
            # not whenever and wherever the generator is collected.
            with contextlib.suppress(Exception):
                job.program.close()
            job.finish(error)
        self._jobs.clear()
        self.failed = error

    def _run(self) -> None:
        try:
            poller = select.poll()
            for sock in self._rx_socks:
                poller.register(sock, select.POLLIN)
            poller.register(self._wake_r, select.POLLIN)
            wake_fd = self._wake_r.fileno()
            qps: list[QueuePair] = []
            bulk = self._bulk_setup()
            bulk_stop = 0  # why fp_bulk returned, when the last turn ended in it
            while not self._stop:
                if len(qps) != len(self.by_peer):
                    qps = list(self.by_peer.values())
                if bulk_stop:
                    # What had arrived, fp_bulk took or left to _dispatch; after the
                    # latter, this turn is one whose receive found datagrams (a landed
                    # message may have queued a credit or a grant to send).
                    busy = bulk_stop == native.BULK_BATCH
                    bulk_stop = 0
                else:
                    busy = self._receive()
                now = time.monotonic()
                # Guards before the per-QP calls: this loop runs hundreds of times a
                # collective, and most turns find nothing for most QPs.
                for qp in qps:
                    if qp.ack_pending or qp.ack_due:
                        qp.flush_ack(now)
                    if qp.has_work() and qp.pump(now):
                        busy = True
                    if qp.outstanding:
                        qp.check_timer(now, self.rto_s)
                if self.arrivals_dirty:
                    self._match()
                if self._submitted or (self._jobs and (self.seq_due or now >= self._seq_at)):
                    self.seq_due = False
                    self._seq_at = now + SEQUENCE_POLL_S
                    if self._sequence(now):
                        # What a job posted or yields next may be done already.
                        self.seq_due = busy = True
                if not busy:
                    if bulk is not None:
                        bulk_stop = self._bulk(bulk, qps, now)
                        if bulk_stop:  # it waited, doing the steady state's work meanwhile
                            continue
                    # Yield before sleeping: on a shared CPU the peer this loop waits for
                    # often runs then, and its datagram is here without the wake-up's cost
                    # to both (the sender's system call wakes a sleeping receiver).
                    os.sched_yield()
                    events = poller.poll(0) or poller.poll(self._poll_ms(now))
                    if not events:
                        self.stats["poll_expired"] += 1
                    elif any(fd == wake_fd for fd, _ in events):
                        # Drain the wake-ups only when there are some: one system call
                        # fewer on every datagram-driven wake.
                        self._drain_wake()
        except BaseException as e:  # the engine must never die silently
            self.failed = e
            for job in (*self._jobs, *self._submitted):
                job.finish(e)

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except BlockingIOError:
            pass

    def _bulk_setup(self) -> native.Bulk | None:
        """The ``fp_bulk`` state of this engine's loop, its fixed fields filled; None
        where the C loop does not apply (no C send path: a tap or a link shim sees every
        datagram)."""
        if (self.fastpath is None or not self._native_tx
                or len(self._rx_socks) > native.BULK_FDS):
            return None
        b = native.Bulk()
        b.tx_fd, b.wake_fd, b.nfds = self.sock.fileno(), self._wake_r.fileno(), len(self._rx_socks)
        for i, sock in enumerate(self._rx_socks):
            b.fds[i] = sock.fileno()
        b.rxbuf = self._rxaddr
        b.lens, b.segs, b.addrs, b.ports = self._rxmeta_addr
        b.slot, b.nslots = native.SLOT_BYTES, _RX_SLOTS
        b.bth_len, b.psn_mask, b.ackreq_bit = wire.BTH_LEN, wire.PSN_MASK, wire.ACKREQ
        b.ack_kind, b.syn_shift = int(AethKind.ACK), wire.SYNDROME_SHIFT
        b.mtu = self.mtu
        b.crc = self.fastpath.crc.value
        b.yields = BULK_YIELDS
        return b

    def _bulk(self, b: native.Bulk, qps: list[QueuePair], now: float) -> int:
        """Wait for the next event in ``fp_bulk`` instead of poll when a queue pair is in
        the steady state of a large transfer (:meth:`QueuePair.bulk_rx`,
        :meth:`QueuePair.bulk_tx`): the C loop moves its MIDDLEs and ACKs meanwhile and
        returns on anything else, which this loop then takes from where it stopped.
        Returns why it returned (``native.BULK_*``), 0 when no queue pair is in that
        state."""
        if not BULK_LOOP:
            return 0
        b.rx_on = b.tx_on = 0
        rxq = txq = None
        meta = None
        per = self._gso_per(wire.BTH_LEN + self.mtu + wire.ICRC_LEN)
        for qp in qps:
            if rxq is None and qp.bulk_rx(b):
                rxq = qp
            if txq is None and (meta := qp.bulk_tx(b, per)) is not None:
                txq = qp
        if rxq is None and txq is None:
            return 0
        b.deadline = now + self._poll_ms(now) / 1000
        stop = self.fastpath.bulk(ctypes.byref(b))
        self.stats["bulk_runs"] += 1
        self.stats["bulk_rx_packets"] += b.rx_taken
        self.stats["bulk_tx_packets"] += b.sent
        self.stats["bulk_acks_rx"] += b.acks_rx
        self.stats["rx_packets"] += b.rx_taken + b.acks_rx
        self.stats["rx_coalesced"] += b.rx_taken
        self.stats["acks_tx"] += b.acks_tx
        if rxq is not None:
            rxq.bulk_rx_done(b)
        if txq is not None:
            txq.bulk_tx_done(b, meta)
        if stop == native.BULK_BATCH:
            self._dispatch(b.r, b.j, b.part, time.monotonic())
        elif stop == native.BULK_WAKE:
            self._drain_wake()
        elif stop == native.BULK_RX_ERROR:
            raise OSError(-b.err, os.strerror(-b.err))
        return stop

    def _poll_ms(self, now: float) -> int:
        wait = 0.05
        for qp in self.by_peer.values():
            if qp.outstanding:
                wait = min(wait, max(0.0, qp.last_progress + self.rto_s - now))
            if qp.ack_due > 0:
                wait = min(wait, max(0.0, qp.ack_due - now))
        if self._jobs:
            job = self._jobs[0]
            wait = min(wait, max(0.0, job.started + job.deadline_s - now))
        return max(1, int(wait * 1000))

    def _receive(self) -> bool:
        recv = self._receive_python if self.fastpath is None else self._receive_native
        if self._rx_ready is None:
            return recv(self.sock)
        # Sockets per peer: one poll finds the few with datagrams, where a recvmmsg on
        # each would mostly come back empty (a ring's receiver hears from one peer).
        got = False
        for fd, _ in self._rx_ready.poll(0):
            got |= recv(self._rx_by_fd[fd])
        return got

    def _receive_python(self, sock: socket.socket) -> bool:
        buf = self._rxview
        got = False
        now = time.monotonic()
        gro = self.gro
        anc_space = _GRO_CMSG_SPACE
        for _ in range(64):
            try:
                if gro:
                    n, anc, _flags, (src_ip, sport) = sock.recvmsg_into((buf,), anc_space)
                else:
                    n, (src_ip, sport) = sock.recvfrom_into(buf)
                    anc = ()
            except BlockingIOError:
                break
            except OSError as e:
                if e.errno == errno.ECONNREFUSED:
                    continue
                raise
            got = True
            seg = n
            for level, kind, data in anc:
                if level == SOL_UDP and kind == UDP_GRO:
                    seg = _GRO_SIZE.unpack(data[:_GRO_SIZE.size])[0]
            src = self._ips.get(src_ip)
            if src is None:
                src = self._ips[src_ip] = wire.ip_to_int(src_ip)
            if seg >= n:
                self._packet(buf[:n], n, src, sport, now)
                continue
            k = n // seg
            start = 0
            if k > 1:
                start = self._middle_run(self._rxarr[:k * seg], seg, k, src, sport) * seg
            for off in range(start, n, seg):
                m = min(seg, n - off)
                self._packet(buf[off:off + m], m, src, sport, now)
        return got

    def _receive_native(self, sock: socket.socket) -> bool:
        """:meth:`_receive_python` through ``fp_recv_batch``: up to ``_RX_SLOTS`` datagrams
        (or GRO runs) per recvmmsg, each then checked and dispatched as
        :meth:`_receive_python` does."""
        lens_a, segs_a, addrs_a, ports_a = self._rxmeta_addr
        fd = sock.fileno()
        while True:
            r = self.fastpath.recv_batch(fd, self._rxaddr, native.SLOT_BYTES,
                                         _RX_SLOTS, lens_a, segs_a, addrs_a, ports_a)
            if r != -errno.ECONNREFUSED:  # an ICMP error queued on the socket: read on
                break
        if r < 0:
            raise OSError(-r, os.strerror(-r))
        if r == 0:
            return False
        self._dispatch(r, 0, 0, time.monotonic())
        return True

    def _dispatch(self, r: int, j: int, part: int, now: float) -> None:
        """Check and dispatch receive batch entries ``j`` to ``r - 1`` (entry ``j`` from its
        datagram ``part`` on), as :meth:`_receive_native` and :meth:`_bulk` left them."""
        lens, segs, addrs, ports = self._rxmeta[:, :r].tolist()
        view = self._rxview
        while j < r:
            base, n, seg, sport = j * native.SLOT_BYTES, lens[j], segs[j], ports[j]
            src = socket.ntohl(addrs[j])
            start = part * seg
            if (not part and (n >= 2 * seg or seg == n) and n
                    and view[base] == _MIDDLE):
                # The steady state: run after run of one WRITE's MIDDLEs, all taken by
                # one C call; ``part`` datagrams of the run after the whole ones too.
                # Without GRO (a link shim's datagrams, say) each run is one datagram.
                whole, part = self._middle_runs(j, r, seg, src, sport)
                if whole:
                    j += whole
                    if not part:
                        continue
                    base, n, seg, sport = j * native.SLOT_BYTES, lens[j], segs[j], ports[j]
                    src = socket.ntohl(addrs[j])
                start = part * seg
            if n <= seg:  # one datagram; an empty one too (dropped as TRUNCATED)
                self._packet(view[base:base + n], n, src, sport, now)
            else:
                for off in range(start, n, seg):
                    m = min(seg, n - off)
                    self._packet(view[base + off:base + off + m], m, src, sport, now)
            j += 1
            part = 0

    def _middle_runs(self, j: int, r: int, seg: int, src: int, sport: int) -> tuple[int, int]:
        """:meth:`_middle_run` for the received runs j, j + 1, ... of a batch at once
        (``fp_take_runs``): how many runs were taken whole, and how many datagrams of
        the run after them. Run j starts with a MIDDLE opcode (the caller checks)."""
        base = j * native.SLOT_BYTES
        run = self._rxarr[base:base + 12]
        if seg <= wire.BTH_LEN + wire.ICRC_LEN or run[1]:
            return 0, 0
        _, _, _, dqpn, _ = wire.BTH_FMT.unpack_from(run)
        qp = self.qps.get(dqpn & wire.QPN_MASK)
        if qp is None:
            return 0, 0
        seed = wire.icrc_seed(src, qp.src_ip, sport, self.addr[1], wire.UDP_LEN + seg)
        taken, whole = qp.on_middle_runs(self._rxaddr, j, r, self._rxmeta_addr, seg, dqpn,
                                         seed)
        self.stats["rx_packets"] += taken
        self.stats["rx_coalesced"] += taken
        if not taken:
            return 0, 0
        done = sum(self._rxmeta[0, j:j + whole].tolist()) // seg
        return whole, taken - done

    def _middle_run(self, run: np.ndarray, seg: int, k: int, src: int, sport: int) -> int:
        """Take the leading datagrams of ``k`` coalesced ones of ``seg`` bytes at once as
        far as they are the next in-order RDMA WRITE MIDDLE packets of one QP with good
        ICRCs (the steady state of a large transfer); returns how many it took. The rest,
        whatever they are, go to :meth:`_packet` one by one, with every check and drop
        counter."""
        if seg <= wire.BTH_LEN + wire.ICRC_LEN or run[0] != _MIDDLE or run[1]:
            return 0  # not a MIDDLE, or a pad / header version / SE / MigReq bit
        _, _, _, dqpn, _ = wire.BTH_FMT.unpack_from(run)
        qp = self.qps.get(dqpn & wire.QPN_MASK)
        if qp is None:
            return 0
        seed = wire.icrc_seed(src, qp.src_ip, sport, self.addr[1], wire.UDP_LEN + seg)
        took = qp.on_middle_run(run.reshape(k, seg), seed)
        self.stats["rx_packets"] += took
        self.stats["rx_coalesced"] += took
        return took

    def _packet(self, buf: memoryview, n: int, src: int, sport: int, now: float) -> None:
        """Check and dispatch one datagram (``buf`` holds exactly its ``n`` bytes) from
        IPv4 address ``src`` (an int), UDP port ``sport``."""
        self.stats["rx_packets"] += 1
        if n < wire.BTH_LEN + wire.ICRC_LEN:
            self.drops[DropReason.TRUNCATED] += 1
            return
        opcode, b1, _pkey, dqpn, w2 = wire.BTH_FMT.unpack_from(buf)
        if b1 & 0xF:
            self.drops[DropReason.BTH_VERSION] += 1
            return
        if opcode not in SUPPORTED_OPCODES:
            self.drops[DropReason.UNKNOWN_OPCODE] += 1
            return
        qp = self.qps.get(dqpn & wire.QPN_MASK)
        if qp is None:
            self.drops[DropReason.BAD_QPN] += 1
            return
        psn = w2 & wire.PSN_MASK
        ackreq = bool(w2 & wire.ACKREQ)
        # The ICRC covers the sender's real IP and UDP source port: an HDL node sends
        # from udp_sport + qp (0xC000 + qp), a software engine from its bound port.
        seed = wire.icrc_seed(src, qp.src_ip, sport, self.addr[1], wire.UDP_LEN + n)
        want = wire.datagram_icrc(seed, wire.received_bth_masked(buf),
                                  buf[wire.BTH_LEN:n - wire.ICRC_LEN])
        if want != buf[n - wire.ICRC_LEN:n]:
            self.drops[DropReason.BAD_ICRC] += 1
            return
        if opcode == Opcode.ACKNOWLEDGE:
            (aeth,) = wire.AETH_FMT.unpack_from(buf, wire.BTH_LEN)
            qp.on_ack(psn, aeth >> wire.SYNDROME_SHIFT, now)
        elif opcode in _WRITES:
            qp.on_write(opcode, psn, ackreq, buf, n)
        else:
            self.drops[DropReason.UNKNOWN_OPCODE] += 1  # SENDs: no receive queue here

    def _match(self) -> None:
        """Hand arrived messages to posted receives, in arrival order per peer."""
        self.arrivals_dirty = False
        for peer, qp in self.by_peer.items():
            posted = self.posted[peer]
            if not qp.arrived or not posted:
                continue
            keep = []
            while qp.arrived:
                a = qp.arrived.popleft()
                step = a.step & ~wire.STEP_FINAL
                for op in posted:
                    if op.coll_id == a.coll_id and op.step == step:
                        break
                else:
                    keep.append(a)
                    continue
                self.seq_due = True
                try:
                    self._deliver(qp, op, a)
                except FpgacclError as e:
                    op.completion.error = e
                    op.completion.done = True
                if op.completion.done:
                    posted.remove(op)
            qp.arrived.extendleft(reversed(keep))

    def _deliver(self, qp: QueuePair, op: RecvOp, a: Arrival) -> None:
        start = a.slot * self.slot_bytes
        src = qp.ring.buf[start:start + a.length]
        end = op.off + a.length
        try:
            if end > op.nbytes:
                raise CountMismatchError(op.what, f"peer {qp.peer} sent more than the "
                                         f"{op.nbytes} bytes expected")
            if op.ufunc is None:
                op.dest.view(np.uint8).reshape(-1)[op.off:end] = src
            else:
                isz = op.dest.itemsize
                d = op.dest[op.off // isz:end // isz]
                op.ufunc(d, src.view(op.dest.dtype), out=d)
            op.off = end
            if a.step & wire.STEP_FINAL:
                if op.off != op.nbytes:
                    raise CountMismatchError(op.what, f"peer {qp.peer} sent {op.off} bytes, "
                                             f"{op.nbytes} expected")
                op.completion.finish_one()
        finally:
            qp.give_back(a.slot)

    def _sequence(self, now: float) -> bool:
        while self._submitted:
            self._jobs.append(self._submitted.popleft())
        progressed = False
        # Collectives share the collective region and its numbering: they run one at a
        # time, in order. A send or recv needs only its own messages, which per-peer
        # sequence numbers match: it neither waits behind another job nor holds one back,
        # so an irecv posted before its isend (or before an allreduce) completes, as
        # MPI's Irecv/Isend/Waitall does.
        i = 0
        ordered_blocked = False
        while i < len(self._jobs):
            job = self._jobs[i]
            if job.ordered and ordered_blocked:
                i += 1
                continue
            if not job.started:
                job.started = now
            err = None
            for c in job.waiting:
                if c.error is not None:
                    err = c.error
                    break
            if err is None and not all(c.done for c in job.waiting):
                err = self._qp_error
                if err is None:
                    if now - job.started > job.deadline_s:
                        err = CollectiveTimeoutError(
                            job.name, self.rank, job.deadline_s,
                            f"waiting on {sum(not c.done for c in job.waiting)} transfer(s)")
                    else:
                        ordered_blocked = ordered_blocked or job.ordered
                        i += 1
                        continue
            progressed = True
            try:
                got = job.program.throw(err) if err is not None else job.program.send(None)
            except StopIteration:
                del self._jobs[i]
                job.finish()
                continue
            except BaseException as e:
                # Whatever failed mid-schedule, peers and queue pairs are now out of step
                # with this rank: other jobs cannot be trusted to match, so fail them too.
                del self._jobs[i]
                job.finish(e)
                self.failed = e
                for other in self._jobs:
                    with contextlib.suppress(Exception):
                        other.program.close()  # its clean-up, on this thread (qp_failed)
                    other.finish(TransportError(f"aborted after {job.name} failed: {e}"))
                self._jobs.clear()
                continue
            job.waiting = _flatten(got)
            if self.arrivals_dirty:
                self._match()
        return progressed


def _flatten(got: Any) -> list[Completion]:
    if got is None:
        return []
    if isinstance(got, Completion) or hasattr(got, "done"):
        return [got]
    out: list[Completion] = []
    for g in got:
        out.extend(_flatten(g))
    return out
