"""The single source of truth for fpgaccl's wire formats, opcodes and registers.

Pure Python, no dependencies: the HDL (``fpgaccl.hw``), the scapy layers
(``fpgaccl.host.layers``), the simulator and the runtime all derive from these tables.
"""

from .checksum import ipv4_checksum
from .drops import DropReason
from .fields import Field, Header
from .frame import Dropped, Frame, build_frame, extension_headers, parse_frame
from .headers import (
    AETH,
    BTH,
    COLLECTIVE_IMM,
    ETH,
    HEADERS,
    IMMDT,
    IPV4,
    RETH,
    RING_IMM,
    UDP,
)
from .icrc import check_icrc, icrc, icrc_bytes
from .opcodes import ROCEV2_UDP_PORT, AethKind, NakCode, Opcode

__all__ = [
    "AETH",
    "BTH",
    "COLLECTIVE_IMM",
    "ETH",
    "HEADERS",
    "IMMDT",
    "IPV4",
    "RETH",
    "RING_IMM",
    "ROCEV2_UDP_PORT",
    "UDP",
    "AethKind",
    "DropReason",
    "Dropped",
    "Field",
    "Frame",
    "Header",
    "NakCode",
    "Opcode",
    "build_frame",
    "check_icrc",
    "extension_headers",
    "icrc",
    "icrc_bytes",
    "ipv4_checksum",
    "parse_frame",
]
