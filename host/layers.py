"""scapy layers for fpgaccl's RoCEv2 traffic.

scapy.contrib.roce already provides BTH (with ICRC), AETH and GRH; this module generates
what it lacks (RETH, ImmDt) from the :mod:`fpgaccl.proto` field tables, binds them by
opcode, and offers :func:`dissect`, a strict decoder that raises
:class:`~fpgaccl.errors.MalformedHeaderError` naming the faulty field instead of falling
back to ``Raw`` as scapy does.
"""

from __future__ import annotations

from scapy.contrib.roce import AETH, BTH
from scapy.fields import BitField, XBitField
from scapy.layers.inet import IP, UDP
from scapy.layers.l2 import Ether
from scapy.packet import Packet, Raw, bind_layers

from fpgaccl import proto
from fpgaccl.errors import IcrcError, MalformedHeaderError
from fpgaccl.proto.headers import Header
from fpgaccl.proto.opcodes import IMMDT_OPCODES, RETH_OPCODES, ROCEV2_UDP_PORT, Opcode


def fields_desc(header: Header) -> list:
    """scapy fields for a proto header table, bit for bit."""
    return [(XBitField if f.hex else BitField)(f.name, f.default, f.bits) for f in header]


class _TableLayer(Packet):
    """A layer whose wire format is a proto table; refuses to dissect short input."""

    table: Header

    def do_dissect(self, s: bytes) -> bytes:
        self.table.unpack(s, validate=False)  # raises, naming the first missing field
        return super().do_dissect(s)


class RETH(_TableLayer):
    name = "RETH"
    table = proto.RETH
    fields_desc = fields_desc(proto.RETH)

    def guess_payload_class(self, payload: bytes) -> type[Packet]:
        bth = self.underlayer
        if isinstance(bth, BTH) and bth.opcode == Opcode.RDMA_WRITE_ONLY_WITH_IMMEDIATE:
            return ImmDt
        return Raw


class ImmDt(_TableLayer):
    name = "ImmDt"
    table = proto.IMMDT
    fields_desc = fields_desc(proto.IMMDT)

    def guess_payload_class(self, payload: bytes) -> type[Packet]:
        return Raw


for _op in RETH_OPCODES:
    bind_layers(BTH, RETH, opcode=int(_op))
for _op in IMMDT_OPCODES - RETH_OPCODES:
    bind_layers(BTH, ImmDt, opcode=int(_op))

# scapy's own layers, as proto names them, for validation.
_SCAPY_OF = {proto.ETH.name: Ether, proto.IPV4.name: IP, proto.UDP.name: UDP,
             proto.BTH.name: BTH, proto.RETH.name: RETH, proto.AETH.name: AETH,
             proto.IMMDT.name: ImmDt}


def _values(layer: Packet, table: Header) -> dict[str, int]:
    out = {}
    for f in table:
        v = layer.getfieldval(f.name)
        if isinstance(v, str):  # MAC / IP as text
            v = (int(v.replace(":", ""), 16) if ":" in v
                 else int.from_bytes(bytes(int(x) for x in v.split(".")), "big"))
        out[f.name] = int(v)
    return out


def dissect(frame: bytes, *, check_icrc: bool = True) -> Ether:
    """Dissect a frame with scapy and validate every layer against the proto tables.

    Raises :class:`MalformedHeaderError` (or :class:`IcrcError`) naming the first field
    that is truncated, carries a forbidden value, or an opcode that is unknown.
    """
    frame = bytes(frame)
    proto.ETH.unpack(frame, validate=False)
    pkt = Ether(frame)
    expected = [proto.ETH, proto.IPV4, proto.UDP, proto.BTH]
    layer: Packet = pkt
    rest = frame[proto.ETH.size:]
    for i, table in enumerate(expected):
        cls = _SCAPY_OF[table.name]
        if not isinstance(layer, cls):
            # scapy gave up (Raw or padding): decode the bytes with the table to name why.
            table.unpack(rest)
            raise MalformedHeaderError(table.name, "*", f"not dissected as {table.name}")
        table.validate(_values(layer, table))
        if table is proto.IPV4 and layer.len > len(rest):
            raise MalformedHeaderError("IP", "len", f"claims {layer.len} bytes, "
                                       f"the frame carries {len(rest)}")
        if table is proto.UDP and layer.dport != ROCEV2_UDP_PORT:
            raise MalformedHeaderError("UDP", "dport", f"{layer.dport} is not RoCEv2 (4791)")
        rest = bytes(layer.payload)
        if i + 1 < len(expected):
            layer = layer.payload
    bth = layer
    for table in proto.extension_headers(bth.opcode):
        nxt = layer.payload
        if not isinstance(nxt, _SCAPY_OF[table.name]):
            table.unpack(bytes(nxt))
            raise MalformedHeaderError(table.name, "*", f"not dissected as {table.name}")
        layer = nxt
    if check_icrc:
        ip_bytes = bytes(pkt[IP])[: pkt[IP].len]
        want = proto.icrc(ip_bytes)
        if proto.icrc_bytes(want) != ip_bytes[-4:]:
            raise IcrcError(want, int.from_bytes(ip_bytes[-4:], "little"))
    return pkt


__all__ = ["AETH", "BTH", "RETH", "ImmDt", "dissect", "fields_desc"]
