"""The bridge between the simulated wire and real interfaces.

Ranks outside the simulation (software-backend engines on real UDP sockets) reach the
simulated nodes through switch ports handed to the outside (the cluster's ``external``
register, see :mod:`fpgaccl.sim.hdl.cluster`). The bridge is an IP router between the
two, frame by frame:

* a frame leaving the simulated switch on an external port is stripped of its
  Ethernet/IPv4/UDP headers and its datagram sent to the destination IP and port it
  names, *from* the source IP and port it names (a socket bound there), so the receiving
  software engine sees exactly the addresses the HDL node put into the ICRC;
* a datagram arriving on a simulated node's socket (its IP, port 4791) is wrapped in
  the Ethernet/IPv4/UDP headers the kernel sent it with (DF set, id 0, correct IPv4
  checksum; the MACs are the simulated switch's) and injected into the switch on the
  sender's port: the sender's ICRC covers those very headers, so the node's parser
  accepts the frame as it accepts a frame of another node.

Every frame the bridge passes can be mirrored to a pcap file (what tshark decodes as
RoCEv2) and, as root, to a TAP interface, so ``tshark -i fpgaccl0`` or ``tcpdump -i
fpgaccl0`` watches the simulated wire live. A seeded loss probability drops bridged
frames in both directions. Per-frame Python only: the simulation moves a frame's beats
in hardware and calls the bridge once per frame.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import ipaddress
import os
import random
import socket
import struct
import subprocess
from collections import Counter
from pathlib import Path

# The file format lives below sim and host alike: the bridge must not import the host.
from fpgaccl.pcapfile import PcapFile
from fpgaccl.proto import ETH, IPV4, UDP, ipv4_checksum
from fpgaccl.proto.opcodes import ETHERTYPE_IPV4, ROCEV2_UDP_PORT
from fpgaccl.sim.hdl.switch import node_mac

_L2_L4 = ETH.size + IPV4.size + UDP.size
_IP_LEN = struct.Struct(">H")
_ADDRS = struct.Struct(">II")  # IPv4 src, dst
_PORTS = struct.Struct(">HH")  # UDP sport, dport


def ip_str(ip: int) -> str:
    return str(ipaddress.IPv4Address(ip))


def ip_int(ip: str | int) -> int:
    return ip if isinstance(ip, int) else int(ipaddress.IPv4Address(ip))


@functools.lru_cache(maxsize=4096)
def headers(src_port: int, dst_port: int, src: int, dst: int, sport: int, dport: int,
            datagram_len: int) -> bytes:
    """Ethernet/IPv4/UDP headers of a datagram on the simulated wire, from switch port
    ``src_port`` to ``dst_port`` (their MACs), with the IPv4 header the kernel writes."""
    udp_len = UDP.size + datagram_len
    ip_vals = {"len": IPV4.size + udp_len, "src": src, "dst": dst}
    ip = IPV4.pack(ip_vals)
    ip = IPV4.pack({**ip_vals, "chksum": ipv4_checksum(ip)})
    eth = ETH.pack(dst=node_mac(dst_port), src=node_mac(src_port), type=ETHERTYPE_IPV4)
    return eth + ip + UDP.pack(sport=sport, dport=dport, len=udp_len, chksum=0)


def split(frame: bytes) -> tuple[int, int, int, int, bytes]:
    """``(src_ip, dst_ip, sport, dport, datagram)`` of a frame (padding removed)."""
    (ip_len,) = _IP_LEN.unpack_from(frame, ETH.size + 2)
    src, dst = _ADDRS.unpack_from(frame, ETH.size + 12)
    sport, dport = _PORTS.unpack_from(frame, ETH.size + IPV4.size)
    return src, dst, sport, dport, bytes(frame[_L2_L4:ETH.size + ip_len])


class TapMirror:
    """A TAP interface that shows every bridged frame to the host's capture tools.

    Frames written to a TAP arrive at the kernel as if received on that interface; their
    destination MACs are the simulated nodes', not the TAP's, so the stack ignores them
    and they only reach packet sockets (tshark, tcpdump). Root only."""

    TUNSETIFF = 0x400454CA
    IFF_TAP = 0x0002
    IFF_NO_PI = 0x1000

    def __init__(self, name: str = "fpgaccl0") -> None:
        if os.geteuid() != 0:
            raise PermissionError(f"a TAP interface ({name}) needs root")
        self.name = name
        self.fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
        try:
            ifr = struct.pack("16sH", name.encode(), self.IFF_TAP | self.IFF_NO_PI)
            fcntl.ioctl(self.fd, self.TUNSETIFF, ifr)
            # No IPv6 chatter (router solicitations) on the capture.
            with open(f"/proc/sys/net/ipv6/conf/{name}/disable_ipv6", "w") as f:
                f.write("1")
        except OSError:
            os.close(self.fd)
            raise
        subprocess.run(["ip", "link", "set", "dev", name, "up"], check=True)

    def write(self, frame: bytes) -> None:
        with contextlib.suppress(BlockingIOError):  # a mirror: never hold the sim up
            os.write(self.fd, frame)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # a non-persistent TAP disappears with its last fd
            self.fd = -1


class UdpBridge:
    """Routes frames between the simulated switch's external ports and UDP sockets.

    ``host(port, ip)``: a simulated node sits behind switch port ``port`` with address
    ``ip``; the bridge receives its datagrams on ``ip``:4791. ``route(port, ip)``: the
    rank at ``ip`` (outside) owns switch port ``port``; datagrams from it enter there.
    """

    def __init__(self, *, loss: float = 0.0, seed: int = 1, pcap: str | Path | None = None,
                 pcap_inbound: bool = True, tap: str | None = None) -> None:
        if not 0.0 <= loss < 1.0:
            from fpgaccl.errors import InvalidArgumentError
            raise InvalidArgumentError("loss", f"{loss!r} is not in [0, 1)")
        self.loss = loss
        self._rng = random.Random(seed)
        self.stats: Counter[str] = Counter()
        self.rx: dict[socket.socket, tuple[int, int]] = {}  # node's socket -> (port, IP)
        self._tx: dict[tuple[int, int], socket.socket] = {}
        self._ports: dict[int, int] = {}                # IP of a port's owner -> port
        self._buf = bytearray(65536)
        self.pcap = None
        # Off when the senders outside capture their own frames (``fpgaccl run --pcap``):
        # the merged capture then holds each frame once.
        self.pcap_inbound = pcap_inbound
        if pcap:
            self.pcap = PcapFile(pcap)
        self.tap = TapMirror(tap) if tap else None

    # ------------------------------------------------------------------ set-up
    def host(self, port: int, ip: str | int) -> None:
        self._ports[ip_int(ip)] = port
        self.rx[self._socket(ip_int(ip), ROCEV2_UDP_PORT)] = (port, ip_int(ip))

    def route(self, port: int, ip: str | int) -> None:
        self._ports[ip_int(ip)] = port

    def _socket(self, ip: int, port: int) -> socket.socket:
        s = self._tx.get((ip, port))
        if s is None:
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
            # DF + id 0, as RoCEv2 wants and as the wrapping on the other side assumes.
            s.setsockopt(socket.IPPROTO_IP, 10, 2)  # IP_MTU_DISCOVER = IP_PMTUDISC_DO
            s.bind((ip_str(ip), port))
            s.setblocking(False)
            self._tx[(ip, port)] = s
        return s

    def sockets(self) -> list[socket.socket]:
        """The sockets datagrams for the simulated nodes arrive on (to wait on)."""
        return list(self.rx)

    # ------------------------------------------------------------------ traffic
    def _mirror(self, frame: bytes, inbound: bool = False) -> None:
        if self.pcap is not None and (self.pcap_inbound or not inbound):
            self.pcap.write(frame)
        if self.tap is not None:
            self.tap.write(frame)

    def _lose(self) -> bool:
        if self.loss and self._rng.random() < self.loss:
            self.stats["lost"] += 1
            return True
        return False

    def from_sim(self, frame: bytes) -> None:
        """A frame the switch sent out of an external port: on to a real socket."""
        if len(frame) < _L2_L4:
            self.stats["malformed"] += 1
            return
        src, dst, sport, dport, dg = split(frame)
        self._mirror(frame[:_L2_L4 + len(dg)])
        if self._lose():
            return
        try:
            self._socket(src, sport).sendto(dg, (ip_str(dst), dport))
            self.stats["to_sockets"] += 1
        except OSError as e:
            # The rank behind that address is gone, or the kernel's queue is full: a lost
            # frame, which the transport recovers or the collective's deadline reports.
            if e.errno == errno.ECONNREFUSED:
                self.stats["refused"] += 1
            else:
                self.stats[f"send_error_{errno.errorcode.get(e.errno, e.errno)}"] += 1

    def poll(self, limit: int = 64) -> list[tuple[int, bytes]]:
        """Datagrams waiting on the nodes' sockets as ``(switch port, frame)``: the
        port is the sender's (its frames enter the switch where its node would)."""
        out: list[tuple[int, bytes]] = []
        for s, (port, dst) in self.rx.items():
            while len(out) < limit:
                try:
                    n, (src_ip, sport) = s.recvfrom_into(self._buf)
                except (BlockingIOError, InterruptedError):
                    break
                except OSError:
                    continue  # an ICMP error of an earlier send; nothing to read
                src = ip_int(src_ip)
                at = self._ports.get(src)
                if at is None:
                    self.stats["unroutable"] += 1
                    continue
                frame = headers(at, port, src, dst, sport, ROCEV2_UDP_PORT, n) + \
                    bytes(self._buf[:n])
                self._mirror(frame, inbound=True)
                if self._lose():
                    continue
                self.stats["from_sockets"] += 1
                out.append((at, frame))
        return out

    def close(self) -> None:
        for s in self._tx.values():
            s.close()
        self._tx.clear()
        self.rx.clear()
        if self.pcap is not None:
            self.pcap.close()
        if self.tap is not None:
            self.tap.close()
