"""The engine's UDP sockets: buffer sizing, GSO/GRO, per-peer receive sockets and the
batched sends (``sendmsg`` of GSO runs, ``fp_send_rows``/``fp_send_gather``).

On loopback there is no wire: a run of equal-sized datagrams goes to the kernel in one
sendmsg (UDP_SEGMENT) and a GRO socket takes it back in one recvmsg. Each datagram is
still a complete RoCEv2 packet exactly as sent one by one, and the per-datagram kernel
cost (~10 us each way here) is paid once per run. Off a real link, since a segmented
datagram leaves with an IPv4 id other than the 0 our ICRC covers, and with a link shim,
which impairs datagram by datagram.
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
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fpgaccl.errors import InvalidArgumentError, TransportError

from . import native, wire

if TYPE_CHECKING:
    from .qp import GatherRun

# Linux UDP segmentation offload (GSO) and receive coalescing (GRO), <linux/udp.h>.
SOL_UDP = 17
UDP_SEGMENT = 103
UDP_GRO = 104
GSO_MAX_SEGMENTS = 64
GSO_MAX_BYTES = 65507  # one UDP payload: 65535 - IPv4 - UDP headers
_GSO_SIZE = struct.Struct("=H")
GRO_SIZE = struct.Struct("=i")
GRO_CMSG_SPACE = socket.CMSG_SPACE(GRO_SIZE.size)

SOCKET_BUFFER_BYTES = 4 << 20
"""Socket buffers asked for. Linux grants at most ``net.core.rmem_max``/``wmem_max``
(212992 on a stock kernel) unless the process may force more (CAP_NET_ADMIN)."""
SO_SNDBUFFORCE, SO_RCVBUFFORCE = 32, 33  # <asm-generic/socket.h>; not in Python's socket
BUFFER_HEADROOM = 0.85
"""Share of a receive buffer the send windows may fill: the rest is for ACKs and credits."""
_GONE = (errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.ENETUNREACH)
_NO_SEGMENTING = (errno.EIO, errno.EINVAL, errno.EOPNOTSUPP, errno.EMSGSIZE)
IP_RECVERR = getattr(socket, "IP_RECVERR", 11)  # <linux/in.h>
SO_EE_ORIGIN_ICMP = 2  # <linux/errqueue.h>
_EXTENDED_ERR = struct.Struct("=IBBBBII")  # struct sock_extended_err's head
_FATAL_RX = frozenset({errno.EBADF, errno.EFAULT, errno.EINVAL, errno.ENOTSOCK, errno.ENOMEM})
"""What a receive on a UDP socket fails with for a fault of ours. Any other error is a
socket error the kernel reports once (an ICMP message, with IP_RECVERR), and the details
are on the socket's error queue (:meth:`Udp.read_errors`)."""


def socket_error(err: int) -> bool:
    """Whether a receive's ``err`` (an errno) is a reported socket error, not a fault."""
    return err not in _FATAL_RX


@dataclass(frozen=True)
class SocketError:
    """An error the kernel queued on a socket: an ICMP message about a datagram we sent
    (``icmp``, with its ``type`` and ``code``) or a local one. ``dst``: where that
    datagram was going."""

    dst: tuple[str, int]
    errno: int
    icmp: bool
    type: int
    code: int

    @property
    def port_closed(self) -> bool:
        """ICMP port unreachable: nothing listens at ``dst`` (its process is gone)."""
        return self.icmp and self.errno == errno.ECONNREFUSED


def packet_charge(payload: int, coalesced: bool) -> int:
    """Bytes of a receive buffer's size (as ``SO_RCVBUF`` reads it back) one queued packet
    of ``payload`` bytes takes, rounded up: the kernel charges the whole buffer it sits
    in. A lone datagram's is a power-of-two allocation plus the skb (payload filled 0.20,
    0.40, 0.44, 0.48 and 0.47 of a buffer at 256, 512, 1024, 4096 and 8192 bytes); a GRO
    run's is shared by its packets (0.83-0.87 at 4096). Measured on loopback."""
    if coalesced:
        return payload * 5 // 4
    return (1 << (payload + 400).bit_length()) + 320 + payload // 8


def packets_that_fit(rcvbuf: int, payload: int, coalesced: bool) -> int:
    """Packets of ``payload`` bytes a receive buffer of ``rcvbuf`` queues, leaving
    :data:`BUFFER_HEADROOM` for ACKs and credits."""
    return int(rcvbuf * BUFFER_HEADROOM) // packet_charge(payload, coalesced)


def _bind_error(bind_ip: str, port: int, e: OSError) -> InvalidArgumentError:
    taken = e.errno == errno.EADDRINUSE
    return InvalidArgumentError(
        "bind_ip", f"cannot bind UDP {bind_ip}:{port}: {e.strerror}" + (
            " (another rank on this host? RoCEv2 wants port 4791 on every rank, so "
            "give each local rank its own address: bind_ip= or FPGACCL_BIND_IP)"
            if taken else ""))


def _too_big(nbytes: int, addr: tuple[str, int]) -> TransportError:
    return TransportError(f"a {nbytes}-byte datagram does not fit the link to {addr[0]} "
                          "(DF is set, as RoCEv2 requires): choose a smaller mtu")


def udp_socket(want: int) -> socket.socket:
    """A UDP socket with ``want``-byte buffers, forced past the kernel's cap where this
    process may."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    for opt, force in ((socket.SO_RCVBUF, SO_RCVBUFFORCE),
                       (socket.SO_SNDBUF, SO_SNDBUFFORCE)):
        sock.setsockopt(socket.SOL_SOCKET, opt, want)
        if sock.getsockopt(socket.SOL_SOCKET, opt) < 2 * want:
            # Capped by rmem_max/wmem_max: a process that may, takes it anyway.
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, force, want)
    return sock


class Udp:
    """The shared socket bound to the engine's address (and, with :attr:`rx_per_peer`,
    one receive socket per peer), and every way a datagram leaves.

    ``no_gso`` is called when the path turns out unable to segment (:attr:`gso` is then
    already False): the engine fits its window to single datagrams again."""

    def __init__(self, bind_ip: str, port: int, buffer_bytes: int, stats: Counter[str], *,
                 link: Callable | None, tap: Callable | None,
                 fastpath: native.Fastpath | None, no_gso: Callable[[], None]) -> None:
        self.buffer_bytes = buffer_bytes
        self.stats = stats
        self._link = link  # impairment shim: (datagram parts, addr, send) -> None
        self._tap = tap  # capture hook: (src_ip, dst_addr, datagram bytes)
        self.fastpath = fastpath
        # A tap or a link shim sees datagrams one by one, so they keep the Python path.
        self.native_tx = fastpath is not None and tap is None and link is None
        self._no_gso = no_gso
        self.sock = udp_socket(buffer_bytes)
        self.rcvbuf = self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
        # DF + id 0: the IPv4 header the kernel writes is the one our ICRC covers.
        self.sock.setsockopt(socket.IPPROTO_IP, 10, 2)  # IP_MTU_DISCOVER = IP_PMTUDISC_DO
        # ICMP errors for datagrams sent from an unconnected socket are reported only
        # with IP_RECVERR: a port unreachable says that a peer's process is gone.
        self.sock.setsockopt(socket.IPPROTO_IP, IP_RECVERR, 1)
        try:
            self.sock.bind((bind_ip, port))
        except OSError as e:
            self.sock.close()
            raise _bind_error(bind_ip, port, e) from None
        self.sock.setblocking(False)
        self.addr = self.sock.getsockname()
        self.gso = link is None and ipaddress.ip_address(self.addr[0]).is_loopback
        self.gro = False
        if self.gso:
            try:
                self.sock.setsockopt(SOL_UDP, UDP_GRO, 1)
                self.gro = True
            except OSError:
                self.gso = False
        self.rx_socks: list[socket.socket] = [self.sock]
        self.rx_ready: select.poll | None = None  # with sockets per peer
        self.rx_by_fd: dict[int, socket.socket] = {}
        self._sockaddrs: dict[tuple[str, int], native.SockaddrIn] = {}
        self.errors_pending = False  # a socket call or a poll said an error is queued

    def open_peer_sockets(self, peers: list[tuple[str, int]]) -> None:
        """A socket for each of ``peers`` on this engine's address, connected to the
        peer's: the kernel queues a datagram on the socket connected to its source before
        the shared one, so each peer fills a buffer of its own. Every socket's datagrams
        go through the same checks whichever socket they came by; a peer that sends from
        another address (an HDL node's per-QP source port) lands on the shared socket."""
        reuse = socket.SO_REUSEPORT
        opened: list[socket.socket] = []
        # SO_REUSEPORT only while the sockets bind: afterwards the address is exclusive
        # again, so a second rank bound to it by mistake is refused (EADDRINUSE) instead
        # of taking some of this one's datagrams. Between its bind and its connect a new
        # socket may take another peer's datagrams; they are read and checked all the same.
        self.sock.setsockopt(socket.SOL_SOCKET, reuse, 1)
        try:
            for addr in peers:
                sock = udp_socket(self.buffer_bytes)
                opened.append(sock)
                sock.setsockopt(socket.SOL_SOCKET, reuse, 1)
                sock.bind(self.addr)
                sock.connect(addr)
                sock.setblocking(False)
                sock.setsockopt(socket.IPPROTO_IP, IP_RECVERR, 1)
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
        self.rx_socks.extend(opened)
        self.rx_ready = select.poll()
        for sock in self.rx_socks:
            self.rx_ready.register(sock, select.POLLIN)
            self.rx_by_fd[sock.fileno()] = sock

    def close(self) -> None:
        for sock in self.rx_socks:  # the shared socket first
            sock.close()

    def read_errors(self) -> list[SocketError]:
        """What the kernel queued on the sockets' error queues. A queued error keeps poll
        reporting POLLERR until it is read."""
        self.errors_pending = False
        errors: list[SocketError] = []
        for sock in self.rx_socks:
            for _ in range(1024):
                try:
                    _, anc, _, dst = sock.recvmsg(0, 256, socket.MSG_ERRQUEUE)
                except (BlockingIOError, InterruptedError):
                    break
                for level, kind, data in anc:
                    if level == socket.IPPROTO_IP and kind == IP_RECVERR:
                        err, origin, typ, code, _, _, _ = _EXTENDED_ERR.unpack_from(data)
                        errors.append(SocketError(tuple(dst), err, origin == SO_EE_ORIGIN_ICMP,
                                                  typ, code))
                        self.stats["socket_errors"] += 1
        return errors

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
        per = self.gso_per(seg)
        for i in range(0, k, per):
            n = min(per, k - i)
            self._sendmsg(flat[3 * i:3 * (i + n)], addr, seg, n)

    def transmit_rows(self, flat: memoryview, k: int, seg: int, addr: tuple[str, int]) -> None:
        """Send ``k`` datagrams of ``seg`` bytes lying back to back in ``flat``: with GSO,
        as many per system call as one UDP datagram can carry, as one buffer."""
        if self.native_tx and not flat.readonly:
            self._send_native(ctypes.addressof(ctypes.c_char.from_buffer(flat)), k, seg, addr)
            return
        if not self.gso or self._tap is not None:
            for b in range(0, k * seg, seg):
                self.transmit((flat[b:b + seg],), addr)
            return
        per = self.gso_per(seg)
        for i in range(0, k, per):
            n = min(per, k - i)
            self._sendmsg((flat[i * seg:(i + n) * seg],), addr, seg, n)

    def transmit_gather(self, run: GatherRun, k: int, addr: tuple[str, int]) -> None:
        """Send the first ``k`` packets of ``run`` through ``fp_send_gather`` (see
        :meth:`_send_batches`)."""
        send, fd, ref = self.fastpath.send_gather, self.sock.fileno(), self._sockaddr(addr)
        mtu, bth = run.mtu, wire.BTH_LEN
        meta, row = run.meta.__array_interface__["data"][0], run.meta.shape[1]
        src = run.src_address()
        self._send_batches(k, row + mtu, addr, lambda done, per: send(
            fd, meta + done * row, bth, src + done * mtu, k - done, mtu, per, ref))

    def sockaddr(self, addr: tuple[str, int]) -> native.SockaddrIn:
        """``addr`` as a ``struct sockaddr_in`` (kept: one per peer)."""
        sa = self._sockaddrs.get(addr)
        if sa is None:
            sa = self._sockaddrs[addr] = native.sockaddr(addr)
        return sa

    def gso_per(self, seg: int) -> int:
        """Datagrams of ``seg`` bytes per UDP_SEGMENT message (1 without GSO)."""
        return max(1, min(GSO_MAX_SEGMENTS, GSO_MAX_BYTES // seg)) if self.gso else 1

    def _sockaddr(self, addr: tuple[str, int]) -> Any:
        return ctypes.byref(self.sockaddr(addr))

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
                if e.errno in _GONE:
                    # Another datagram's ICMP error, reported once (IP_RECVERR): this
                    # one did not go. Its details wait on the error queue.
                    self.errors_pending = True
                    continue
                if count > 1 and e.errno in _NO_SEGMENTING:
                    self._cannot_segment()
                    self._sendmsg_each(parts, addr, seg)
                    return
                if e.errno == errno.EMSGSIZE:
                    raise _too_big(sum(len(p) for p in parts), addr) from None
                raise

    def _sendmsg_each(self, parts: list | tuple, addr: tuple[str, int], seg: int) -> None:
        data = b"".join(parts)
        for i in range(0, len(data), seg):
            self._sendmsg((data[i:i + seg],), addr)

    def _send_native(self, ptr: int, k: int, seg: int, addr: tuple[str, int]) -> None:
        """:meth:`transmit_rows` through ``fp_send_rows``: up to 64 GSO runs (or plain
        datagrams) per sendmmsg (see :meth:`_send_batches`)."""
        send, fd, ref = self.fastpath.send_rows, self.sock.fileno(), self._sockaddr(addr)
        self._send_batches(k, seg, addr,
                           lambda done, per: send(fd, ptr + done * seg, k - done, seg, per, ref))

    def _send_batches(self, k: int, seg: int, addr: tuple[str, int],
                      send: Callable[[int, int], int]) -> None:
        """Hand ``k`` datagrams of ``seg`` bytes to the kernel through ``send(done, per)``
        (a C sender: the datagrams from ``done`` on, ``per`` to a GSO message; returns how
        many went, or -errno), with :meth:`_sendmsg`'s handling of a full socket buffer,
        a gone peer and a path that cannot segment."""
        done = 0
        for _ in range(1000):
            per = self.gso_per(seg)
            r = send(done, per)
            if r < 0:
                err = -r
                if err in _GONE:
                    self.errors_pending = True  # as in _sendmsg: send again
                    continue
                if per > 1 and err in _NO_SEGMENTING:
                    self._cannot_segment()
                    continue
                if err == errno.EMSGSIZE:
                    raise _too_big(seg, addr)
                raise OSError(err, os.strerror(err))
            done += r
            self.stats["tx_packets"] += r
            if done >= k:
                return
            select.select([], [self.sock], [], 0.01)

    def _cannot_segment(self) -> None:
        self.gso = False
        self._no_gso()
