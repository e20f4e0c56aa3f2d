"""IPv4 header checksum (RFC 1071 one's-complement sum)."""

from __future__ import annotations


def ipv4_checksum(header: bytes) -> int:
    """Checksum of a header whose checksum field is zero (or, to verify: 0 when valid)."""
    if len(header) % 2:
        header = header + b"\x00"
    total = sum(int.from_bytes(header[i:i + 2], "big") for i in range(0, len(header), 2))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF
