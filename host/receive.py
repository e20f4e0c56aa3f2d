"""The engine's receive paths: every datagram checked (BTH, QPN, ICRC) and handed to its
queue pair. The Python path reads datagrams one by one; the C path reads them in
``recvmmsg`` batches and takes runs of one WRITE's MIDDLEs in one call; ``fp_bulk`` (the
C loop) waits and moves a large transfer's steady state on its own."""

from __future__ import annotations

import ctypes
import os
import socket
import time
from collections import Counter
from collections.abc import Callable

import numpy as np

from fpgaccl.proto.drops import DropReason
from fpgaccl.proto.opcodes import SUPPORTED_OPCODES, Opcode

from . import native, wire
from .qp import _MIDDLE, _WRITES, QueuePair
from .udp import GRO_CMSG_SPACE, GRO_SIZE, SOL_UDP, UDP_GRO, Udp, socket_error

_HEADERS_LEN = wire.HEADERS_LEN
_RX_SLOTS = 32  # datagrams (or GRO runs) per recvmmsg with the C path: 2 MiB of buffer
BULK_LOOP = True
"""Whether the engine hands the steady state of large transfers to ``fp_bulk`` (the C
loop, :meth:`Receiver.bulk`) instead of waiting in poll between its own turns."""
BULK_YIELDS = 1
"""Times ``fp_bulk`` yields the CPU and looks again before it sleeps in poll. A 64 MiB
4-rank allreduce on 2 cores slept about 180 times a call per rank without, 30 with one
yield, and took 117-128 ms a call against 99-110."""


class Receiver:
    """Reads ``udp``'s receive sockets into queue pairs ``qps`` (by local QPN, the
    engine's own dict), counting into the engine's ``stats`` and ``drops``.
    ``poll_ms(now)``: how long the engine may wait for the next event."""

    def __init__(self, udp: Udp, qps: dict[int, QueuePair], stats: Counter[str],
                 drops: list[int], fastpath: native.Fastpath | None,
                 poll_ms: Callable[[float], int]) -> None:
        self.udp = udp
        self.qps = qps
        self.stats = stats
        self.drops = drops
        self.port = udp.addr[1]
        self.fastpath = fastpath
        self._poll_ms = poll_ms
        self._ips: dict[str, int] = {}
        slots = _RX_SLOTS if fastpath is not None else 1
        self._rxarr = np.empty(slots * native.SLOT_BYTES, np.uint8)
        self._rxview = memoryview(self._rxarr)
        self._rxaddr = int(self._rxarr.ctypes.data)
        self._rxmeta = np.zeros((4, slots), np.uint32)  # lens, segs, addrs, ports
        self._rxmeta_addr = [int(self._rxmeta[i].ctypes.data) for i in range(4)]

    def receive(self) -> bool:
        """Take what the sockets hold; whether there was anything."""
        recv = self._receive_python if self.fastpath is None else self._receive_native
        udp = self.udp
        if udp.rx_ready is None:
            return recv(udp.sock)
        # Sockets per peer: one poll finds the few with datagrams, where a recvmmsg on
        # each would mostly come back empty (a ring's receiver hears from one peer).
        got = False
        for fd, _ in udp.rx_ready.poll(0):
            got |= recv(udp.rx_by_fd[fd])
        return got

    def _receive_python(self, sock: socket.socket) -> bool:
        buf = self._rxview
        got = False
        now = time.monotonic()
        gro = self.udp.gro
        anc_space = GRO_CMSG_SPACE
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
                if socket_error(e.errno):  # reported once; details on the error queue
                    self.udp.errors_pending = True
                    continue
                raise
            got = True
            seg = n
            for level, kind, data in anc:
                if level == SOL_UDP and kind == UDP_GRO:
                    seg = GRO_SIZE.unpack(data[:GRO_SIZE.size])[0]
            src = self._ips.get(src_ip)
            if src is None:
                src = self._ips[src_ip] = wire.ip_to_int(src_ip)
            if seg >= n:
                self.packet(buf[:n], n, src, sport, now)
            else:
                self.coalesced(n, seg, src, sport, now)
        return got

    def coalesced(self, n: int, seg: int, src: int, sport: int, now: float) -> None:
        """Check and dispatch the ``n`` bytes of ``seg``-byte datagrams (the last one may be
        shorter) that GRO joined in the receive buffer, the Python path's way."""
        buf = self._rxview
        k = n // seg
        start = 0
        if k > 1:
            start = self._middle_run(self._rxarr[:k * seg], seg, k, src, sport, now) * seg
        for off in range(start, n, seg):
            m = min(seg, n - off)
            self.packet(buf[off:off + m], m, src, sport, now)

    def _receive_native(self, sock: socket.socket) -> bool:
        """:meth:`_receive_python` through ``fp_recv_batch``: up to ``_RX_SLOTS`` datagrams
        (or GRO runs) per recvmmsg, each then checked and dispatched as
        :meth:`_receive_python` does."""
        lens_a, segs_a, addrs_a, ports_a = self._rxmeta_addr
        fd = sock.fileno()
        while True:
            r = self.fastpath.recv_batch(fd, self._rxaddr, native.SLOT_BYTES,
                                         _RX_SLOTS, lens_a, segs_a, addrs_a, ports_a)
            if r >= 0 or not socket_error(-r):
                break
            self.udp.errors_pending = True  # reported once; details on the error queue
        if r < 0:
            raise OSError(-r, os.strerror(-r))
        if r == 0:
            return False
        self._dispatch(r, 0, 0, time.monotonic())
        return True

    def _dispatch(self, r: int, j: int, part: int, now: float) -> None:
        """Check and dispatch receive batch entries ``j`` to ``r - 1`` (entry ``j`` from its
        datagram ``part`` on), as :meth:`_receive_native` and :meth:`bulk` left them."""
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
                whole, part = self._middle_runs(j, r, seg, src, sport, now)
                if whole:
                    j += whole
                    if not part:
                        continue
                    base, n, seg, sport = j * native.SLOT_BYTES, lens[j], segs[j], ports[j]
                    src = socket.ntohl(addrs[j])
                start = part * seg
            if n <= seg:  # one datagram; an empty one too (dropped as TRUNCATED)
                self.packet(view[base:base + n], n, src, sport, now)
            else:
                for off in range(start, n, seg):
                    m = min(seg, n - off)
                    self.packet(view[base + off:base + off + m], m, src, sport, now)
            j += 1
            part = 0

    def _run_qp(self, run: np.ndarray, src: int, sport: int, seg: int
                ) -> tuple[QueuePair, int, int, int] | None:
        """The queue pair a run of MIDDLEs starting at ``run`` is for, its BTH's DestQP
        word, the run's ICRC seed and its first PSN; None where the run is not one to
        take at once."""
        if seg <= wire.BTH_LEN + wire.ICRC_LEN or run[0] != _MIDDLE or run[1]:
            return None  # not a MIDDLE, or a pad / header version / SE / MigReq bit
        _, _, _, dqpn, w2 = wire.BTH_FMT.unpack_from(run)
        qp = self.qps.get(dqpn & wire.QPN_MASK)
        if qp is None or src != qp.dst_ip or (sport != qp.peer_sport
                                               and sport != qp.peer_sport_alt):
            return None  # packet() counts it
        return (qp, dqpn, wire.icrc_seed(src, qp.src_ip, sport, self.port, wire.UDP_LEN + seg),
                w2 & wire.PSN_MASK)

    def _middle_runs(self, j: int, r: int, seg: int, src: int, sport: int,
                     now: float) -> tuple[int, int]:
        """:meth:`_middle_run` for the received runs j, j + 1, ... of a batch at once
        (``fp_take_runs``): how many runs were taken whole, and how many datagrams of
        the run after them. Run j starts with a MIDDLE opcode (the caller checks)."""
        base = j * native.SLOT_BYTES
        found = self._run_qp(self._rxarr[base:base + 12], src, sport, seg)
        if found is None:
            return 0, 0
        qp, dqpn, seed, psn = found
        taken, whole = qp.on_middle_runs(self._rxaddr, j, r, self._rxmeta_addr, seg, dqpn,
                                         seed, psn)
        self.stats["rx_packets"] += taken
        self.stats["rx_coalesced"] += taken
        if not taken:
            return 0, 0
        qp.heard(now)
        done = sum(self._rxmeta[0, j:j + whole].tolist()) // seg
        return whole, taken - done

    def _middle_run(self, run: np.ndarray, seg: int, k: int, src: int, sport: int,
                    now: float) -> int:
        """Take the leading datagrams of ``k`` coalesced ones of ``seg`` bytes at once as
        far as they are the next in-order RDMA WRITE MIDDLE packets of one QP with good
        ICRCs (the steady state of a large transfer); returns how many it took. The rest,
        whatever they are, go to :meth:`packet` one by one, with every check and drop
        counter."""
        found = self._run_qp(run, src, sport, seg)
        if found is None:
            return 0
        qp, _, seed, _ = found
        took = qp.on_middle_run(run.reshape(k, seg), seed)
        self.stats["rx_packets"] += took
        self.stats["rx_coalesced"] += took
        if took:
            qp.heard(now)
        return took

    def packet(self, buf: memoryview, n: int, src: int, sport: int, now: float) -> None:
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
        if n < _HEADERS_LEN[opcode]:
            self.drops[DropReason.TRUNCATED] += 1
            return
        qp = self.qps.get(dqpn & wire.QPN_MASK)
        if qp is None:
            self.drops[DropReason.BAD_QPN] += 1
            return
        psn = w2 & wire.PSN_MASK
        ackreq = bool(w2 & wire.ACKREQ)
        # The ICRC covers the sender's real IP and UDP source port: an HDL node sends
        # from udp_sport + qp (0xC000 + qp), a software engine from its bound port.
        seed = wire.icrc_seed(src, qp.src_ip, sport, self.port, wire.UDP_LEN + n)
        want = wire.datagram_icrc(seed, wire.received_bth_masked(buf),
                                  buf[wire.BTH_LEN:n - wire.ICRC_LEN])
        if want != buf[n - wire.ICRC_LEN:n]:
            self.drops[DropReason.BAD_ICRC] += 1
            return
        # Anyone can seal an ICRC: only the peer speaks for its queue pair.
        if src != qp.dst_ip or (sport != qp.peer_sport and sport != qp.peer_sport_alt):
            self.drops[DropReason.WRONG_SOURCE] += 1
            return
        qp.heard(now)
        if opcode == Opcode.ACKNOWLEDGE:
            (aeth,) = wire.AETH_FMT.unpack_from(buf, wire.BTH_LEN)
            qp.on_ack(psn, aeth >> wire.SYNDROME_SHIFT, now, aeth & wire.MSN_MASK)
        elif opcode in _WRITES:
            qp.on_write(opcode, psn, ackreq, buf, n)
        else:
            self.drops[DropReason.UNKNOWN_OPCODE] += 1  # SENDs: no receive queue here

    def bulk_setup(self, wake_fd: int, mtu: int) -> native.Bulk | None:
        """The ``fp_bulk`` state of the engine's loop, its fixed fields filled; None
        where the C loop does not apply (no C send path: a tap or a link shim sees every
        datagram)."""
        udp = self.udp
        if (self.fastpath is None or not udp.native_tx
                or len(udp.rx_socks) > native.BULK_FDS):
            return None
        b = native.Bulk()
        b.tx_fd, b.wake_fd, b.nfds = udp.sock.fileno(), wake_fd, len(udp.rx_socks)
        for i, sock in enumerate(udp.rx_socks):
            b.fds[i] = sock.fileno()
        b.rxbuf = self._rxaddr
        b.lens, b.segs, b.addrs, b.ports = self._rxmeta_addr
        b.slot, b.nslots = native.SLOT_BYTES, _RX_SLOTS
        b.bth_len, b.psn_mask, b.ackreq_bit = wire.BTH_LEN, wire.PSN_MASK, wire.ACKREQ
        b.ack_syndrome, b.syn_shift = wire.ACK_SYNDROME, wire.SYNDROME_SHIFT
        b.mtu = mtu
        b.crc = self.fastpath.crc.value
        b.yields = BULK_YIELDS
        return b

    def bulk(self, b: native.Bulk, qps: list[QueuePair], now: float) -> int:
        """Wait for the next event in ``fp_bulk`` instead of poll when a queue pair is in
        the steady state of a large transfer (:meth:`QueuePair.bulk_rx`,
        :meth:`QueuePair.bulk_tx`): the C loop moves its MIDDLEs and ACKs meanwhile and
        returns on anything else, which the engine's loop then takes from where it
        stopped (a wake-up, ``native.BULK_WAKE``, is the engine's to drain). Returns why
        it returned (``native.BULK_*``), 0 when no queue pair is in that state."""
        if not BULK_LOOP:
            return 0
        b.rx_on = b.tx_on = 0
        rxq = txq = None
        meta = None
        per = self.udp.gso_per(wire.BTH_LEN + b.mtu + wire.ICRC_LEN)
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
            if b.rx_taken:
                rxq.heard(now)
        if txq is not None:
            txq.bulk_tx_done(b, meta)
            if b.acks_rx:
                txq.heard(now)
        if stop == native.BULK_BATCH:
            self._dispatch(b.r, b.j, b.part, time.monotonic())
        elif stop == native.BULK_RX_ERROR:
            if not socket_error(-b.err):
                raise OSError(-b.err, os.strerror(-b.err))
            self.udp.errors_pending = True
        elif stop == native.BULK_SOCKET_ERROR:
            self.udp.errors_pending = True
        return stop
