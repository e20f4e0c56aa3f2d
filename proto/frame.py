"""Whole RoCEv2 frames from the field tables: build, and parse with drop reasons.

This is the reference model of the hardware parser/builder (``fpgaccl.hw.net``): the
same checks in the same order, so a frame the HDL drops is dropped here for the same
:class:`~fpgaccl.proto.drops.DropReason`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fpgaccl.errors import MalformedHeaderError

from .checksum import ipv4_checksum
from .drops import DropReason
from .headers import AETH, BTH, ETH, ICRC_BYTES, IMMDT, IPV4, RETH, UDP
from .icrc import check_icrc, icrc, icrc_bytes
from .opcodes import (
    AETH_OPCODES,
    ETHERTYPE_IPV4,
    IMMDT_OPCODES,
    RETH_OPCODES,
    ROCEV2_UDP_PORT,
    SUPPORTED_OPCODES,
)

L2_L4_BYTES = ETH.size + IPV4.size + UDP.size


def extension_headers(opcode: int) -> tuple:
    """Extended transport headers that follow the BTH for ``opcode``, in wire order."""
    hdrs = []
    if opcode in RETH_OPCODES:
        hdrs.append(RETH)
    if opcode in AETH_OPCODES:
        hdrs.append(AETH)
    if opcode in IMMDT_OPCODES:
        hdrs.append(IMMDT)
    return tuple(hdrs)


@dataclass
class Frame:
    eth: dict[str, int]
    ip: dict[str, int]
    udp: dict[str, int]
    bth: dict[str, int]
    reth: dict[str, int] | None = None
    aeth: dict[str, int] | None = None
    immdt: dict[str, int] | None = None
    payload: bytes = b""
    icrc: int = 0
    extra: dict = field(default_factory=dict)


def build_frame(*, eth: dict | None = None, ip: dict | None = None, udp: dict | None = None,
                bth: dict, reth: dict | None = None, aeth: dict | None = None,
                immdt: dict | None = None, payload: bytes = b"") -> bytes:
    """Serialise one RoCEv2 frame with correct lengths, IPv4 checksum and ICRC."""
    opcode = bth.get("opcode", BTH["opcode"].default)
    given = {RETH.name: reth, AETH.name: aeth, IMMDT.name: immdt}
    needed = extension_headers(opcode)
    for hdr in (RETH, AETH, IMMDT):
        if (hdr in needed) != (given[hdr.name] is not None):
            verb = "needs" if hdr in needed else "has no"
            raise MalformedHeaderError(hdr.name, "*", f"opcode {opcode:#x} {verb} {hdr.name}")
    pad = -len(payload) % 4
    bth = {**bth, "padcount": pad}
    transport = BTH.pack(bth) + b"".join(h.pack(given[h.name]) for h in needed)
    transport += payload + bytes(pad)
    udp_len = UDP.size + len(transport) + ICRC_BYTES
    udp_hdr = UDP.pack({"dport": ROCEV2_UDP_PORT, **(udp or {}), "len": udp_len, "chksum": 0})
    ip_vals = {**(ip or {}), "len": IPV4.size + udp_len, "chksum": 0}
    ip_hdr = IPV4.pack(ip_vals)
    ip_hdr = IPV4.pack({**ip_vals, "chksum": ipv4_checksum(ip_hdr)})
    packet = ip_hdr + udp_hdr + transport + bytes(ICRC_BYTES)
    packet = packet[:-ICRC_BYTES] + icrc_bytes(icrc(packet))
    return ETH.pack({"type": ETHERTYPE_IPV4, **(eth or {})}) + packet


class Dropped(Exception):
    """Raised by :func:`parse_frame` in place of returning a frame the engine drops."""

    def __init__(self, reason: DropReason, detail: str) -> None:
        self.reason = reason
        super().__init__(f"{reason.name}: {detail}")


def parse_frame(frame: bytes, *, check_icrc_: bool = True) -> Frame:
    """Decode and check a frame as the hardware receive path does.

    Raises :class:`Dropped` with the drop reason (the engine counts it and discards the
    frame). Header values are returned unvalidated beyond those checks.
    """
    frame = bytes(frame)
    if len(frame) < L2_L4_BYTES + BTH.size + ICRC_BYTES:
        raise Dropped(DropReason.TRUNCATED, f"{len(frame)} bytes")
    eth = ETH.unpack(frame, validate=False)
    if eth["type"] != ETHERTYPE_IPV4:
        raise Dropped(DropReason.BAD_ETHERTYPE, f"{eth['type']:#06x}")
    ip_raw = frame[ETH.size:ETH.size + IPV4.size]
    ip = IPV4.unpack(ip_raw, validate=False)
    if ip["version"] != 4:
        raise Dropped(DropReason.IPV4_VERSION, str(ip["version"]))
    if ip["ihl"] != 5:
        raise Dropped(DropReason.IPV4_OPTIONS, f"ihl={ip['ihl']}")
    if ip["flags"] & 0b001 or ip["frag"]:
        raise Dropped(DropReason.IPV4_FRAGMENT, f"flags={ip['flags']} frag={ip['frag']}")
    if ipv4_checksum(ip_raw) != 0:
        raise Dropped(DropReason.IPV4_CHECKSUM, f"{ip['chksum']:#06x}")
    if ip["proto"] != 17:
        raise Dropped(DropReason.IPV4_PROTOCOL, str(ip["proto"]))
    if ip["len"] < IPV4.size + UDP.size or ETH.size + ip["len"] > len(frame):
        raise Dropped(DropReason.IPV4_LENGTH, f"len={ip['len']} frame={len(frame)}")
    # Anything past the IP length is Ethernet padding.
    packet = frame[ETH.size:ETH.size + ip["len"]]
    udp = UDP.unpack(packet[IPV4.size:], validate=False)
    if udp["dport"] != ROCEV2_UDP_PORT:
        raise Dropped(DropReason.UDP_PORT, str(udp["dport"]))
    if udp["len"] != ip["len"] - IPV4.size:
        raise Dropped(DropReason.UDP_LENGTH, f"udp={udp['len']} ip={ip['len']}")
    transport = packet[IPV4.size + UDP.size:]
    if len(transport) < BTH.size + ICRC_BYTES:
        raise Dropped(DropReason.TRUNCATED, "no room for BTH + ICRC")
    bth = BTH.unpack(transport, validate=False)
    if bth["version"] != 0:
        raise Dropped(DropReason.BTH_VERSION, str(bth["version"]))
    if bth["opcode"] not in SUPPORTED_OPCODES:
        raise Dropped(DropReason.UNKNOWN_OPCODE, f"{bth['opcode']:#04x}")
    ext = extension_headers(bth["opcode"])
    ext_len = sum(h.size for h in ext)
    if len(transport) < BTH.size + ext_len + ICRC_BYTES + bth["padcount"]:
        raise Dropped(DropReason.TRUNCATED, "extended headers cut short")
    if check_icrc_ and not check_icrc(packet):
        raise Dropped(DropReason.BAD_ICRC, f"{int.from_bytes(packet[-4:], 'little'):#010x}")
    out = Frame(eth=eth, ip=ip, udp=udp, bth=bth,
                icrc=int.from_bytes(packet[-4:], "little"))
    pos = BTH.size
    for h in ext:
        setattr(out, h.name.lower(), h.unpack(transport[pos:], validate=False))
        pos += h.size
    out.payload = transport[pos:len(transport) - ICRC_BYTES - bth["padcount"]]
    return out
