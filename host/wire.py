"""Byte-level RoCEv2 transport headers for the software engine's hot path.

The field layouts come from :mod:`fpgaccl.proto`; this module only turns them into
precompiled :mod:`struct` formats and an incrementally computed ICRC, so that building
or checking a packet costs a handful of C calls instead of a per-field Python loop.
A test proves these bytes equal :func:`fpgaccl.proto.build_frame` for the same values.
"""

from __future__ import annotations

import functools
import ipaddress
import struct
import zlib

try:  # ISA-L's CRC-32: the same polynomial, 0.13 us vs zlib's 3.1 us per 4 KiB here; optional
    from isal.isal_zlib import crc32
except ImportError:  # pragma: no cover - depends on the environment
    from zlib import crc32

from fpgaccl.proto import AETH, BTH, COLLECTIVE_IMM, IMMDT, IPV4, RETH, RING_IMM, UDP
from fpgaccl.proto.headers import ICRC_BYTES, RING_STEP_CREDIT, RING_STEP_P2P
from fpgaccl.proto.icrc import VARIANT_MASK
from fpgaccl.proto.opcodes import (
    ACK_CREDIT_DUPLICATE,
    ACK_CREDIT_HELD,
    ACK_CREDIT_INVALID,
    ACK_CREDIT_PEER_DEAD,
    ACK_CREDIT_REORDERING,
    AETH_OPCODES,
    IMMDT_OPCODES,
    PSN_MOD,
    RETH_OPCODES,
    ROCEV2_UDP_PORT,
    AethKind,
    Opcode,
    aeth_syndrome,
)
from fpgaccl.proto.plans import QPN_BASE

# The struct formats mirror the proto tables; the asserts keep them from drifting apart.
# BTH words: opcode | se,m,pad,tver | pkey | fecn,becn,resv6,dqpn | ackreq,resv7,psn
BTH_FMT = struct.Struct(">BBHII")
RETH_FMT = struct.Struct(">QII")  # va | rkey | dlen
IMM_FMT = struct.Struct(">I")
AETH_FMT = struct.Struct(">I")  # syndrome << 24 | msn
ICRC_FMT = struct.Struct("<I")  # the CRC register's low byte goes first on the wire
assert BTH_FMT.size == BTH.size and RETH_FMT.size == RETH.size
assert IMM_FMT.size == IMMDT.size and AETH_FMT.size == AETH.size

BTH_LEN = BTH.size
RETH_LEN = RETH.size
IMM_LEN = IMMDT.size
AETH_LEN = AETH.size
ICRC_LEN = ICRC_BYTES
UDP_LEN = UDP.size
IP_UDP_LEN = IPV4.size + UDP.size
PKEY = BTH["pkey"].default
ACKREQ = 1 << (BTH["resv7"].bits + BTH["psn"].bits)
"""The AckReq bit of the BTH's PSN word."""
PSN_MASK = PSN_MOD - 1
QPN_MASK = (1 << BTH["dqpn"].bits) - 1
MSN_MASK = (1 << AETH["msn"].bits) - 1
SYNDROME_SHIFT = AETH["msn"].bits
"""The AETH as one 32-bit word: syndrome above the MSN."""
assert ACKREQ == 1 << 31 and [f.name for f in AETH] == ["syndrome", "msn"]

# Variant-bit masks of the BTH's three 32-bit words, read off proto's ICRC mask so the
# definition lives in one place.
_BTH_MASK = VARIANT_MASK[IP_UDP_LEN:IP_UDP_LEN + BTH_LEN]
_MASK_W0 = int.from_bytes(_BTH_MASK[0:4], "big")
_MASK_W1 = int.from_bytes(_BTH_MASK[4:8], "big")
_MASK_W2 = int.from_bytes(_BTH_MASK[8:12], "big")
_BTH_WORDS = struct.Struct(">III")
assert _BTH_WORDS.size == BTH_LEN
_LRH_CRC = zlib.crc32(b"\xff" * 8)

# Sequencer messages (into the collective region): proto.COLLECTIVE_IMM exactly.
assert [f.name for f in COLLECTIVE_IMM] == ["coll_id", "grant", "step"]
IMM_GRANT = 1 << COLLECTIVE_IMM["step"].bits
"""The grant bit of COLLECTIVE_IMM: a zero-length credit (sequencer GRANT)."""
IMM_STEP_MASK = IMM_GRANT - 1


def collective_imm(coll_id: int, grant: bool, step: int) -> int:
    return ((coll_id & 0xFFFF) << 16) | (IMM_GRANT if grant else 0) | (step & IMM_STEP_MASK)


# Ring messages (per-peer receive rings: send/recv and non-program schedules):
# proto.RING_IMM, same field widths, told apart by the region the WRITE lands in.
assert [f.name for f in RING_IMM] == ["coll_id", "final", "step"]
STEP_FINAL = 1 << RING_IMM["step"].bits
"""Set on the last message of a transfer: the receiver checks the total length there."""
STEP_CREDIT = RING_STEP_CREDIT
"""A zero-length message returning a receive-ring slot; ``coll_id`` is the slot index."""
STEP_P2P = RING_STEP_P2P
"""A send/recv message; ``coll_id`` counts send/recv calls per peer pair."""
STEP_MAX = RING_STEP_P2P - 1

ACK_SYNDROME = aeth_syndrome(AethKind.ACK, ACK_CREDIT_INVALID)
DUPLICATE_SYNDROME = aeth_syndrome(AethKind.ACK, ACK_CREDIT_DUPLICATE)
REORDERING_SYNDROME = aeth_syndrome(AethKind.ACK, ACK_CREDIT_REORDERING)
PEER_DEAD_SYNDROME = aeth_syndrome(AethKind.ACK, ACK_CREDIT_PEER_DEAD)
HELD_SYNDROME = aeth_syndrome(AethKind.ACK, ACK_CREDIT_HELD)


def ip_to_int(addr: str) -> int:
    return int(ipaddress.IPv4Address(addr))


@functools.lru_cache(maxsize=8192)
def icrc_seed(src: int, dst: int, sport: int, dport: int, udp_len: int) -> int:
    """CRC state after the LRH placeholder and the masked IPv4+UDP headers.

    The kernel fills the real IP/UDP headers of our datagrams; these are the values it
    uses (DF set, id 0 for an unconnected socket with PMTU discovery on), so a capture
    reconstructed around a datagram carries a valid ICRC.
    """
    ip = IPV4.pack(len=IPV4.size + udp_len, src=src, dst=dst)
    udp = UDP.pack(sport=sport, dport=dport, len=udp_len)
    masked = bytes(a | m for a, m in zip(ip + udp, VARIANT_MASK[:IP_UDP_LEN], strict=True))
    return zlib.crc32(masked, _LRH_CRC)


MASK_OPCODE = _MASK_W0 >> 24
"""OR-ed into the opcode byte of the BTH the ICRC covers (0: the opcode is invariant)."""
MASK_B1 = (_MASK_W0 >> 16) & 0xFF
MASK_PKEY = _MASK_W0 & 0xFFFF
MASK_W1 = _MASK_W1
MASK_W2 = _MASK_W2
# The engines' fast paths CRC the PSN word as sent: RoCEv2 masks none of its bits.
assert MASK_W2 == 0


def bth(opcode: int, pad: int, dqpn: int, ackreq: bool, psn: int) -> bytes:
    return BTH_FMT.pack(opcode, pad << 4, PKEY, dqpn, (ACKREQ if ackreq else 0) | psn)


def bth_masked(opcode: int, pad: int, dqpn: int, ackreq: bool, psn: int) -> bytes:
    return BTH_FMT.pack(opcode | (_MASK_W0 >> 24), (pad << 4) | ((_MASK_W0 >> 16) & 0xFF),
                        PKEY | (_MASK_W0 & 0xFFFF), dqpn | _MASK_W1,
                        (ACKREQ if ackreq else 0) | psn | _MASK_W2)


def received_bth_masked(datagram: bytes | memoryview) -> bytes:
    """A received datagram's BTH as the ICRC covers it: its own bytes (SE, MigReq, P_Key
    and resv7 as sent, whatever they are) with the variant bits set, so that a frame the
    proto model and the HDL accept is not dropped here as a bad ICRC."""
    w0, w1, w2 = _BTH_WORDS.unpack_from(datagram)
    return _BTH_WORDS.pack(w0 | _MASK_W0, w1 | _MASK_W1, w2 | _MASK_W2)


def datagram_icrc(seed: int, masked_bth: bytes, *rest: bytes | memoryview) -> bytes:
    crc = crc32(masked_bth, seed)
    for part in rest:
        crc = crc32(part, crc)
    return ICRC_FMT.pack(crc & 0xFFFFFFFF)


class AckSealer:
    """The ACK/NAK datagrams (BTH + AETH + ICRC) of one queue pair: what they all share,
    the first 8 BTH bytes and the ICRC's state after them, is computed once, leaving
    one 8-byte CRC update per ACK."""

    __slots__ = ("head", "state")

    def __init__(self, src: int, dst: int, dqpn: int, sport: int = ROCEV2_UDP_PORT,
                 dport: int = ROCEV2_UDP_PORT) -> None:
        self.head = bth(Opcode.ACKNOWLEDGE, 0, dqpn, False, 0)[:8]
        seed = icrc_seed(src, dst, sport, dport, UDP_LEN + BTH_LEN + AETH_LEN + ICRC_LEN)
        # The PSN word is covered unmasked (MASK_W2 == 0): it goes with the AETH.
        self.state = crc32(bth_masked(Opcode.ACKNOWLEDGE, 0, dqpn, False, 0)[:8], seed)

    def __call__(self, psn: int, syndrome: int, msn: int) -> bytes:
        tail = _ACK_TAIL.pack(psn, (syndrome << SYNDROME_SHIFT) | (msn & MSN_MASK))
        return self.head + tail + ICRC_FMT.pack(crc32(tail, self.state) & 0xFFFFFFFF)


_ACK_TAIL = struct.Struct(">II")  # BTH word 2 (PSN, AckReq clear), AETH


def ack_datagram(src: int, dst: int, dqpn: int, psn: int, syndrome: int, msn: int,
                 sport: int = ROCEV2_UDP_PORT, dport: int = ROCEV2_UDP_PORT) -> bytes:
    """A complete ACK/NAK datagram (BTH + AETH + ICRC)."""
    return AckSealer(src, dst, dqpn, sport, dport)(psn, syndrome, msn)


HEADERS_LEN = tuple(BTH_LEN + ICRC_LEN + (RETH_LEN if op in RETH_OPCODES else 0)
                    + (IMM_LEN if op in IMMDT_OPCODES else 0)
                    + (AETH_LEN if op in AETH_OPCODES else 0) for op in range(256))
"""By opcode: the shortest datagram that holds the headers it needs (BTH, RETH, ImmDt,
AETH) and the ICRC; a shorter one is dropped as TRUNCATED before a header is read."""

HDL_SPORT = UDP["sport"].default
"""An HDL node's UDP source port base (the ``port.udp_sport`` register's reset value)."""


def hdl_sport(remote_qpn: int) -> int:
    """The port an HDL node sends from on its QP ``remote_qpn``: base + QP index."""
    return (HDL_SPORT + remote_qpn - QPN_BASE) & 0xFFFF


def pack_imm(coll_id: int, step: int) -> int:
    return ((coll_id & 0xFFFF) << 16) | (step & 0xFFFF)


def unpack_imm(imm: int) -> tuple[int, int]:
    return imm >> 16, imm & 0xFFFF
