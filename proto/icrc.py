"""RoCEv2 invariant CRC (IBTA vol. 1 annex A17.3.3).

The ICRC is CRC-32 (the Ethernet polynomial) over: 8 bytes of 0xFF standing in for the
InfiniBand LRH, then the IP header, UDP header, BTH, extended headers and payload, with
the fields that routers may change replaced by all-ones. For IPv4 those are ToS (DSCP
and ECN), TTL and the header checksum; UDP's checksum; the BTH's FECN, BECN and resv6
bits. It is appended little-endian (the CRC register's low byte goes first on the wire).
"""

from __future__ import annotations

import zlib

from .headers import BTH, IPV4, UDP

_LRH_PLACEHOLDER = b"\xff" * 8

# Byte masks (1 = replaced by 0xFF) over IPv4 + UDP + BTH, derived from the field tables
# so the HDL and the software agree on one definition.
_VARIANT = {IPV4.name: ("tos", "ttl", "chksum"), UDP.name: ("chksum",),
            BTH.name: ("fecn", "becn", "resv6")}


def variant_mask() -> bytes:
    """All-ones where a variant bit lies in the IPv4+UDP+BTH prefix, zero elsewhere."""
    out = bytearray()
    for hdr in (IPV4, UDP, BTH):
        word = 0
        for f in hdr:
            word <<= f.bits
            if f.name in _VARIANT[hdr.name]:
                word |= (1 << f.bits) - 1
        out += word.to_bytes(hdr.size, "big")
    return bytes(out)


VARIANT_MASK = variant_mask()
MASKED_PREFIX = len(VARIANT_MASK)  # 20 + 8 + 12 bytes


def icrc(ip_packet: bytes) -> int:
    """ICRC of an IPv4 packet (IP header onwards) whose last 4 bytes are the ICRC slot.

    The slot's content is ignored; the IP/UDP length fields must already count it.
    """
    body = bytearray(ip_packet[:-4])
    if len(body) < MASKED_PREFIX:
        raise ValueError(f"packet of {len(ip_packet)} bytes is shorter than IPv4+UDP+BTH+ICRC")
    for i, m in enumerate(VARIANT_MASK):
        body[i] |= m
    return zlib.crc32(bytes(body), zlib.crc32(_LRH_PLACEHOLDER)) & 0xFFFFFFFF


def icrc_bytes(value: int) -> bytes:
    return value.to_bytes(4, "little")


def check_icrc(ip_packet: bytes) -> bool:
    return icrc_bytes(icrc(ip_packet)) == bytes(ip_packet[-4:])
