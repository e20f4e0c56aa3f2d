"""Numbers that identify things on the wire: ports, ethertypes, BTH opcodes, AETH codes."""

from __future__ import annotations

from enum import IntEnum

ETHERTYPE_IPV4 = 0x0800
ETHERTYPE_ARP = 0x0806
IP_PROTO_UDP = 17
IP_PROTO_ICMP = 1
ROCEV2_UDP_PORT = 4791
"""IANA-assigned destination port of RoCEv2."""

BTH_VERSION = 0
DEFAULT_PKEY = 0xFFFF
PSN_BITS = 24
PSN_MOD = 1 << PSN_BITS
QPN_BITS = 24


class Opcode(IntEnum):
    """Reliable Connection (RC) BTH opcodes used by the engine (IBTA vol. 1, 9.2)."""

    SEND_FIRST = 0x00
    SEND_MIDDLE = 0x01
    SEND_LAST = 0x02
    SEND_LAST_WITH_IMMEDIATE = 0x03
    SEND_ONLY = 0x04
    SEND_ONLY_WITH_IMMEDIATE = 0x05
    RDMA_WRITE_FIRST = 0x06
    RDMA_WRITE_MIDDLE = 0x07
    RDMA_WRITE_LAST = 0x08
    RDMA_WRITE_LAST_WITH_IMMEDIATE = 0x09
    RDMA_WRITE_ONLY = 0x0A
    RDMA_WRITE_ONLY_WITH_IMMEDIATE = 0x0B
    ACKNOWLEDGE = 0x11


SUPPORTED_OPCODES = frozenset(int(op) for op in Opcode)

# Which extended headers follow the BTH, per opcode (IBTA vol. 1, table 38).
RETH_OPCODES = frozenset({Opcode.RDMA_WRITE_FIRST, Opcode.RDMA_WRITE_ONLY,
                          Opcode.RDMA_WRITE_ONLY_WITH_IMMEDIATE})
IMMDT_OPCODES = frozenset({Opcode.SEND_LAST_WITH_IMMEDIATE, Opcode.SEND_ONLY_WITH_IMMEDIATE,
                           Opcode.RDMA_WRITE_LAST_WITH_IMMEDIATE,
                           Opcode.RDMA_WRITE_ONLY_WITH_IMMEDIATE})
AETH_OPCODES = frozenset({Opcode.ACKNOWLEDGE})
FIRST_OPCODES = frozenset({Opcode.SEND_FIRST, Opcode.RDMA_WRITE_FIRST})
MIDDLE_OPCODES = frozenset({Opcode.SEND_MIDDLE, Opcode.RDMA_WRITE_MIDDLE})
LAST_OPCODES = frozenset({Opcode.SEND_LAST, Opcode.SEND_LAST_WITH_IMMEDIATE,
                          Opcode.RDMA_WRITE_LAST, Opcode.RDMA_WRITE_LAST_WITH_IMMEDIATE})
ONLY_OPCODES = frozenset({Opcode.SEND_ONLY, Opcode.SEND_ONLY_WITH_IMMEDIATE,
                          Opcode.RDMA_WRITE_ONLY, Opcode.RDMA_WRITE_ONLY_WITH_IMMEDIATE})


def write_opcode(first: bool, last: bool, immediate: bool) -> Opcode:
    """The RDMA WRITE opcode for one segment of a message."""
    if first and last:
        return Opcode.RDMA_WRITE_ONLY_WITH_IMMEDIATE if immediate else Opcode.RDMA_WRITE_ONLY
    if first:
        return Opcode.RDMA_WRITE_FIRST
    if last:
        return Opcode.RDMA_WRITE_LAST_WITH_IMMEDIATE if immediate else Opcode.RDMA_WRITE_LAST
    return Opcode.RDMA_WRITE_MIDDLE


class AethKind(IntEnum):
    """Top bits [6:5] of the AETH syndrome (IBTA vol. 1, 9.7.5.1)."""

    ACK = 0b00
    RNR_NAK = 0b01
    RESERVED = 0b10     # named so that any received syndrome splits
    NAK = 0b11


class NakCode(IntEnum):
    """Low five bits of a NAK syndrome."""

    PSN_SEQUENCE_ERROR = 0
    INVALID_REQUEST = 1
    REMOTE_ACCESS_ERROR = 2
    REMOTE_OPERATIONAL_ERROR = 3
    INVALID_RD_REQUEST = 4


ACK_CREDIT_INVALID = 0b11111
"""Credit field of an ACK syndrome meaning 'no end-to-end flow control'."""

ACK_CREDIT_DUPLICATE = 0b11110
"""Credit field of a *duplicate report*, an ACK between two software engines only
(proto/reliability.py): cumulative as any ACK, its MSN names a PSN that arrived twice. No
end-to-end credits flow between them, so the field is free; the HDL reads only the kind."""


ACK_CREDIT_REORDERING = 0b11101
"""Credit field of a *reordering notice*, an ACK between two software engines only
(proto/reliability.py): cumulative as any ACK, its MSN carries for how many microseconds
the engine it is sent to should hold back each hole report to the sender."""


ACK_CREDIT_PEER_DEAD = 0b11100
"""Credit field of a *dead-peer notice*, an ACK between two software engines only
(proto/reliability.py): cumulative as any ACK, its MSN carries the rank the sender found
dead; the engine it is sent to fails its calls naming that rank."""


ACK_CREDIT_HELD = 0b11011
"""Credit field of a *holding report*, an ACK between two software engines only
(proto/reliability.py): cumulative as any ACK, its MSN names the farthest PSN the sender
holds past a hole."""


def aeth_syndrome(kind: AethKind, value: int) -> int:
    return (int(kind) << 5) | (value & 0x1F)


def split_syndrome(syndrome: int) -> tuple[AethKind, int]:
    return AethKind((syndrome >> 5) & 0b11), syndrome & 0x1F


def psn_add(psn: int, n: int) -> int:
    return (psn + n) % PSN_MOD


def psn_diff(a: int, b: int) -> int:
    """Signed distance a - b in the 24-bit PSN space, in [-2^23, 2^23)."""
    d = (a - b) % PSN_MOD
    return d - PSN_MOD if d >= PSN_MOD // 2 else d
