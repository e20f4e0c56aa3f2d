"""One Reliable Connection queue pair: requester (send) and responder (receive) halves.

This is the software model of ``fpgaccl.hw.transport``: RDMA WRITE segmentation at the
path MTU, 24-bit PSNs, coalesced ACKs (the requester asks for one with the BTH AckReq
bit on the last packet of a message and every ``window/2`` packets), NAK on a sequence
gap, duplicate suppression, and a memory-key plus bounds check on every RDMA WRITE
before a byte is written. Recovery follows :mod:`fpgaccl.proto.reliability`: the
responder holds early WRITE MIDDLEs; the requester resends selectively to a software
peer and by go-back-N to an HDL one, within an AIMD congestion window and a retransmit
timeout measured per queue pair.

Two kinds of memory region take WRITEs, and the region a WRITE lands in says how its
immediate data reads:

* the per-peer receive ring (point-to-point and the schedules that are not sequencer
  programs: send/recv, alltoallv, barrier): every WRITE targets a slot of the ring, and
  the responder returns a slot with a zero-length credit once it is consumed; the
  immediate is :data:`fpgaccl.proto.RING_IMM`. That bounds receive memory to
  ``slots x slot_bytes`` per peer whatever the user buffer size.
* the collective region (:class:`fpgaccl.host.executor.CollectiveRegion`, writable
  from every QP): sequencer SENDs and GRANTs, exactly as the HDL router issues them;
  the immediate is :data:`fpgaccl.proto.COLLECTIVE_IMM`, and each message becomes a
  grant or landed event of its QP (``grants``/``landed``), consumed in order by
  :mod:`fpgaccl.host.executor`.
"""

from __future__ import annotations

import ctypes
import functools
import socket
import struct
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from fpgaccl.errors import RemoteAccessError
from fpgaccl.proto.drops import DropReason
from fpgaccl.proto.opcodes import (
    ACK_CREDIT_DUPLICATE,
    ACK_CREDIT_HELD,
    ACK_CREDIT_PEER_DEAD,
    ACK_CREDIT_REORDERING,
    AETH_OPCODES,
    LAST_OPCODES,
    ONLY_OPCODES,
    RETH_OPCODES,
    AethKind,
    NakCode,
    Opcode,
    aeth_syndrome,
    psn_diff,
    split_syndrome,
)
from fpgaccl.proto.reliability import NAK_HOLDOFF_PACKETS, hold_packets

from . import native, wire

if TYPE_CHECKING:
    from .engine import Engine
    from .fold import Fold

_FIRST_OR_ONLY = frozenset(int(o) for o in RETH_OPCODES)
_ENDS = frozenset(int(o) for o in LAST_OPCODES | ONLY_OPCODES)
_WITH_IMM = frozenset({Opcode.RDMA_WRITE_LAST_WITH_IMMEDIATE,
                       Opcode.RDMA_WRITE_ONLY_WITH_IMMEDIATE})
_WRITES = frozenset(int(o) for o in (Opcode.RDMA_WRITE_FIRST, Opcode.RDMA_WRITE_MIDDLE,
                                     Opcode.RDMA_WRITE_LAST,
                                     Opcode.RDMA_WRITE_LAST_WITH_IMMEDIATE,
                                     Opcode.RDMA_WRITE_ONLY,
                                     Opcode.RDMA_WRITE_ONLY_WITH_IMMEDIATE))
_ACK = int(Opcode.ACKNOWLEDGE)
_MIDDLE = int(Opcode.RDMA_WRITE_MIDDLE)
_AETH = frozenset(int(o) for o in AETH_OPCODES)
_ROW_EXTRA = wire.BTH_LEN + wire.ICRC_LEN

MIN_CWND = 16
"""Packets: the smallest congestion window a loss cuts to. A loss is NAKed only once
NAK_HOLDOFF_PACKETS behind it have arrived: with 4 in flight most losses at 10 % waited
for the timer (bench/loss.py). A higher floor for NAKed losses (which may be random, not
congestion) was faster at random loss, but a receive buffer that overflows loses most of
every burst, and only a window this small gets through it
(test_zero_copy_sends_survive_kernel_drops)."""
RTO_MIN_S = 0.003
"""The adaptive retransmit timeout's floor: a spurious expiry resends one packet only, and
a loaded machine's scheduling delays reach milliseconds; above engine.ACK_DELAY_S (2 ms), which a
coalesced ACK may wait."""
PROBE_MIN_S = 0.001
"""The tail-loss probe's floor (the first expiry, at twice the smoothed round trip): a
spurious probe costs one packet, and a stalled window behind a lost resend costs the
whole wait."""
REPORT_AGAIN_S = 0.001
"""A holding responder reports its holes again (on a duplicate, a probe or a filled gap)
at most this often: the requester acts on a report at most once a round trip anyway."""
REPORTS_AT_ONCE = 16
"""Hole reports a holding responder sends for one arrival, at most."""
REORDERING_S = 0.5
"""How long after the last reported hole that turned out late, not lost (its lone resend
arrived twice, or it filled before a resend), a hole's first report does not cut the
window. Cutting for late packets throttled bench/loss.py's 5 % reordering to the window
floor."""
LATE_SHARE = 0.25
"""The share of reported holes that must have been late (a moving average over about 32)
before a first report's resend waits out the reordering window: network duplication makes
a few lone resends arrive twice on any path, and deferring true losses there made 5 % loss
+ 2 % dup slower."""
NOTICE_EVERY_S = 0.05
"""A requester on a reordering path renews its reordering notice to the peer at most this
often (sooner if its reordering window grew by a quarter): each lasts REORDERING_S."""
NOTICE_AVERAGE = 8
"""A reordering notice goes once the share of late holes, averaged over this many (faster
than ``late_share``: the notice costs little where it is wrong, the peer drops it), is over
LATE_SHARE."""
HOLDOFF_MAX_S = 0.008
"""A responder holds a hole report back at most this long, whatever a notice asks."""
TRIES_PER_PEER_TIMEOUT = 8
"""The retransmit backoff is capped at ``peer_timeout_s / TRIES_PER_PEER_TIMEOUT``: a live
peer behind a lossy link gets this many tries before it is declared dead. With 10 % loss
each way a try fails 19 % of the time: the uncapped backoff's 4 tries in the default
1.25 s all fail once in ~800 stalls, and a 4 MiB allreduce at 10 % loss has hundreds
(bench/loss.py, idle: 2 of 7 such runs failed with PeerDeadError); 8 tries fail once in
~600,000."""
_BE32 = np.dtype(">u4")
_LE32 = np.dtype("<u4")


class Completion:
    """Done-flag of one posted operation; the sequencer waits on these."""

    __slots__ = ("done", "error", "peer", "pending", "what")

    def __init__(self, pending: int = 0, peer: int = -1, what: str = "") -> None:
        self.pending = pending
        # Whom it waits on, and for what: a timeout names them.
        self.peer = peer
        self.what = what
        self.done = pending == 0
        self.error: BaseException | None = None

    def finish_one(self) -> None:
        self.pending -= 1
        if self.pending <= 0:
            self.done = True


@dataclass
class MemoryRegion:
    """Registered memory: the only place a remote WRITE may land."""

    rkey: int
    buf: np.ndarray  # uint8, contiguous
    qpn: int  # the local QP allowed to write here (the ring of that peer)
    va: int = field(init=False)
    view: memoryview = field(init=False, repr=False)

    # (lo, hi, region): WRITEs that fall wholly inside bytes [lo, hi) of this region land
    # in ``region`` at offset - lo instead; see CollectiveRegion.bind_out.
    window: tuple[int, int, MemoryRegion] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.va = int(self.buf.ctypes.data)
        self.view = memoryview(self.buf)  # memoryview copies skip numpy's per-call overhead


@dataclass
class Message:
    """One RDMA WRITE with immediate: at most one ring slot of payload, or (``va`` set)
    a sequencer message to an explicit remote address.

    ``rows`` set (see :meth:`staged`): the payload was copied into one row per packet,
    laid out as that packet's datagram if it goes out as an RDMA WRITE MIDDLE
    (BTH | payload | ICRC), and ``data`` is unused. The MIDDLE packets then need no
    per-packet Python to build or send: the transport fills the PSN words and ICRCs of a
    run of rows and hands the kernel the rows as they lie.

    ``src`` set (see :meth:`borrowed`): the payload is read where it lies, in memory the
    engine does not own, until the peer has ACKed it. The MIDDLE packets go to the kernel
    gathered from their headers and that memory (:class:`GatherRun`); the FIRST and LAST
    packets carry copies. The engine keeps the message in ``Engine.borrowed`` and copies
    what is still unACKed (:meth:`own`) before anything writes over it."""

    data: memoryview | bytes
    imm: int
    completion: Completion | None
    slot: int = -1  # -1: a credit message, needs no slot
    va: int = -1    # >= 0: a direct WRITE to (va, rkey), no ring slot
    rkey: int = 0
    rows: np.ndarray | None = None  # uint8 (packets, BTH + mtu + ICRC) when staged
    size: int = -1  # payload bytes (len(data) unless staged)
    pool: RowPool | None = None  # where ``rows`` go back once the peer has them all
    src: np.ndarray | None = None  # uint8, payload bytes [src_off, size) when borrowed
    src_off: int = 0
    src_addr: int = 0  # src's address
    lo: int = 0  # payload bytes before ``lo`` are ACKed: no retransmission reads them

    def __post_init__(self) -> None:
        if self.size < 0:
            self.size = len(self.data)

    @classmethod
    def staged(cls, src: np.ndarray, mtu: int, imm: int, *, va: int, rkey: int,
               pool: RowPool | None = None) -> Message:
        """A message carrying a snapshot of ``src`` (any contiguous array), staged in rows
        for ``mtu``-byte packets: one copy, the one a snapshot needs anyway. With a
        ``pool``, the rows come from it and go back once the peer has ACKed them all."""
        raw = src.reshape(-1).view(np.uint8)
        n = raw.size
        npk = max(1, -(-n // mtu))
        rows = (pool.take(npk, _ROW_EXTRA + mtu) if pool is not None
                else np.empty((npk, _ROW_EXTRA + mtu), np.uint8))
        full = n // mtu
        if full:
            rows[:full, wire.BTH_LEN:wire.BTH_LEN + mtu] = raw[:full * mtu].reshape(full, mtu)
        if n - full * mtu:
            rows[full, wire.BTH_LEN:wire.BTH_LEN + n - full * mtu] = raw[full * mtu:]
        return cls(b"", imm, None, va=va, rkey=rkey, rows=rows, size=n, pool=pool)

    @classmethod
    def borrowed(cls, src: np.ndarray, imm: int, *, va: int, rkey: int) -> Message:
        """A message whose payload stays in ``src`` (contiguous) until ACKed: the caller
        registers it in ``Engine.borrowed``, which copies it when ``src`` is written."""
        raw = src.reshape(-1).view(np.uint8)
        return cls(b"", imm, None, va=va, rkey=rkey, size=raw.size, src=raw,
                   src_addr=raw.__array_interface__["data"][0])

    def overlaps(self, lo: int, hi: int) -> bool:
        """Whether the borrowed bytes still needed lie in addresses ``[lo, hi)``."""
        a = self.src_addr + self.lo - self.src_off
        return a < hi and lo < self.src_addr + self.size - self.src_off

    def own(self) -> None:
        """Copy the borrowed bytes a retransmission may still read (``[lo, size)``):
        from now on the message no longer depends on the memory it was built from."""
        keep = np.array(self.src[self.lo - self.src_off:], np.uint8)  # a copy
        self.src, self.src_off = keep, self.lo
        self.src_addr = keep.__array_interface__["data"][0]

    def payload(self, off: int, n: int, mtu: int) -> memoryview | bytes:
        """Payload bytes ``[off, off + n)``; ``off`` is a packet boundary."""
        if self.src is not None:
            # A copy: the packet's parts may outlive the borrowed memory's contents.
            return self.src[off - self.src_off:off - self.src_off + n].tobytes()
        if self.rows is None:
            return self.data[off:off + n]
        return memoryview(self.rows[off // mtu])[wire.BTH_LEN:wire.BTH_LEN + n]


class RowPool:
    """Staging rows kept for reuse by the next staged messages.

    A freshly allocated multi-megabyte array is mapped on first touch, and the kernel
    zeroes every page of it: at 64 MiB per allreduce that page clearing was an eighth of
    the engine's CPU. Rows handed back once their message is fully ACKed are taken again
    by the next message of the same row width; at most ``limit_bytes`` are kept idle."""

    def __init__(self, limit_bytes: int = 32 << 20) -> None:
        self.limit_bytes = limit_bytes
        self.idle: list[np.ndarray] = []
        self.idle_bytes = 0

    def take(self, rows: int, width: int) -> np.ndarray:
        best = -1
        for i, a in enumerate(self.idle):
            if a.shape[1] == width and a.shape[0] >= rows and (
                    best < 0 or a.shape[0] < self.idle[best].shape[0]):
                best = i
        if best < 0:
            return np.empty((rows, width), np.uint8)
        a = self.idle.pop(best)
        self.idle_bytes -= a.nbytes
        return a[:rows]

    def give(self, rows: np.ndarray) -> None:
        base = rows if rows.base is None else rows.base
        if isinstance(base, np.ndarray) and base.ndim == 2 and \
                self.idle_bytes + base.nbytes <= self.limit_bytes:
            self.idle.append(base)
            self.idle_bytes += base.nbytes


_RUN_FORMATS: dict[tuple[int, int], tuple[struct.Struct, struct.Struct]] = {}


def _run_formats(k: int, seg: int) -> tuple[struct.Struct, struct.Struct]:
    """Structs reading, from ``k`` datagrams of ``seg`` bytes back to back, each one's
    first 8 BTH bytes and PSN word (big-endian), and each one's ICRC (little-endian)."""
    fmts = _RUN_FORMATS.get((k, seg))
    if fmts is None:
        fmts = _RUN_FORMATS[(k, seg)] = (
            struct.Struct(">" + f"QI{seg - wire.BTH_LEN}x" * k),
            struct.Struct("<" + f"{seg - wire.ICRC_LEN}xI" * k))
    return fmts


@functools.lru_cache(maxsize=256)
def _middle_state(seed: int, dqpn: int) -> int:
    """The ICRC's CRC state after a WRITE MIDDLE's masked first 8 BTH bytes, from the
    pseudo-header ``seed``: the same for every MIDDLE of a QP pair and size."""
    return wire.crc32(wire.bth_masked(_MIDDLE, 0, dqpn, False, 0)[:8], seed)


def _head8(opcode: int, dqpn: int) -> ctypes.Array:
    """The first 8 BTH bytes of a packet of ours (no flags, the P_Key) as ``uint8_t[8]``."""
    return (ctypes.c_uint8 * 8)(*wire.BTH_FMT.pack(opcode, 0, wire.PKEY, dqpn, 0)[:8])


class GatherRun:
    """An outstanding run of MIDDLE packets of a borrowed message: the packets from byte
    ``off`` of ``msg``'s payload, one ``meta`` row (BTH | ICRC) each. Resending it reads
    the payload where ``msg`` keeps it now (borrowed, or its own copy)."""

    __slots__ = ("meta", "msg", "mtu", "off")

    def __init__(self, msg: Message, off: int, meta: np.ndarray, mtu: int) -> None:
        self.msg, self.off, self.meta, self.mtu = msg, off, meta, mtu

    def src_address(self) -> int:
        return self.msg.src_addr + self.off - self.msg.src_off

    def after(self, n: int) -> GatherRun:
        """The run without its first ``n`` packets."""
        return GatherRun(self.msg, self.off + n * self.mtu, self.meta[n:], self.mtu)


ANY_QP = -1
"""``MemoryRegion.qpn`` of a region every QP may write (the collective region)."""
_NO_REGION = MemoryRegion(0, np.zeros(0, np.uint8), ANY_QP)
"""Where a zero-length WRITE with a key of no region "lands": nowhere (not the ring)."""


@dataclass
class Arrival:
    coll_id: int
    step: int
    slot: int
    length: int


class QueuePair:
    def __init__(self, engine: Engine, peer: int, qpn: int, *, slot_bytes: int, slots: int,
                 ring: MemoryRegion) -> None:
        self.engine = engine
        self.peer = peer
        self.qpn = qpn
        self.slot_bytes = slot_bytes
        self.ring = ring  # where the peer writes to us
        # Filled by connect() from the rendezvous.
        self.remote_qpn = 0
        self.addr: tuple[str, int] = ("", 0)
        self.peer_sport = self.peer_sport_alt = -1  # none until connected
        self.src_ip = 0
        self.dst_ip = 0
        self.remote_va = 0
        self.remote_rkey = 0
        # Requester state.
        self.next_psn = 0
        self.pending: deque[Message] = deque()
        self.credits: deque[Message] = deque()
        self.direct: deque[Message] = deque()  # sequencer SEND/GRANT, in program order
        self.free_slots: deque[int] = deque(range(slots))
        self.cur: Message | None = None
        self.cur_off = 0
        self.cur_va = 0
        # Sent, not yet acknowledged, oldest first: (first PSN, datagram, message if this
        # ends it, packets). One entry per packet (its parts, a tuple), or one per run of
        # staged MIDDLE rows (packets > 1: the run's contiguous bytes, a memoryview).
        self.outstanding: deque[tuple[int, Any, Message | None, int]] = deque()
        self.inflight = 0  # packets in ``outstanding``
        self.since_ackreq = 0
        self.last_progress = 0.0
        self.retries = 0
        # Liveness (Engine.check_liveness): since when the peer owes an ACK it has not
        # sent, counting only time with something outstanding; and since when a probe
        # (Engine.probe) has gone unanswered, 0 when none.
        self.acked_at = 0.0
        self.probed = 0.0
        # When the peer last sent anything that passed the checks (Receiver.packet and
        # the C paths): a peer heard from lately needs no probe, and answered any.
        self.heard_at = 0.0
        self.closed_at = 0.0  # when an ICMP port unreachable came for the peer's address
        self.error: BaseException | None = None
        # Recovery (proto/reliability.py). ``selective``: the peer holds early packets (a
        # software engine; set at rendezvous), so a NAK resends the NAKed packet alone and,
        # once the ACKs reach ``gbn_psn`` (-1: none), everything from there.
        self.selective = False
        self.gbn_psn = -1
        self.gbn_probe = False  # a timer probe armed gbn_psn (the responder may be slow)
        # AIMD congestion window (packets, inf: the engine's window), cut at most once a
        # round trip: losses of PSNs before ``recover_psn`` share the cut.
        self.cwnd = float("inf")
        self.ssthresh = float("inf")
        self.recover_psn = -1
        # The farthest PSN a holding peer said it holds (a holding report; -1: none): the
        # window counts only what lies past it and the holes before it (send_limit).
        self.held_top = -1
        # The last NAK acted on, and until which PSN a go-back-N resent from it.
        self.nak_psn = -1
        self.nak_at = 0.0
        self.resent_to = -1
        self.hole_at: dict[int, float] = {}  # PSN -> when a hole report had it resent
        # Reordering (REORDERING_S): when each recent PSN was resent alone (-1: more
        # than once, or not alone), the window before the last cut for a reported hole
        # (that hole, cwnd, ssthresh), when a hole last turned out late, the share of
        # holes that did (LATE_SHARE), how long they were late (the reordering window),
        # and the reported holes whose resend waits for it (PSN -> when reported).
        self.resent_alone: dict[int, float] = {}
        self.undo: tuple[int, float, float] | None = None
        self.reordered_at = -REORDERING_S
        self.late_share = 0.0
        self.reo_wnd = 0.0
        self.deferred: dict[int, float] = {}
        self.notice_share = 0.0  # late_share, averaged over NOTICE_AVERAGE
        self.notified_at = -REORDERING_S  # our last reordering notice to the peer
        self.notified_wnd = 0.0
        # The peer holds its hole reports back from notice_from (a round trip after the
        # notice: reports on their way were not) until notice_until.
        self.notice_from = self.notice_until = 0.0
        # Round-trip time (RFC 6298 estimator, Karn's rule): one timed PSN at a time.
        self.srtt = 0.0
        self.rttvar = 0.0
        self.rto = getattr(engine, "rto_s", float("inf"))  # the measured one only lowers it
        self.rtt_psn = -1
        self.rtt_at = 0.0
        # Responder state.
        self.epsn = 0
        self.msn = 0
        self.nak_sent = False
        self.dropped_early = False  # an early packet was dropped since the last in-order one
        self.dropped_to = -1  # the last PSN dropped early, until epsn passes it
        self.held: set[int] = set()  # PSNs ahead of epsn whose MIDDLE is already written
        # Early packets kept aside for a selective peer: PSN -> (opcode, AckReq, datagram).
        self.early: dict[int, tuple[int, int, bytes]] = {}
        self.reported = -1  # holes before this PSN are reported to a selective peer
        self.top = -1  # the farthest PSN held, while any is
        self.reported_at = 0.0  # when the holes were last all reported again
        self.again_at = 0.0  # when a report again that came too soon is due (0: none)
        # A reordering notice from the peer: until holdoff_until, each hole report waits
        # ``holdoff`` first (PSN -> when due), and a late packet filling it spares it.
        # Where few are spared (spare_share, a moving average over about 16, under
        # LATE_SHARE) the notice was wrong: reports go at once, and notices are ignored
        # for REORDERING_S.
        self.holdoff = 0.0
        self.holdoff_until = 0.0
        self.pending_reports: dict[int, float] = {}
        self.spare_share = 0.0
        self.notices_ignored_until = 0.0
        self.ack_pending = False
        # Deferred ACKs (software peers only: the communicator sets ``ack_delay`` from the
        # rendezvous): ack_due 0 = none, -1 = one waits for the engine to stamp it, else
        # the monotonic time it is due. An HDL peer keeps immediate ACKs: its retransmit
        # timer counts clock cycles, not milliseconds.
        self.ack_delay = 0.0
        self.ack_due = 0.0
        self.w_off = -1  # ring offset of the WRITE in progress, -1 when none
        self.fold: Fold | None = None  # the RECV_REDUCE the sequencer waits on (host/fold.py)
        self.w_fold: Fold | None = None  # the fold the WRITE in progress goes through
        self.w_len = 0
        self.w_done = 0
        self.w_mr: MemoryRegion = ring
        self.w_va = 0   # the RETH VA of the WRITE in progress
        self.arrived: deque[Arrival] = deque()
        # Sequencer events from this peer, in arrival order: (coll_id, step).
        self.grants: deque[tuple[int, int, int]] = deque()   # coll_id, step, digest
        self.landed: deque[tuple[int, int, int]] = deque()  # (coll_id, step, bytes)
        self.local_port = engine.addr[1]  # our UDP source port, part of the ICRC
        self._ack: wire.AckSealer | None = None  # this QP's ACKs, once connected
        self._peer_ack: wire.AckSealer | None = None  # the peer's to us (fp_bulk checks them)
        self.fastpath = getattr(engine, "fastpath", None)  # the C loops, if the engine has them
        self._ackreq = ctypes.c_uint32()
        self._ackreq_ref = ctypes.byref(self._ackreq)
        self._whole = ctypes.c_uint32()
        self._whole_ref = ctypes.byref(self._whole)

    def connect(self, *, remote_qpn: int, addr: tuple[str, int], local_ip: str, send_psn: int,
                recv_psn: int, remote_va: int, remote_rkey: int,
                peer_sport: int | None = None) -> None:
        """``peer_sport``: the UDP port the peer sends from, where it is known; a software
        engine sends from its bound port (``addr[1]``), an HDL node from
        :func:`wire.hdl_sport` of its QPN. Unknown (None): either of those two."""
        self.remote_qpn = remote_qpn
        self.addr = addr
        # Only these (the peer's address, and one of at most two ports) speak for the QP.
        self.peer_sport = addr[1] if peer_sport is None else peer_sport
        self.peer_sport_alt = wire.hdl_sport(remote_qpn) if peer_sport is None else peer_sport
        self.src_ip = wire.ip_to_int(local_ip)
        self.dst_ip = wire.ip_to_int(addr[0])
        self.next_psn = send_psn
        self.epsn = recv_psn
        self.remote_va = remote_va
        self.remote_rkey = remote_rkey
        self._ack = wire.AckSealer(self.src_ip, self.dst_ip, remote_qpn, self.local_port,
                                   addr[1])
        self._peer_ack = wire.AckSealer(self.dst_ip, self.src_ip, self.qpn, addr[1],
                                        self.local_port)

    # ---------------------------------------------------------------- requester
    def post(self, msg: Message) -> None:
        (self.credits if msg.slot == -1 and msg.completion is None else self.pending).append(msg)

    def post_direct(self, msg: Message) -> None:
        self.direct.append(msg)

    def has_work(self) -> bool:
        return self.cur is not None or bool(self.credits) or bool(self.direct) or (
            bool(self.pending) and bool(self.free_slots))

    def window(self) -> int:
        """Packets that may be outstanding: the congestion window within the engine's."""
        w = self.engine.window
        return w if self.cwnd >= w else max(MIN_CWND, int(self.cwnd))

    def half(self) -> int:
        """AckReq cadence: every half window, so that a small window still gets ACKs."""
        return max(1, self.window() // 2)

    def _oldest(self) -> int:
        """The oldest unACKed PSN (the next one, when nothing is outstanding)."""
        return (self.next_psn - self.inflight) & wire.PSN_MASK

    def send_limit(self) -> int:
        """How many packets may be outstanding: the window, plus those a holding peer
        reported it holds past the oldest unACKed (a holding report, proto/reliability.py):
        they have left the network, so a hole stalls nothing for its round trip. Within
        the engine's window (the responder holds that much)."""
        window, top = self.window(), self.held_top
        if top < 0 or not self.inflight:
            return window
        oldest = self._oldest()
        upto = psn_diff(top, oldest)  # packets before top, the oldest (a hole) among them
        if not 0 < upto < self.inflight:
            return window
        holes = 1 + sum(1 for q in self.hole_at if 0 < psn_diff(q, oldest) < upto)
        holes += sum(1 for q in self.deferred if 0 < psn_diff(q, oldest) < upto)
        return min(self.engine.window, window + max(0, upto + 1 - holes))

    def pump(self, now: float) -> bool:
        """Send new packets while the window allows; True if anything went out."""
        window = self.send_limit()
        psn0 = self.next_psn
        burst: list[tuple] = []
        sent = False
        while self.inflight < window and self.error is None:
            msg = self.cur
            if msg is None:
                if self.credits:
                    msg = self.credits.popleft()
                    self.cur_va = self.remote_va
                elif self.direct:
                    msg = self.direct.popleft()
                    self.cur_va = msg.va
                elif self.pending and self.free_slots:
                    msg = self.pending.popleft()
                    msg.slot = self.free_slots.popleft()
                    self.cur_va = self.remote_va + msg.slot * self.slot_bytes
                else:
                    break
                self.cur = msg
                self.cur_off = 0
            left = msg.size - self.cur_off
            if self.cur_off and left > self.engine.mtu:
                if burst:  # keep the wire order: what came before goes first
                    self.engine.transmit_many(burst, self.addr)
                    burst = []
                k = min((left - 1) // self.engine.mtu, window - self.inflight)
                if msg.src is not None:
                    self._middle_gather(msg, k, now)
                elif msg.rows is not None:
                    self._middle_rows(msg, k, now)
                else:
                    self._middles(msg, k, now)
                sent = True
            else:
                burst.append(self._segment(msg, now))
        if burst:
            self.engine.transmit_many(burst, self.addr)
            sent = True
        if sent and self.rtt_psn < 0 and self.next_psn != psn0:
            self.rtt_psn, self.rtt_at = (self.next_psn - 1) & wire.PSN_MASK, now
        return sent

    def _segment(self, msg: Message, now: float) -> tuple:
        """The next packet of ``msg``, recorded as outstanding; returns its parts."""
        mtu = self.engine.mtu
        off = self.cur_off
        total = msg.size
        n = min(mtu, total - off)
        first = off == 0
        last = off + n >= total
        if first and last:
            opcode = Opcode.RDMA_WRITE_ONLY_WITH_IMMEDIATE
        elif first:
            opcode = Opcode.RDMA_WRITE_FIRST
        elif last:
            opcode = Opcode.RDMA_WRITE_LAST_WITH_IMMEDIATE
        else:
            opcode = Opcode.RDMA_WRITE_MIDDLE
        ext = b""
        if first:
            ext = wire.RETH_FMT.pack(self.cur_va, msg.rkey if msg.va >= 0 else self.remote_rkey,
                                     total)
        if last:
            ext += wire.IMM_FMT.pack(msg.imm)
        self.since_ackreq += 1
        ackreq = last or self.since_ackreq >= self.half()
        if ackreq:
            self.since_ackreq = 0
        psn = self.next_psn
        self.next_psn = (psn + 1) & wire.PSN_MASK
        payload = msg.payload(off, n, mtu)
        pad = -n & 3
        udp_len = wire.UDP_LEN + wire.BTH_LEN + len(ext) + n + pad + wire.ICRC_LEN
        seed = wire.icrc_seed(self.src_ip, self.dst_ip, self.local_port, self.addr[1], udp_len)
        hdr = wire.bth(opcode, pad, self.remote_qpn, ackreq, psn) + ext
        tail = bytes(pad)
        tail += wire.datagram_icrc(seed, wire.bth_masked(opcode, pad, self.remote_qpn, ackreq, psn),
                                   ext, payload, tail)
        parts = (hdr, payload, tail)
        if not self.outstanding:
            self.last_progress = self.acked_at = now
        self.outstanding.append((psn, parts, msg if last else None, 1))
        self.inflight += 1
        if last:
            self.cur = None
        else:
            self.cur_off = off + n
        return parts

    def _middles(self, msg: Message, k: int, now: float) -> None:
        """Send the next ``k`` packets of ``msg``, all RDMA WRITE MIDDLE (full MTU, no
        pad): what :meth:`_segment` would build one by one, in one tight loop, handed to
        the engine as one run of equal datagrams. The payloads stay views of the message
        (no copy); the kernel gathers each datagram from its three parts."""
        mtu = self.engine.mtu
        half = self.half()
        data = msg.data
        off = self.cur_off
        psn = self.next_psn
        since = self.since_ackreq
        seed = wire.icrc_seed(self.src_ip, self.dst_ip, self.local_port, self.addr[1],
                              wire.UDP_LEN + wire.BTH_LEN + mtu + wire.ICRC_LEN)
        # The BTH's first 8 bytes are the same for the whole run: its real bytes, and the
        # CRC state after its masked bytes. Only the PSN word (which the ICRC covers
        # unmasked: MASK_W2 == 0) and the payload change from packet to packet.
        dqpn = self.remote_qpn
        head = wire.BTH_FMT.pack(_MIDDLE, 0, wire.PKEY, dqpn, 0)[:8]
        state = _middle_state(seed, dqpn)
        word, crc32, icrc = wire.IMM_FMT.pack, wire.crc32, wire.ICRC_FMT.pack
        if not self.outstanding:
            self.last_progress = self.acked_at = now
        append = self.outstanding.append
        flat: list = []
        for _ in range(k):
            since += 1
            w2 = psn
            if since >= half:
                w2 |= wire.ACKREQ
                since = 0
            payload = data[off:off + mtu]
            w = word(w2)
            parts = (head + w, payload, icrc(crc32(payload, crc32(w, state))))
            append((psn, parts, None, 1))
            flat += parts
            psn = (psn + 1) & wire.PSN_MASK
            off += mtu
        self.inflight += k
        self.next_psn = psn
        self.since_ackreq = since
        self.cur_off = off
        self.engine.transmit_run(flat, k, wire.BTH_LEN + mtu + wire.ICRC_LEN, self.addr)

    def _middle_rows(self, msg: Message, k: int, now: float) -> None:
        """:meth:`_middles` for a staged message: the next ``k`` MIDDLE packets are rows
        of ``msg.rows`` already holding their payloads. Their BTHs (PSN words and AckReq
        bits as :meth:`_segment` would set them) and ICRCs are written in place, whole
        columns at a time, and the rows go to the engine as one contiguous run; the
        outstanding entry is the run, not each packet."""
        mtu = self.engine.mtu
        half = self.half()
        seg = _ROW_EXTRA + mtu
        j = self.cur_off // mtu
        run = msg.rows[j:j + k]
        psn = self.next_psn
        since = self.since_ackreq
        dqpn = self.remote_qpn
        seed = wire.icrc_seed(self.src_ip, self.dst_ip, self.local_port, self.addr[1],
                              wire.UDP_LEN + seg)
        state = _middle_state(seed, dqpn)
        head = wire.BTH_FMT.pack(_MIDDLE, 0, wire.PKEY, dqpn, 0)[:8]
        fp = self.fastpath
        if fp is not None:
            self.since_ackreq = fp.seal_rows(run.ctypes.data, k, seg, head, psn, wire.PSN_MASK,
                                             wire.ACKREQ, since, half, state, fp.crc)
        else:
            self._seal_rows(run, head, psn, since, half, state)
            self.since_ackreq = (since + k) % half
        flat = memoryview(run).cast("B")
        if not self.outstanding:
            self.last_progress = self.acked_at = now
        self.outstanding.append((psn, flat if k > 1 else (flat,), None, k))
        self.inflight += k
        self.next_psn = (psn + k) & wire.PSN_MASK
        self.cur_off += k * mtu
        self._send_rows(flat, k, seg)

    def _middle_gather(self, msg: Message, k: int, now: float) -> None:
        """:meth:`_middle_rows` for a borrowed message: the next ``k`` MIDDLE packets'
        BTHs and ICRCs are sealed into a small ``meta`` array (``fp_seal_meta``, the ICRC
        over the payload where it lies) and the kernel gathers each datagram from its
        header, its payload and its ICRC; the payload is never copied in user space."""
        mtu = self.engine.mtu
        meta = np.empty((k, _ROW_EXTRA), np.uint8)
        run = GatherRun(msg, self.cur_off, meta, mtu)
        fp = self.fastpath
        self.since_ackreq = fp.seal_meta(
            meta.__array_interface__["data"][0], wire.BTH_LEN, run.src_address(), k, mtu,
            wire.BTH_FMT.pack(_MIDDLE, 0, wire.PKEY, self.remote_qpn, 0)[:8], self.next_psn,
            wire.PSN_MASK, wire.ACKREQ, self.since_ackreq, self.half(),
            self._send_middle_state(), fp.crc)
        if not self.outstanding:
            self.last_progress = self.acked_at = now
        self._gathered(run, k)
        self.engine.transmit_gather(run, k, self.addr)

    def _send_middle_state(self) -> int:
        """The ICRC's CRC state after our MIDDLEs' pseudo-header and masked BTH head."""
        seed = wire.icrc_seed(self.src_ip, self.dst_ip, self.local_port, self.addr[1],
                              wire.UDP_LEN + _ROW_EXTRA + self.engine.mtu)
        return _middle_state(seed, self.remote_qpn)

    def _gathered(self, run: GatherRun, k: int) -> None:
        """``run``'s ``k`` MIDDLEs, sealed from the next PSN on, are outstanding."""
        self.outstanding.append((self.next_psn, run, None, k))
        self.inflight += k
        self.next_psn = (self.next_psn + k) & wire.PSN_MASK
        self.cur_off += k * self.engine.mtu

    @staticmethod
    def _seal_rows(run: np.ndarray, head: bytes, psn: int, since: int, half: int,
                   state: int) -> None:
        """The Python path of :meth:`_middle_rows`' sealing (``fp_seal_rows`` in C): BTH
        bytes, PSN words with their AckReq bits, and ICRCs, written into the rows."""
        k, seg = run.shape
        run[:, 0:8] = np.frombuffer(head, np.uint8)
        # Packet i is the (since + i + 1)-th since the last AckReq: every half window asks.
        idx = np.arange(k, dtype=np.uint32)
        w2 = (idx + np.uint32(psn)) & np.uint32(wire.PSN_MASK)
        w2 |= np.where((idx + np.uint32(since + 1)) % np.uint32(half) == 0,
                       np.uint32(wire.ACKREQ), np.uint32(0))
        run[:, 8:12] = w2.astype(_BE32).view(np.uint8).reshape(k, 4)
        flat = memoryview(run).cast("B")
        crc32 = wire.crc32
        tail = seg - wire.ICRC_LEN
        # The ICRC covers the PSN word unmasked (MASK_W2 == 0) and then the payload, which
        # follow each other in a row: one CRC call per packet from the state after the
        # masked first 8 BTH bytes.
        crcs = [crc32(flat[b:b + tail - 8], state) for b in range(8, k * seg, seg)]
        run[:, tail:] = np.array(crcs, np.uint32).astype(_LE32).view(np.uint8).reshape(k, 4)

    def _send_rows(self, flat: memoryview, k: int, seg: int) -> None:
        send = getattr(self.engine, "transmit_rows", None)
        if send is not None:
            send(flat, k, seg, self.addr)
            return
        # An engine without contiguous runs (a test double): one datagram at a time.
        for b in range(0, k * seg, seg):
            self.engine.transmit((flat[b:b + seg],), self.addr)

    def on_ack(self, psn: int, syndrome: int, now: float, msn: int | None = None) -> None:
        kind, code = split_syndrome(syndrome)
        # Only a PSN we sent and is not yet ACKed may be NAKed or ACKed; an ACK may also
        # repeat the newest one ACKed (a responder's answer to a duplicate).
        d = psn_diff(psn, self._oldest())
        if not (0 if kind == AethKind.NAK else -1) <= d < self.inflight:
            self.engine.drop(DropReason.ACK_PSN_INVALID)
            return
        self.engine.stats["acks_rx"] += 1
        self.probed = 0.0
        if kind == AethKind.NAK and code == NakCode.PSN_SEQUENCE_ERROR:
            self.engine.stats["nak_rx"] += 1
            if self._acked(psn - 1, now, nak=True):
                return  # it moved the ACKs to where the unheld rest was resent from
            if (self.selective and msn is not None and msn != psn
                    and 0 < psn_diff(msn, psn) < self.inflight):
                # A later hole (proto/reliability.py).
                if self._resent_lately(msn, now):
                    # A report that crossed the hole's resend: no news.
                    self.engine.stats["nak_ignored"] += 1
                    return
                self._cut_reported(msn, now)
                if not self._defer(msn, now):
                    self._resend_hole(msn, now)
                return
            if self.selective and self._resent_lately(psn, now):
                # The gap is a hole already resent: its resend is still on its way.
                self.engine.stats["nak_ignored"] += 1
                return
            if not self.selective and self._stale_nak(psn, now):
                self.engine.stats["nak_ignored"] += 1
                return
            self.nak_psn, self.nak_at = psn, now
            if self.selective:
                self._cut_reported(psn, now)
                if not self._defer(psn, now):
                    self._repair(now)
            else:
                self._cut(psn)
                self.retransmit(now, why="nak")
        elif kind == AethKind.NAK:
            self.error = RemoteAccessError(
                f"peer {self.peer} NAKed PSN {psn}: {NakCode(code).name}"
                if code in NakCode._value2member_map_ else f"peer {self.peer}: NAK code {code}")
            self.engine.qp_failed(self, self.error)
        elif kind == AethKind.ACK:
            self._acked(psn, now)
            if code == ACK_CREDIT_DUPLICATE and self.selective and msn is not None:
                self._arrived_twice(msn, now)
            elif code == ACK_CREDIT_REORDERING and self.selective and msn is not None:
                self._noticed(msn * 1e-6, now)
            elif code == ACK_CREDIT_HELD and self.selective and msn is not None:
                self._peer_holds(msn)
            elif code == ACK_CREDIT_PEER_DEAD and self.selective and msn is not None:
                self.engine.peer_reported_dead(self, msn)
        else:
            # RNR NAK (this engine never asks for a receive to be posted first) or the
            # reserved kind: no action, as in the HDL requester, but counted.
            self.engine.stats["ack_ignored"] += 1

    def _peer_holds(self, psn: int) -> None:
        """A holding report: the peer holds ``psn``, past a hole (send_limit)."""
        self.engine.stats["held_reports_rx"] += 1
        oldest = self._oldest()
        if 0 < psn_diff(psn, oldest) < self.inflight and (
                self.held_top < 0 or psn_diff(psn, self.held_top) > 0):
            self.held_top = psn

    def _acked(self, psn: int, now: float, nak: bool = False) -> bool:
        """Retire what an ACK of ``psn`` covers; True if that resent the rest (the
        responder had all before ``gbn_psn`` and could hold nothing after it). ``nak``:
        it came in a NAK, which says the responder dropped what follows; an ACK that
        stops there after a timer probe may come from a responder that is only slow to
        take what follows, so that resends MIN_CWND packets and looks again."""
        out = self.outstanding
        if not out:
            return False
        # Outstanding PSNs are consecutive: the ACK covers the first n of them.
        n = min(psn_diff(psn, out[0][0]) + 1, self.inflight)
        if n <= 0:
            return False
        self.inflight -= n
        self.last_progress = self.acked_at = now
        if self.hole_at:
            self.hole_at = {p: t for p, t in self.hole_at.items() if psn_diff(p, psn) > 0}
        if self.held_top >= 0 and psn_diff(self.held_top, psn) <= 0:
            self.held_top = -1  # all it held is ACKed
        self.retries = 0
        self.probed = 0.0
        if self.rtt_psn >= 0 and psn_diff(psn, self.rtt_psn) >= 0:
            self._rtt_sample(now - self.rtt_at)
        if self.cwnd < self.engine.window:
            # Slow start below the threshold, then one packet per window of ACKs.
            self.cwnd += n if self.cwnd < self.ssthresh else n / self.cwnd
        self._pop_acked(n)
        if self.deferred:
            self._filled_late(now)
        if self.gbn_psn >= 0 and (not out or psn_diff(out[0][0], self.gbn_psn) >= 0):
            # Stopping right there says the responder dropped it; past it, it had it.
            resend = bool(out) and out[0][0] == self.gbn_psn
            self.gbn_psn = -1
            if resend:
                if nak or not self.gbn_probe or self.inflight <= MIN_CWND:
                    self.retransmit(now, why="unheld")
                else:
                    self.retransmit(now, MIN_CWND, why="unheld")
                    self.gbn_psn = (out[0][0] + MIN_CWND) & wire.PSN_MASK
                return True
        return False

    def _pop_acked(self, n: int) -> None:
        out = self.outstanding
        pop = out.popleft
        while n:
            first, parts, msg, k = out[0]
            if type(parts) is GatherRun:
                m = min(n, k)
                parts.msg.lo = parts.off + m * parts.mtu  # never read again
                if k > n:
                    out[0] = ((first + n) & wire.PSN_MASK, parts.after(n), msg, k - n)
                    return
            elif k > n:  # the ACK ends inside a run: keep its unacknowledged tail
                seg = len(parts) // k
                rest = parts[n * seg:]
                out[0] = ((first + n) & wire.PSN_MASK, rest if k - n > 1 else (rest,), msg,
                          k - n)
                return
            pop()
            n -= k
            if msg is not None:
                if msg.src is not None:
                    self.engine.release(msg)
                if msg.pool is not None and msg.rows is not None:
                    # Its last packet is ACKed, so every packet is: no resend reads them.
                    msg.pool.give(msg.rows)
                    msg.rows = None
                if msg.completion is not None:
                    msg.completion.finish_one()
                    self.engine.seq_due = True

    def _rtt_sample(self, rtt: float) -> None:
        self.rtt_psn = -1
        if self.srtt:
            self.rttvar = 0.75 * self.rttvar + 0.25 * abs(self.srtt - rtt)
            self.srtt = 0.875 * self.srtt + 0.125 * rtt
        else:
            self.srtt, self.rttvar = rtt, rtt / 2
        self.rto = min(getattr(self.engine, "rto_s", float("inf")),
                       max(RTO_MIN_S, self.srtt + 4 * self.rttvar))

    def _stale_nak(self, psn: int, now: float) -> bool:
        """Whether a NAK asks for what a resend already covers: the same PSN again within a
        timeout (a duplicated NAK; a responder NAKs a gap once), or, after a go-back-N, a
        PSN it resent less than a round trip ago (the responder saw a reordered packet
        before the resent ones)."""
        if self.nak_psn < 0 or now - self.nak_at >= self.rto:
            return False
        if psn == self.nak_psn:
            return True
        return (not self.selective and self.resent_to >= 0 and now - self.nak_at < self.srtt
                and psn_diff(psn, self.nak_psn) >= 0 and psn_diff(psn, self.resent_to) < 0)

    def _cut(self, psn: int) -> bool:
        """Halve the congestion window for a loss at ``psn``, once per round trip; True
        if it did."""
        if self.recover_psn >= 0 and psn_diff(psn, self.recover_psn) < 0:
            return False
        w = max(MIN_CWND, min(self.cwnd, self.engine.window, max(self.inflight, 1)) / 2)
        self.cwnd = self.ssthresh = w
        self.recover_psn = self.next_psn
        self.engine.stats["window_cuts"] += 1
        return True

    def _cut_reported(self, psn: int, now: float) -> None:
        """A holding responder reported ``psn`` missing (not resent within a round trip:
        the caller looked): a loss, unless this path reorders (REORDERING_S) and ``psn``
        was not resent before. The cut is undone if its packet's resend turns out
        needless (:meth:`_arrived_twice`)."""
        if now - self.reordered_at < REORDERING_S and psn not in self.resent_alone:
            self.engine.stats["window_cuts_spared"] += 1
            return
        before = (self.cwnd, self.ssthresh)
        if self._cut(psn):
            self.undo = (psn, *before)

    def _reordering(self, now: float) -> bool:
        return now - self.reordered_at < REORDERING_S and self.late_share > LATE_SHARE

    def _defer(self, psn: int, now: float) -> bool:
        """On a reordering path, a first report of ``psn`` waits out the reordering
        window before its resend (RACK's idea): a late packet fills the hole meanwhile.
        False if it is resent now."""
        if (not self.reo_wnd or psn in self.resent_alone or not self._reordering(now)
                or self.notice_from <= now < self.notice_until):
            return False  # (the peer held its report back: the hole is overdue)
        if psn not in self.deferred:
            self.deferred[psn] = now
            self.engine.stats["resends_deferred"] += 1
        return True

    def _filled_late(self, now: float) -> None:
        """The deferred holes the ACKs have passed filled without a resend: late."""
        oldest = self._oldest()
        for psn, at in list(self.deferred.items()):
            if not 0 <= psn_diff(psn, oldest) < self.inflight:
                del self.deferred[psn]
                self.engine.stats["holes_filled_late"] += 1
                self._late(now - at, now)

    def run_deferred(self, now: float) -> None:
        """Resend the deferred holes whose wait is over."""
        self._filled_late(now)
        for psn, at in list(self.deferred.items()):
            if now >= at + self.reo_wnd:
                del self.deferred[psn]
                if psn == self.outstanding[0][0]:
                    self._repair(now)
                else:
                    self._resend_hole(psn, now)

    def deferred_due(self) -> float:
        """When the next deferred resend is due (inf: none)."""
        return min(self.deferred.values()) + self.reo_wnd if self.deferred else float("inf")

    def _late(self, late: float, now: float) -> None:
        """A reported hole turned out ``late`` seconds late, not lost."""
        self.reordered_at = now
        self.late_share += (1.0 - self.late_share) / 32
        # Up at once, down slowly; never beyond a few round trips, the resend's latest.
        late = min(late, 4 * (self.srtt or self.rto))
        self.reo_wnd = late if late > self.reo_wnd else self.reo_wnd - (self.reo_wnd - late) / 8
        self.notice_share += (1.0 - self.notice_share) / NOTICE_AVERAGE
        if self.notice_share > LATE_SHARE:
            self._notify_reordering(now)

    def _notify_reordering(self, now: float) -> None:
        """Ask the peer to hold each hole report back for the reordering window (a
        reordering notice, proto/reliability.py): a late packet then costs no report, no
        resend and no duplicate report. Renewed at most every NOTICE_EVERY_S, sooner
        once the window grew by a quarter."""
        if not self.selective or (now - self.notified_at < NOTICE_EVERY_S
                                  and self.reo_wnd <= 1.25 * self.notified_wnd):
            return
        if now >= self.notice_until:
            self.notice_from = now + (self.srtt or self.rto)
        self.notified_at, self.notified_wnd = now, self.reo_wnd
        self.notice_until = now + REORDERING_S
        self.engine.stats["reordering_notices"] += 1
        self.send_ack(wire.REORDERING_SYNDROME, (self.epsn - 1) & wire.PSN_MASK,
                      min(round(self.reo_wnd * 1e6), wire.MSN_MASK))

    def _resent(self, psn: int, now: float) -> None:
        """``psn`` was resent alone (for a report, not a timer): a duplicate report of it
        may prove the resend needless."""
        r = self.resent_alone
        r[psn] = -1.0 if psn in r else now
        self.late_share -= self.late_share / 32
        self.notice_share -= self.notice_share / NOTICE_AVERAGE
        self._forget_resends()

    def _forget_resends(self) -> None:
        r = self.resent_alone
        if len(r) > 2 * hold_packets(self.engine.mtu):  # reports of the oldest are late
            for q in list(r)[:len(r) // 2]:
                del r[q]

    def _arrived_twice(self, psn: int, now: float) -> None:
        """A duplicate report (proto/reliability.py) names ``psn``: if it was resent
        alone once, the original arrived after all, late, not lost. The path reorders;
        the cut made for that hole is undone."""
        at = self.resent_alone.pop(psn, -1.0)
        if at < 0:
            return  # not resent, or resent more than once: either copy may be the resend
        self.engine.stats["resends_needless"] += 1
        self._late(now - at, now)
        if self.undo is not None and self.undo[0] == psn:
            _, cwnd, ssthresh = self.undo
            self.undo = None
            self.cwnd, self.ssthresh = max(self.cwnd, cwnd), max(self.ssthresh, ssthresh)
            self.recover_psn = -1  # no loss in that round trip after all
            self.engine.stats["window_cuts_undone"] += 1

    def _repair(self, now: float, probe: bool = False) -> None:
        """A NAK from a holding responder (proto/reliability.py), or a timer ``probe``:
        resend the oldest packet alone; what the responder could not hold is resent once
        the ACKs reach it (``gbn_psn``)."""
        if not self.outstanding:
            return
        self.gbn_probe = probe
        self.last_progress = now
        self.rtt_psn = -1
        self.engine.stats["retx_probe" if probe else "retx_oldest"] += 1
        self._resend_one(self.outstanding[0], 0)
        lost = self.outstanding[0][0]
        if self.selective:
            self.hole_at[lost] = now
            if probe:  # not for a report: a copy of it proves nothing
                self.resent_alone[lost] = -1.0
            else:
                self._resent(lost, now)
        # A go-back-N responder holds nothing after a gap.
        first = self._unheld_from() if self.selective else (lost + 1) & wire.PSN_MASK
        self.gbn_psn = first if psn_diff(first, self.next_psn) < 0 else -1
        self.resent_to = (lost + 1) & wire.PSN_MASK

    def _unheld_from(self) -> int:
        """The first outstanding PSN that a holding software responder, missing the
        oldest, could not have held: it keeps whatever lies within hold_packets."""
        start = self.outstanding[0][0]
        limit = hold_packets(self.engine.mtu)
        if psn_diff(self.next_psn, start) <= limit:
            return self.next_psn
        return (start + limit) & wire.PSN_MASK

    def _resent_lately(self, psn: int, now: float) -> bool:
        """Whether ``psn`` was resent alone less than a round trip ago (the timeout
        until a round trip is measured)."""
        return now - self.hole_at.get(psn, -1.0) < (self.srtt or self.rto)

    def _resend_hole(self, psn: int, now: float) -> None:
        """Resend the outstanding packet ``psn`` alone, once a round trip at most."""
        if self._resent_lately(psn, now):
            self.engine.stats["nak_ignored"] += 1
            return
        for entry in self.outstanding:
            i = psn_diff(psn, entry[0])
            if i < entry[3]:
                self.hole_at[psn] = now
                self._resent(psn, now)
                self.rtt_psn = -1
                self.engine.stats["retx_hole"] += 1
                self._resend_one(entry, i)
                return

    def _resend_one(self, entry: tuple, i: int) -> None:
        """Resend packet ``i`` of an ``outstanding`` entry alone."""
        self.engine.stats["retransmits"] += 1
        _, parts, _, k = entry
        if type(parts) is GatherRun:
            self.engine.transmit_gather(parts.after(i) if i else parts, 1, self.addr)
        elif k == 1:
            self.engine.transmit(parts, self.addr)
        else:
            seg = len(parts) // k
            self.engine.transmit((parts[i * seg:(i + 1) * seg],), self.addr)

    def retransmit(self, now: float, limit: int = 0, why: str = "timer") -> None:
        """Go-back-N: resend every unacknowledged packet, oldest first (the first
        ``limit`` only, if it is not 0); counted under ``retx_<why>`` too."""
        self.last_progress = now
        if not self.outstanding:
            return
        self.rtt_psn = -1
        left = limit if 0 < limit < self.inflight else self.inflight
        if self.selective:
            # Each may now arrive twice: a duplicate report of it proves nothing.
            oldest = self.outstanding[0][0]
            self.resent_alone.update(dict.fromkeys(
                [(oldest + i) & wire.PSN_MASK for i in range(left)], -1.0))
            self._forget_resends()
            self.undo = None
        self.resent_to = (self.next_psn - self.inflight + left) & wire.PSN_MASK
        self.engine.stats["retransmits"] += left
        self.engine.stats["retx_" + why] += left
        batch: list = []
        for _, parts, _, k in self.outstanding:
            if not left:
                break
            n = min(k, left)
            left -= n
            gather = type(parts) is GatherRun
            if k == 1 and not gather:
                batch.append(parts)
                continue
            if batch:
                self.engine.transmit_many(batch, self.addr)
                batch = []
            if gather:
                self.engine.transmit_gather(parts, n, self.addr)
            else:
                self._send_rows(parts, n, len(parts) // k)
        if batch:
            self.engine.transmit_many(batch, self.addr)

    def timer_wait(self, rto: float) -> float:
        """How long after ``last_progress`` the retransmit timer expires (``rto``: the
        engine's timeout, the most this QP's measured one may be)."""
        # The first expiry is a tail-loss probe at twice the smoothed round trip (the
        # variance's margin only from the second try on). Later ones back off from the
        # measured timeout where a peer timeout judges liveness, never so far that it
        # sees fewer than TRIES_PER_PEER_TIMEOUT tries; without one, from the engine's,
        # so that retry_limit still spans seconds.
        base = min(rto, self.rto)
        if not self.retries:
            return max(PROBE_MIN_S, min(base, 2 * self.srtt)) if self.srtt else base
        peer_timeout = getattr(self.engine, "peer_timeout_s", None)
        if peer_timeout:
            return min(base * (1 << min(self.retries, 4)), peer_timeout / TRIES_PER_PEER_TIMEOUT)
        return rto * (1 << min(self.retries, 4))

    def check_timer(self, now: float, rto: float) -> None:
        """``rto``: the engine's timeout, the most this QP's measured one may be."""
        if self.deferred:
            self.run_deferred(now)
        if not self.outstanding:
            return
        wait = self.timer_wait(rto)
        peer_timeout = getattr(self.engine, "peer_timeout_s", None)
        if now - self.last_progress > wait:
            self.retries += 1
            self.engine.stats["timeouts"] += 1
            self.rtt_psn = -1
            if self.retries > 1:
                self._cut(self.outstanding[0][0])
            limit = getattr(self.engine, "retry_limit", None)
            if limit is not None and self.retries > limit and not peer_timeout:
                # As the HDL requester: ``limit`` retransmissions without an ACK that
                # moved the window, then the QP fails. With a peer timeout the retries
                # are closer together, and that timeout judges the silence instead.
                self.engine.peer_dead(self, f"{limit} retransmissions went unACKed")
                return
            if self.retries == 1:
                # First expiry: probe with the oldest packet only. On a starved CPU most
                # timeouts are spurious, and the responder re-ACKs a duplicate, so this
                # avoids resending a whole window that already arrived; a real loss is
                # recovered by the go-back-N on the next expiry (or by a NAK).
                self.last_progress = now
                self._repair(now, probe=True)  # and then what the peer could not hold
            elif self.selective and self.inflight > MIN_CWND:
                # A software responder holds what reached it, and reports its holes on
                # the probe; but a full socket buffer may have taken whole bursts (and
                # its reports). A window's floor goes again, the next once the ACKs stop
                # exactly where this one ends (_acked), and none once they pass it.
                self.retransmit(now, MIN_CWND, why="timer")
                self.gbn_probe = True
                self.gbn_psn = (self.outstanding[0][0] + MIN_CWND) & wire.PSN_MASK
            else:
                self.retransmit(now, why="timer")

    # ---------------------------------------------------------------- responder
    def on_write(self, opcode: int, psn: int, ackreq: int, pkt: memoryview, end: int) -> None:
        self._on_write(opcode, psn, ackreq, pkt, end)
        early = self.early
        if not early:
            return
        # Packets kept aside that now follow in order are taken as if they arrived now.
        while (kept := early.pop(self.epsn, None)) is not None:
            self._on_write(kept[0], self.epsn, kept[1], memoryview(kept[2]), len(kept[2]))
        if early and psn_diff(self.epsn, psn) > 0:
            # A new gap with packets behind it: it has waited long enough (as
            # _advance_held), unless its report is held back, and the NAK ACKs what
            # precedes it.
            self._report_again()
            if not self.nak_sent and self.epsn not in self.pending_reports:
                self.ack_pending = False
                self._nak_gap()

    def _on_write(self, opcode: int, psn: int, ackreq: int, pkt: memoryview, end: int) -> None:
        eng = self.engine
        d = psn_diff(psn, self.epsn)
        if d < 0:
            # A retransmission of something we have: drop it, re-ACK so the sender
            # learns how far we got even if our earlier ACK was lost (and what we still
            # miss: the sender probes when its timer finds its resends lost too).
            eng.drop(DropReason.PSN_DUPLICATE)
            if self.selective:
                self._report_duplicate(psn)
            else:
                self.ack_pending = True
            if self.top >= 0 and self.selective:
                self._report_again()
            return
        if d > 0:
            if self._hold(opcode, psn, ackreq, d, pkt, end):
                return
            eng.drop(DropReason.PSN_OUT_OF_ORDER)
            self.dropped_early = True
            if self.dropped_to < 0 or psn_diff(psn, self.dropped_to) > 0:
                self.dropped_to = psn
            if self.selective:
                self._report_holes(d)
            self._nak_gap()
            return
        pos = wire.BTH_LEN
        if opcode in _FIRST_OR_ONLY:
            va, rkey, dlen = wire.RETH_FMT.unpack_from(pkt, pos)
            pos += wire.RETH_LEN
            mr = eng.mrs.get(rkey)
            if mr is not None and mr.qpn != self.qpn and mr.qpn != ANY_QP:
                mr = None
            self.w_va = va
            off = -1 if mr is None else va - mr.va
            if (mr is None or off < 0 or off + dlen > len(mr.buf)) and dlen == 0:
                # IBTA: a zero-length WRITE's R_Key and VA are not validated (a GRANT
                # carries its signature digest in the VA). A key that names a region
                # still tells a ring message from a sequencer event; an unknown one is
                # the latter.
                self._discard_held()
                self.reported = -1
                self.w_off, self.w_len, self.w_done = 0, 0, 0
                self.w_mr = _NO_REGION if mr is None else mr
                self.w_fold = None
            else:
                if mr is None:
                    return self._access_error(DropReason.BAD_RKEY, psn)
                if off < 0 or off + dlen > len(mr.buf):
                    return self._access_error(DropReason.OUT_OF_BOUNDS, psn)
                win = mr.window
                if win is not None and win[0] <= off and off + dlen <= win[1]:
                    mr, off = win[2], off - win[0]
                self._discard_held()  # none should be left: held MIDDLEs precede their LAST
                self.reported = -1
                if eng.borrowed:
                    # A message of ours may still need what this WRITE is about to overwrite.
                    eng.protect(mr.va + off, mr.va + off + dlen)
                self.w_off, self.w_len, self.w_done, self.w_mr = off, dlen, 0, mr
                f = self.fold
                self.w_fold = f if f is not None and f.lands_at(mr.va + off, dlen) else None
        elif self.w_off < 0:
            # MIDDLE/LAST without a FIRST: the sequence of opcodes is broken.
            eng.drop(DropReason.ACCESS_DENIED)
            self.nak_sent = True
            self.send_ack(aeth_syndrome(AethKind.NAK, NakCode.INVALID_REQUEST), psn)
            return
        imm = -1
        if opcode in _WITH_IMM:
            imm = wire.IMM_FMT.unpack_from(pkt, pos)[0]
            pos += wire.IMM_LEN
        pad = (pkt[1] >> 4) & 3
        n = end - wire.ICRC_LEN - pad - pos
        if n < 0 or self.w_done + n > self.w_len or (
                opcode in _ENDS and self.w_done + n != self.w_len):
            self.w_off = -1
            self._discard_held()
            return self._access_error(DropReason.OUT_OF_BOUNDS, psn)
        if n:
            start = self.w_off + self.w_done
            self.w_mr.view[start:start + n] = pkt[pos:pos + n]
            self.w_done += n
        self.epsn = (self.epsn + 1) & wire.PSN_MASK
        if self.nak_sent or self.dropped_early:
            # It fills a gap we NAKed or dropped behind: the requester learns at once how
            # far we are (a holding requester resends the rest only then).
            self.ack_pending = True
            self.dropped_early = False
        self.nak_sent = False
        if self.held:
            self._advance_held()
        if self.dropped_to >= 0:
            if psn_diff(self.dropped_to, self.epsn) < 0:
                self.dropped_to = -1
            elif self.selective and not self.held and not self.nak_sent:
                # All before is here, and we dropped what follows: a NAK, not an ACK, so
                # that the requester tells this from a slow responder (once: its
                # go-back-N answers it).
                self.dropped_to = -1
                self.ack_pending = False
                self._nak_gap()
        if ackreq:
            if self.ack_delay and opcode in _ENDS and self.w_mr is not self.ring:
                # A sequencer message's end: its sender waits on no ACK (only its window
                # and retransmit timer do), so the ACK may wait to cover later ones too.
                if not self.ack_due:
                    self.ack_due = -1.0
            else:
                self.ack_pending = True
        if opcode in _ENDS:
            self.msn = (self.msn + 1) & wire.MSN_MASK
            if imm >= 0 and self.w_mr is not self.ring:
                # The collective region: COLLECTIVE_IMM, an event for the executor.
                eng.seq_due = True
                if (imm >> 16) in eng.dead_colls:
                    pass
                elif imm & wire.IMM_GRANT:
                    # The grant's VA: the granting rank's signature digest (0: none).
                    self.grants.append((imm >> 16, imm & wire.IMM_STEP_MASK, self.w_va))
                    eng.events += 1
                else:
                    self.landed.append((imm >> 16, imm & wire.IMM_STEP_MASK, self.w_len))
                    # The message the sequencer waits on: no later WRITE may be folded.
                    self.fold = None
            elif imm >= 0:
                coll_id, step = wire.unpack_imm(imm)
                slot = self.w_off // self.slot_bytes
                if step == wire.STEP_CREDIT:
                    self.free_slots.append(coll_id)
                elif coll_id in eng.dead_colls and \
                        step & ~wire.STEP_FINAL != wire.STEP_P2P:
                    self.give_back(slot)   # what is left of a call that failed its check
                else:
                    self.arrived.append(Arrival(coll_id, step, slot, self.w_len))
                    eng.arrivals_dirty = True
                    eng.events += 1
            self.w_off = -1
            self.w_fold = None

    def _discard_held(self) -> None:
        """The WRITE the held packets belong to is over: they count as discarded."""
        if self.held:
            self.engine.stats["rx_held_discarded"] += len(self.held)
            self.held.clear()

    def _hold(self, opcode: int, psn: int, ackreq: int, d: int, pkt: memoryview,
              end: int) -> bool:
        """Hold an early packet ``d`` PSNs ahead (proto/reliability.py): a MIDDLE of the
        WRITE in progress is written where it belongs; toward a selective peer anything
        else is kept aside. False if it may not be held."""
        mtu = self.engine.mtu
        if d >= hold_packets(mtu):
            return False
        if psn in self.held or psn in self.early:
            self.engine.drop(DropReason.PSN_DUPLICATE)
            if self.selective:
                self._report_duplicate(psn)
                self._report_again()
            return True
        if (opcode == _MIDDLE and self.w_off >= 0 and not pkt[1] & 0x30
                and end - wire.BTH_LEN - wire.ICRC_LEN == mtu
                and (d + 1) * mtu < self.w_len - self.w_done):
            start = self.w_off + self.w_done + d * mtu
            self.w_mr.view[start:start + mtu] = pkt[wire.BTH_LEN:wire.BTH_LEN + mtu]
            self.held.add(psn)
        elif self.selective:
            self.early[psn] = (opcode, ackreq, bytes(pkt[:end]))
        else:
            return False
        self.engine.stats["rx_held"] += 1
        self._held_to(psn, d)
        if ackreq:
            self._report_held()
        return True

    def _held_to(self, psn: int, d: int) -> None:
        """Packets up to ``psn``, ``d`` PSNs ahead, are now held: report the holes behind
        it to a selective peer, else NAK the gap once it is the holdoff or more behind."""
        if self.top < 0 or psn_diff(psn, self.top) > 0:
            self.top = psn
        if self.selective:
            self._report_holes(d)
        elif d >= NAK_HOLDOFF_PACKETS:
            self._nak_gap()

    def _report_holes(self, d: int) -> None:
        """A packet ``d`` PSNs ahead has arrived: report each PSN that is still missing
        NAK_HOLDOFF_PACKETS or more behind it, once, to a selective peer (a NAK whose MSN
        names the hole: proto/reliability.py). While the peer's reordering notice lasts,
        each report waits out its holdoff first (:meth:`run_reports`)."""
        end = min(d - NAK_HOLDOFF_PACKETS + 1, hold_packets(self.engine.mtu))
        start = max(0, psn_diff(self.reported, self.epsn)) if self.reported >= 0 else 0
        if end <= start:
            return
        epsn, held, early, pending = self.epsn, self.held, self.early, self.pending_reports
        if self.holdoff and self.holdoff_until > (now := time.monotonic()):
            due = now + self.holdoff
            for i in range(start, end):
                q = (epsn + i) & wire.PSN_MASK
                if q not in held and q not in early and q not in pending:
                    pending[q] = due
                    self.engine.stats["reports_held_back"] += 1
            self.reported = (epsn + end) & wire.PSN_MASK
            return
        sent = 0
        for i in range(start, end):
            q = (epsn + i) & wire.PSN_MASK
            if q in pending:
                continue  # held back: reported when due
            if not i:
                self._nak_gap()
            elif q not in held and q not in early:
                if sent == REPORTS_AT_ONCE:
                    # The rest on a later arrival: a burst of reports into a receive
                    # buffer that overflowed takes the ACKs and probes with it.
                    self.reported = q
                    return
                sent += 1
                self._report_hole(q)
        self.reported = (epsn + end) & wire.PSN_MASK

    def _report_hole(self, psn: int) -> None:
        """Name the missing ``psn`` to a selective peer: a NAK for the expected PSN whose
        MSN is the hole."""
        self.engine.stats["holes_reported"] += 1
        self.send_ack(aeth_syndrome(AethKind.NAK, NakCode.PSN_SEQUENCE_ERROR), self.epsn, psn)

    def _noticed(self, holdoff: float, now: float) -> None:
        """The peer's reordering notice: hold each hole report to it back ``holdoff``
        seconds, for REORDERING_S."""
        self.engine.stats["reordering_notices_rx"] += 1
        if now < self.notices_ignored_until:
            return
        if now >= self.holdoff_until:
            self.spare_share = 1.0  # the peer's word, until the holes tell otherwise
        self.holdoff = min(holdoff, HOLDOFF_MAX_S)
        self.holdoff_until = now + REORDERING_S

    def run_reports(self, now: float) -> None:
        """Send the held-back hole reports that are due; a hole that filled meanwhile was
        late, and costs nothing more; and the holes again, if that was asked too soon."""
        if self.again_at and now >= self.again_at:
            self._report_again(due=True)
        epsn, held, early = self.epsn, self.held, self.early
        for q, due in list(self.pending_reports.items()):
            if psn_diff(q, epsn) < 0 or q in held or q in early:
                del self.pending_reports[q]
                self.engine.stats["reports_spared"] += 1
                self.spare_share += (1.0 - self.spare_share) / 16
            elif now >= due:
                del self.pending_reports[q]
                self.spare_share -= self.spare_share / 16
                if self.spare_share < LATE_SHARE and self.holdoff_until > now:
                    self.holdoff_until = 0.0  # these holes were lost, not late
                    self.notices_ignored_until = now + REORDERING_S
                    self.engine.stats["holdoffs_dropped"] += 1
                if q == epsn:
                    self._nak_gap()
                else:
                    self._report_hole(q)

    def reports_due(self) -> float:
        """When the next held-back hole report is due (inf: none)."""
        due = min(self.pending_reports.values()) if self.pending_reports else float("inf")
        return min(due, self.again_at) if self.again_at else due

    def _report_held(self) -> None:
        """An early packet that asked for an ACK is held: tell a selective peer how far
        this responder holds (a holding report, proto/reliability.py), so that its window
        does not wait out the hole."""
        if self.selective:
            self.ack_pending = False
            self.engine.stats["held_reports"] += 1
            self.send_ack(wire.HELD_SYNDROME, (self.epsn - 1) & wire.PSN_MASK, self.top)

    def _report_duplicate(self, psn: int) -> None:
        """``psn`` arrived twice: tell a selective peer (a duplicate report, which ACKs
        what precedes the first hole as any ACK does), so that a resend that turns out
        needless undoes its window cut (proto/reliability.py)."""
        self.ack_pending = False
        self.engine.stats["duplicates_reported"] += 1
        self.send_ack(wire.DUPLICATE_SYNDROME, (self.epsn - 1) & wire.PSN_MASK, psn)

    def _report_again(self, due: bool = False) -> None:
        """Report every hole behind the farthest held packet again, the first with a NAK
        even if one was sent (a resend of it may be lost), at most once a millisecond:
        the requester resends each at most once a round trip."""
        if not (self.held or self.early):
            self.top = -1
            self.again_at = 0.0
            return
        now = time.monotonic()
        if not due and now - self.reported_at < REPORT_AGAIN_S:
            # Not dropped, delayed (run_reports): the resends it would ask for may be
            # lost, and the next event that asks again may be the timer's.
            self.again_at = self.again_at or self.reported_at + REPORT_AGAIN_S
            return
        self.reported_at = now
        self.again_at = 0.0
        self.reported = -1
        self.nak_sent = False
        self.ack_pending = False
        self._report_holes(psn_diff(self.top, self.epsn) + NAK_HOLDOFF_PACKETS - 1)

    def _nak_gap(self) -> None:
        if not self.nak_sent:
            self.nak_sent = True
            self.send_ack(aeth_syndrome(AethKind.NAK, NakCode.PSN_SEQUENCE_ERROR), self.epsn,
                          self.epsn if self.selective else None)

    def _advance_held(self) -> None:
        """The expected PSN jumps over the held MIDDLEs that now follow in order."""
        held, mtu = self.held, self.engine.mtu
        psn, m = self.epsn, 0
        while psn in held:
            held.discard(psn)
            psn = (psn + 1) & wire.PSN_MASK
            m += 1
        if m:
            self.epsn = psn
            self.w_done += m * mtu
            self.ack_pending = True
        if not held and not self.early:
            self.again_at = 0.0  # no hole left to report
        if (held and not self.nak_sent and self.epsn not in self.pending_reports
                and self.epsn not in self.early):
            # Held packets behind a new gap: it has waited long enough (unless its report
            # is held back, or it is no gap: on_write is taking what it kept aside). The
            # NAK also ACKs everything before it.
            self.ack_pending = False
            if self.selective:
                self._report_again()
            self._nak_gap()

    def on_middle_run(self, rows: np.ndarray, seed: int) -> int:
        """``rows``: k coalesced datagrams of equal size (one per row, contiguous), the
        first an RDMA WRITE MIDDLE to this QP (the Python path; the C one is
        :meth:`on_middle_runs`). Take the leading ones that are MIDDLEs with the first
        one's BTH flags, P_Key and QPN, are the next PSNs of the WRITE in progress, fit it
        and carry a good ICRC: write their payloads, with the effect of :meth:`on_write`
        on each in turn, and return how many were taken. The first that fails any check,
        and all after it, are left to :meth:`on_write`: nothing of theirs is written
        here."""
        if self.w_off < 0 or wire.MASK_W2 or self._recovering():
            return 0
        k, seg = rows.shape
        pay = seg - wire.BTH_LEN - wire.ICRC_LEN
        k = min(k, (self.w_len - self.w_done) // pay)
        if k <= 0:
            return 0
        _, _, _, dqpn, _ = wire.BTH_FMT.unpack_from(rows)
        # CRC state after the masked first 8 BTH bytes; the PSN word is covered unmasked
        # and lies right before the payload, so one CRC call per packet covers both.
        state = _middle_state(seed, dqpn & wire.QPN_MASK)
        m, ackreq = self._take_middles(rows[:k], state, self.w_off + self.w_done, pay)
        if not m:
            return 0
        self.w_done += m * pay
        self.epsn = (self.epsn + m) & wire.PSN_MASK
        self.nak_sent = False
        if ackreq & wire.ACKREQ:
            self.ack_pending = True
        return m

    def on_middle_runs(self, buf: int, j: int, r: int, meta: list[int], seg: int, dqpn: int,
                       seed: int, psn: int) -> tuple[int, int]:
        """:meth:`on_middle_run` over the received runs j, j + 1, ... of the engine's
        receive batch at ``buf`` (``fp_take_runs``; ``meta``: the batch's lens, segs,
        addrs, ports arrays), the first datagram's PSN ``psn``. Returns (datagrams taken,
        runs taken whole)."""
        fp = self.fastpath
        if self.w_off < 0 or wire.MASK_W2 or fp is None:
            return 0, 0
        if self._recovering():
            return self._early_runs(buf, j, r, meta, seg, dqpn, seed, psn)
        pay = seg - wire.BTH_LEN - wire.ICRC_LEN
        room = self._middle_room(pay)
        if room <= 0:
            return 0, 0
        state = _middle_state(seed, dqpn & wire.QPN_MASK)
        f = self._fold_landed()
        taken = fp.take_runs(buf, native.SLOT_BYTES, j, r, *meta, seg, wire.BTH_LEN,
                             self.epsn, wire.PSN_MASK, wire.ACKREQ, state, fp.crc,
                             self.w_mr.va + self.w_off + self.w_done, room, self._ackreq_ref,
                             self._whole_ref, None if f is None else f.ref,
                             0 if f is None else f.done)
        self._middles_taken(taken, pay)
        if taken and self._ackreq.value & wire.ACKREQ:
            self.ack_pending = True
        return taken, self._whole.value

    def _early_runs(self, buf: int, j: int, r: int, meta: list[int], seg: int, dqpn: int,
                    seed: int, psn: int) -> tuple[int, int]:
        """:meth:`on_middle_runs` for runs that arrive behind a gap: early MIDDLEs of the
        WRITE in progress are held (written where they belong) in C, as :meth:`_hold`
        holds them one by one; the rest (a fill at the expected PSN, packets that may not
        be held) is left to :meth:`on_write`."""
        mtu = self.engine.mtu
        d = psn_diff(psn, self.epsn)
        limit = hold_packets(mtu)
        if d <= 0 or d >= limit or seg - _ROW_EXTRA != mtu:
            return 0, 0
        start = self.w_off + self.w_done + d * mtu
        room = min(-(-(self.w_len - self.w_done) // mtu) - 1 - d,  # the MIDDLEs before the LAST
                   limit - d, (self.w_mr.buf.size - start) // mtu)
        if room <= 0:
            return 0, 0
        fp = self.fastpath
        state = _middle_state(seed, dqpn & wire.QPN_MASK)
        taken = fp.take_runs(buf, native.SLOT_BYTES, j, r, *meta, seg, wire.BTH_LEN, psn,
                             wire.PSN_MASK, wire.ACKREQ, state, fp.crc,
                             self.w_mr.va + start, room, self._ackreq_ref, self._whole_ref,
                             None, 0)
        if not taken:
            return 0, 0
        held = self.held
        before = len(held)
        end = psn + taken
        held.update(range(psn, end) if end <= wire.PSN_MASK + 1 else
                    (q & wire.PSN_MASK for q in range(psn, end)))
        new = len(held) - before
        self.engine.stats["rx_held"] += new
        if taken > new:
            self.engine.drops[DropReason.PSN_DUPLICATE] += taken - new
        self._held_to((end - 1) & wire.PSN_MASK, d + taken - 1)
        if self._ackreq.value & wire.ACKREQ:
            self._report_held()
        return taken, self._whole.value

    def _recovering(self) -> bool:
        """Whether in-order packets need :meth:`on_write` (a gap's state), not a fast path."""
        return bool(self.held) or bool(self.early) or self.nak_sent or self.dropped_early

    def _middle_room(self, pay: int) -> int:
        """How many MIDDLEs of ``pay`` bytes the WRITE in progress may still take."""
        start = self.w_off + self.w_done
        return min((self.w_len - self.w_done) // pay, (self.w_mr.buf.size - start) // pay)

    def _fold_landed(self) -> Fold | None:
        """The fold of the WRITE in progress, if any, with what landed in memory since (a
        FIRST, or packets before the fold was armed) folded first, so that the fold
        stays one prefix of the message."""
        f = self.w_fold
        if f is not None and f.done < self.w_done:
            self.fastpath.fold(f.ref, f.done, f.land + f.done, self.w_done - f.done)
            f.done = self.w_done
        return f

    def _middles_taken(self, taken: int, pay: int) -> None:
        """The effect of ``taken`` in-order MIDDLEs of ``pay`` bytes that the C checks
        passed and landed (or folded) at the WRITE's next bytes, as on_write has of each."""
        if not taken:
            return
        self.w_done += taken * pay
        self.epsn = (self.epsn + taken) & wire.PSN_MASK
        self.nak_sent = False
        if self.w_fold is not None:
            self.w_fold.done += taken * pay
            self.engine.stats["rx_folded"] += taken

    def _take_middles(self, rows: np.ndarray, state: int, start: int,
                      pay: int) -> tuple[int, int]:
        """:meth:`on_middle_run`'s checks and payload copy (``take_run`` in C does the
        same for :meth:`on_middle_runs`): (taken, OR of the AckReq bits)."""
        k, seg = rows.shape
        view = memoryview(rows).cast("B")
        crc32 = wire.crc32
        covered = seg - wire.ICRC_LEN - 8
        crcs = [crc32(view[b:b + covered], state) for b in range(8, k * seg, seg)]
        bth_run, icrc_run = _run_formats(k, seg)
        hdr = bth_run.unpack_from(view)  # per packet: BTH bytes 0..7 as one word, PSN word
        icrcs = icrc_run.unpack_from(view)
        heads, words = hdr[0::2], hdr[1::2]
        psn = self.epsn
        if psn + k <= wire.PSN_MASK + 1:
            want = list(range(psn, psn + k))
        else:
            want = [(psn + i) & wire.PSN_MASK for i in range(k)]
        # resv7 must be 0 (on_write's ICRC check reads those bits as 0), hence the PSN
        # word is compared whole but for AckReq.
        got = [w & ~wire.ACKREQ for w in words]
        if crcs == list(icrcs) and got == want and heads == (heads[0],) * k:
            m = k  # the usual case: every check passed, compared list to list in C
            ackreq = max(words)
        else:  # walk to the first packet that fails any check
            m = ackreq = 0
            while m < k and crcs[m] == icrcs[m] and got[m] == want[m] and heads[m] == heads[0]:
                ackreq |= words[m]
                m += 1
        if m:
            self.w_mr.buf[start:start + m * pay].reshape(m, pay)[...] = \
                rows[:m, wire.BTH_LEN:wire.BTH_LEN + pay]
        return m, ackreq

    def _access_error(self, reason: DropReason, psn: int) -> None:
        # Nothing was written; the requester learns of it from the NAK and fails its
        # operation with RemoteAccessError.
        self.engine.drop(reason)
        self.nak_sent = True
        self.send_ack(aeth_syndrome(AethKind.NAK, NakCode.REMOTE_ACCESS_ERROR), psn)

    def send_ack(self, syndrome: int, psn: int, msn: int | None = None) -> None:
        """``msn``: the AETH's MSN, this QP's message count unless a hole report names
        a PSN there."""
        self.engine.stats["acks_tx"] += 1
        dg = self._ack(psn & wire.PSN_MASK, syndrome, self.msn if msn is None else msn)
        self.engine.transmit((dg,), self.addr)

    def flush_ack(self, now: float | None = None) -> None:
        """Send the ACK that is due: an immediate one, or a deferred one (see
        ``ack_delay``) once its time has come (``now`` None: at once). ACKs are
        cumulative, so either covers everything received so far."""
        if self.ack_pending:
            self.ack_pending = False
            self.ack_due = 0.0
            self.send_ack(wire.ACK_SYNDROME, (self.epsn - 1) & wire.PSN_MASK)
        elif self.ack_due:
            if now is not None and self.ack_due < 0:
                self.ack_due = now + self.ack_delay  # first seen now: due after the delay
            elif now is None or now >= self.ack_due:
                self.ack_due = 0.0
                self.send_ack(wire.ACK_SYNDROME, (self.epsn - 1) & wire.PSN_MASK)

    def arm_fold(self, fold: Fold) -> None:
        """Fold the WRITE that lands ``fold``'s message (host/fold.py), from its next
        packet on, or from now on if it is in progress."""
        self.fold = fold
        if self.w_off >= 0 and fold.lands_at(self.w_mr.va + self.w_off, self.w_len):
            self.w_fold = fold  # its landed part is folded before the next packets

    def disarm_fold(self) -> None:
        """The sequencer no longer waits on the fold: nothing more goes through it."""
        if self.w_fold is self.fold:
            self.w_fold = None
        self.fold = None

    # ------------------------------------------------------------ the C steady state
    def bulk_rx(self, b: native.Bulk) -> bool:
        """Hand ``fp_bulk`` the WRITE in progress: its next MIDDLEs from the peer, with
        :meth:`on_middle_runs`' checks, land (or fold) where the next ones would here, and
        the ACKs they ask for go out at once. False when there is none to take."""
        mtu = self.engine.mtu
        if self.w_off < 0 or self._ack is None or self.fastpath is None or self._recovering():
            return False
        room = self._middle_room(mtu)
        if room <= 0:
            return False
        f = self._fold_landed()
        seg = _ROW_EXTRA + mtu
        seed = wire.icrc_seed(self.dst_ip, self.src_ip, self.addr[1], self.local_port,
                              wire.UDP_LEN + seg)
        b.rx_on, b.rx_seg, b.rx_port = 1, seg, self.addr[1]
        b.rx_addr = socket.htonl(self.dst_ip)  # as recvmmsg reports it
        b.rx_head = _head8(_MIDDLE, self.qpn)
        b.rx_state = _middle_state(seed, self.qpn)
        b.epsn = self.epsn
        b.rx_dst = self.w_mr.va + self.w_off + self.w_done
        b.rx_room = room
        b.fold = 0 if f is None else ctypes.addressof(f.spec)
        b.fold_at = 0 if f is None else f.done
        b.ack_head = (ctypes.c_uint8 * 8)(*self._ack.head)
        b.ack_state = self._ack.state
        b.aeth = (wire.ACK_SYNDROME << wire.SYNDROME_SHIFT) | (self.msn & wire.MSN_MASK)
        b.ack_dst = self.engine.sockaddr(self.addr)
        return True

    def bulk_rx_done(self, b: native.Bulk) -> None:
        """Take back what :meth:`bulk_rx` lent ``fp_bulk``."""
        if b.ack_lost:  # the kernel refused an ACK: flush_ack sends it, or fails loudly
            self.ack_pending = True
        self._middles_taken(b.rx_taken, self.engine.mtu)

    def bulk_tx(self, b: native.Bulk, per: int) -> np.ndarray | None:
        """Hand ``fp_bulk`` the borrowed message being sent, between its FIRST and LAST:
        its MIDDLEs go out as :meth:`_middle_gather` sends them while the window allows,
        and plain ACKs from the peer open the window. Returns the array their BTH|ICRC
        rows are sealed into, None when there is nothing of that kind to send."""
        msg = self.cur
        if (msg is None or msg.src is None or not self.cur_off or self.error is not None
                or self.retries or self._ack is None):
            return None
        mtu = self.engine.mtu
        k = (msg.size - self.cur_off - 1) // mtu  # the LAST is pump's
        if k <= 0:
            return None
        meta = np.empty((k, _ROW_EXTRA), np.uint8)
        b.tx_on, b.per = 1, per
        b.tx_head = _head8(_MIDDLE, self.remote_qpn)
        b.tx_state = self._send_middle_state()
        b.next_psn, b.inflight, b.since = self.next_psn, self.inflight, self.since_ackreq
        b.window, b.half = self.send_limit(), self.half()
        b.src = msg.src_addr + self.cur_off - msg.src_off
        b.k_left = k
        b.meta = meta.__array_interface__["data"][0]
        b.tx_dst = self.engine.sockaddr(self.addr)
        b.peer_ack_head = (ctypes.c_uint8 * 8)(*self._peer_ack.head)
        b.peer_ack_state = self._peer_ack.state
        b.notify_on = 0
        for first, _, m, n in self.outstanding:
            if m is not None:  # the first message end still unACKed: the sequencer's event
                b.notify_on, b.notify_psn = 1, (first + n - 1) & wire.PSN_MASK
                break
        b.last_progress = self.last_progress
        b.rto = self.timer_wait(self.engine.rto_s)
        return meta

    def bulk_tx_done(self, b: native.Bulk, meta: np.ndarray) -> None:
        """Take back what :meth:`bulk_tx` lent ``fp_bulk``: the MIDDLEs it sent become one
        outstanding :class:`GatherRun`, then the ACKs it took are applied."""
        sealed = b.sealed
        if sealed and not self.outstanding:
            self.acked_at = b.last_progress  # the C loop started the timer then
        if sealed:
            mtu = self.engine.mtu
            # Its own rows: a slice would keep the whole message's array alive.
            run = GatherRun(self.cur, self.cur_off, meta[:sealed].copy(), mtu)
            self._gathered(run, sealed)
            self.since_ackreq = b.since
            self.engine.stats["tx_packets"] += b.sent
            if b.sent < sealed:  # the kernel refused some: the Python path's handling
                self.engine.transmit_gather(run.after(b.sent), sealed - b.sent, self.addr)
        self.last_progress = b.last_progress
        if b.acked:
            self._acked(b.acked_psn, b.last_progress)

    def silent_for(self, now: float) -> float:
        """How long the peer has owed an ACK and sent none (0: it owes none)."""
        if self.outstanding:
            return now - self.acked_at
        return now - self.probed if self.probed else 0.0

    def heard(self, now: float) -> None:
        """The peer sent something that passed every check: it is alive, whatever it
        still owes (an unanswered probe is answered)."""
        self.heard_at = now
        self.probed = 0.0

    def probe(self, now: float, quiet_s: float = 0.0) -> None:
        """Ask a peer we owe nothing and send nothing for an ACK: a zero-length WRITE
        with the PSN before the next, which the responder drops as a duplicate and
        re-ACKs (here as in the HDL). It moves no state on either side; the answer,
        or its absence, tells whether the peer is alive. A peer heard from within
        ``quiet_s`` is not asked: in a large world most peers are, and a probe to each
        of them every round was most of the datagrams of a starved one."""
        if (self.outstanding or self.error is not None or self._ack is None
                or now - self.heard_at < quiet_s):
            return
        if not self.probed:
            self.probed = now
        psn = (self.next_psn - 1) & wire.PSN_MASK
        self.resent_alone.pop(psn, None)  # the probe's duplicate report is no news of it
        opcode = Opcode.RDMA_WRITE_ONLY
        ext = wire.RETH_FMT.pack(self.remote_va, self.remote_rkey, 0)
        seed = wire.icrc_seed(self.src_ip, self.dst_ip, self.local_port, self.addr[1],
                              wire.UDP_LEN + wire.BTH_LEN + len(ext) + wire.ICRC_LEN)
        icrc = wire.datagram_icrc(seed, wire.bth_masked(opcode, 0, self.remote_qpn, True, psn),
                                  ext, b"", b"")
        self.engine.stats["probes_tx"] += 1
        self.engine.transmit((wire.bth(opcode, 0, self.remote_qpn, True, psn) + ext, icrc),
                             self.addr)

    def give_back(self, slot: int) -> None:
        """Return a consumed ring slot to the peer."""
        self.post(Message(memoryview(b""), wire.pack_imm(slot, wire.STEP_CREDIT), None))

    def give_back_arrived(self, drop: Callable[[Arrival], bool]) -> None:
        """Give back the slot of every message no receive took for which ``drop``
        holds, in arrival order, and forget those messages."""
        keep = []
        for a in self.arrived:
            if drop(a):
                self.give_back(a.slot)
            else:
                keep.append(a)
        if len(keep) != len(self.arrived):
            self.arrived.clear()
            self.arrived.extend(keep)


__all__ = ["ANY_QP", "Arrival", "Completion", "GatherRun", "MemoryRegion", "Message", "QueuePair",
           "RowPool"]
