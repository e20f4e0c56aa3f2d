"""Packet capture of the engine's traffic as Ethernet/IPv4/UDP/RoCEv2 frames.

The engine sends datagrams through the kernel, so the capture wraps each one in the
Ethernet, IPv4 and UDP headers it travels with (built from the proto tables, DF set and
id 0 as the kernel writes them), which is what makes the ICRC in the capture valid.
Each rank captures what it transmits; :func:`merge` joins the ranks by timestamp. The file
format itself is :mod:`fpgaccl.pcapfile`, shared with the simulation's bridge.
"""

from __future__ import annotations

import functools

from fpgaccl.pcapfile import PcapFile, merge, read
from fpgaccl.proto import ETH, IPV4, UDP, ipv4_checksum
from fpgaccl.proto.opcodes import ETHERTYPE_IPV4, ROCEV2_UDP_PORT

from . import wire

__all__ = ["PcapWriter", "frame", "l2_l4_headers", "mac_of", "merge", "read"]


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


class PcapWriter(PcapFile):
    """A pcap file the engine writes its transmitted datagrams to."""

    def tap(self, src_ip: str, addr: tuple[str, int], datagram: bytes) -> None:
        """Engine hook: one transmitted datagram."""
        self.write(frame(src_ip, addr[0], datagram, ROCEV2_UDP_PORT, addr[1]))
