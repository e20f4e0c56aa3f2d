"""The header record the parser emits and the builder takes, and opcode decoding.

Everything is derived from :mod:`fpgaccl.proto`: the per-header struct layouts from the
field tables (:func:`~fpgaccl.hw.net.layouts.header_layout`), which extended headers
follow an opcode from :func:`~fpgaccl.proto.extension_headers`.
"""

from __future__ import annotations

from amaranth.hdl import Module, Signal, Value
from amaranth.lib import data

from fpgaccl.proto import AETH, BTH, ETH, IMMDT, IPV4, RETH, UDP, extension_headers
from fpgaccl.proto.headers import ICRC_BYTES
from fpgaccl.proto.opcodes import SUPPORTED_OPCODES

from .layouts import header_layout

BASE_HDR_BYTES = ETH.size + IPV4.size + UDP.size + BTH.size
"""Ethernet + IPv4 + UDP + BTH: 54 bytes, always present."""
MAX_EXT_BYTES = max(sum(h.size for h in extension_headers(op)) for op in SUPPORTED_OPCODES)
MAX_HDR_BYTES = BASE_HDR_BYTES + MAX_EXT_BYTES
OFFSETS = {ETH.name: 0, IPV4.name: ETH.size, UDP.name: ETH.size + IPV4.size,
           BTH.name: ETH.size + IPV4.size + UDP.size}
"""Byte offset in the frame of each fixed header."""
MIN_FRAME_BYTES = BASE_HDR_BYTES + ICRC_BYTES
PAYLOAD_LEN_BITS = 16

EXT_SIZES = {op: sum(h.size for h in extension_headers(op)) for op in SUPPORTED_OPCODES}
HEADER_LENGTHS = sorted({BASE_HDR_BYTES + n for n in EXT_SIZES.values()})
"""Every header length a supported opcode gives (54, 58, 70, 74)."""


def ext_offset(opcode: int, header) -> int:
    """Frame byte offset of extended ``header`` for ``opcode``."""
    pos = BASE_HDR_BYTES
    for h in extension_headers(opcode):
        if h is header:
            return pos
        pos += h.size
    raise KeyError(header.name)


RECORD = data.StructLayout({
    "eth": header_layout(ETH),
    "ip": header_layout(IPV4),
    "udp": header_layout(UDP),
    "bth": header_layout(BTH),
    "reth": header_layout(RETH),
    "aeth": header_layout(AETH),
    "immdt": header_layout(IMMDT),
    "has_reth": 1,
    "has_aeth": 1,
    "has_immdt": 1,
    "payload_len": PAYLOAD_LEN_BITS,
})
"""One packet's headers. Extended headers an opcode lacks read as zero and their
``has_*`` flag is clear. ``payload_len`` counts payload bytes without BTH pad; the
parser emits a payload packet only when it is not zero, and the builder expects one only
then. On the transmit side the builder computes IP/UDP lengths, the IPv4 checksum, the
UDP checksum (zero), ``bth.padcount`` and the ICRC itself, derives the extended headers
from ``bth.opcode``, and ignores those fields and the ``has_*`` flags of the record."""


class OpcodeInfo:
    """Combinational decode of an opcode into its extended headers and their length."""

    def __init__(self, m: Module, opcode: Value, name: str = "op") -> None:
        self.supported = Signal(name=f"{name}_supported")
        self.has_reth = Signal(name=f"{name}_has_reth")
        self.has_aeth = Signal(name=f"{name}_has_aeth")
        self.has_immdt = Signal(name=f"{name}_has_immdt")
        self.ext_len = Signal(range(MAX_EXT_BYTES + 1), name=f"{name}_ext_len")
        with m.Switch(opcode):
            for op in sorted(SUPPORTED_OPCODES):
                hdrs = extension_headers(op)
                with m.Case(op):
                    m.d.comb += [
                        self.supported.eq(1),
                        self.has_reth.eq(RETH in hdrs),
                        self.has_aeth.eq(AETH in hdrs),
                        self.has_immdt.eq(IMMDT in hdrs),
                        self.ext_len.eq(EXT_SIZES[op]),
                    ]
