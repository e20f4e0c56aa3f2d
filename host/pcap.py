"""Packet capture of the engine's traffic as Ethernet/IPv4/UDP/RoCEv2 frames.

The engine sends datagrams through the kernel, so the capture wraps each one in the
Ethernet, IPv4 and UDP headers it travels with (built from the proto tables, DF set and
id 0 as the kernel writes them), which is what makes the ICRC in the capture valid.
Each rank captures what it transmits; :func:`merge` joins the ranks by timestamp.
"""

from __future__ import annotations

import functools
import heapq
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from fpgaccl.proto import ETH, IPV4, UDP, ipv4_checksum
from fpgaccl.proto.opcodes import ETHERTYPE_IPV4, ROCEV2_UDP_PORT

from . import wire

_GLOBAL = struct.Struct("<IHHiIII")
_RECORD = struct.Struct("<IIII")
PCAP_MAGIC_US = 0xA1B2C3D4
LINKTYPE_ETHERNET = 1


def mac_of(ip: int) -> int:
    """A locally administered MAC derived from the IPv4 address (02:00:a.b.c.d)."""
    return (0x0200 << 32) | ip


@functools.lru_cache(maxsize=4096)
def l2_l4_headers(src: int, dst: int, sport: int, dport: int, datagram_len: int) -> bytes:
    udp_len = UDP.size + datagram_len
    ip_vals = {"len": IPV4.size + udp_len, "src": src, "dst": dst}
    ip = IPV4.pack(ip_vals)
    ip = IPV4.pack({**ip_vals, "chksum": ipv4_checksum(ip)})
    eth = ETH.pack(dst=mac_of(dst), src=mac_of(src), type=ETHERTYPE_IPV4)
    return eth + ip + UDP.pack(sport=sport, dport=dport, len=udp_len, chksum=0)


def frame(src_ip: str, dst_ip: str, datagram: bytes, sport: int = ROCEV2_UDP_PORT,
          dport: int = ROCEV2_UDP_PORT) -> bytes:
    return l2_l4_headers(wire.ip_to_int(src_ip), wire.ip_to_int(dst_ip), sport, dport,
                         len(datagram)) + datagram


class PcapWriter:
    """Writes one pcap file; safe to call from the engine thread while the host closes."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "wb")  # noqa: SIM115 - lives as long as the engine
        self._f.write(_GLOBAL.pack(PCAP_MAGIC_US, 2, 4, 0, 0, 65535, LINKTYPE_ETHERNET))
        self._lock = threading.Lock()

    def write(self, data: bytes, ts: float | None = None) -> None:
        ts = time.time() if ts is None else ts
        sec = int(ts)
        usec = int((ts - sec) * 1e6)
        with self._lock:
            if self._f.closed:
                return
            self._f.write(_RECORD.pack(sec, usec, len(data), len(data)) + data)

    def tap(self, src_ip: str, addr: tuple[str, int], datagram: bytes) -> None:
        """Engine hook: one transmitted datagram."""
        self.write(frame(src_ip, addr[0], datagram, ROCEV2_UDP_PORT, addr[1]))

    def close(self) -> None:
        with self._lock:
            self._f.close()


def read(path: str | Path) -> Iterator[tuple[float, bytes]]:
    data = Path(path).read_bytes()
    magic = struct.unpack_from("<I", data)[0]
    if magic != PCAP_MAGIC_US:
        raise ValueError(f"{path}: not a little-endian microsecond pcap")
    pos = _GLOBAL.size
    while pos + _RECORD.size <= len(data):
        sec, usec, incl, _ = _RECORD.unpack_from(data, pos)
        pos += _RECORD.size
        yield sec + usec / 1e6, data[pos:pos + incl]
        pos += incl


def merge(inputs: list[Path], out: str | Path) -> int:
    """Merge per-rank captures into one, ordered by timestamp; returns the frame count."""
    w = PcapWriter(out)
    n = 0
    try:
        for ts, data in heapq.merge(*(read(p) for p in inputs), key=lambda r: r[0]):
            w.write(data, ts)
            n += 1
    finally:
        w.close()
    return n
