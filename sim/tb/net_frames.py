"""Stimulus for the network benches: RoCEv2 frames built with scapy (the host layers),
seeded random headers, the mutations that make each drop reason, and helpers that turn
the header record the HDL emits back into proto field dicts.

Not a cocotb module itself: the parser/builder benches import it.
"""

from __future__ import annotations

import random

from scapy.contrib.roce import AETH, BTH
from scapy.layers.inet import IP, UDP, IPOption_NOP
from scapy.layers.l2 import Ether
from scapy.packet import Raw

from fpgaccl import proto
from fpgaccl.host.layers import RETH, ImmDt
from fpgaccl.hw.net.record import RECORD
from fpgaccl.proto import Dropped, DropReason, extension_headers, parse_frame
from fpgaccl.proto.opcodes import SUPPORTED_OPCODES
from fpgaccl.sim.models.stream import unpack

OPCODES = sorted(SUPPORTED_OPCODES)
TABLES = {"eth": proto.ETH, "ip": proto.IPV4, "udp": proto.UDP, "bth": proto.BTH,
          "reth": proto.RETH, "aeth": proto.AETH, "immdt": proto.IMMDT}


def _mac(v: int) -> str:
    return ":".join(f"{b:02x}" for b in v.to_bytes(6, "big"))


def _ip(v: int) -> str:
    return ".".join(str(b) for b in v.to_bytes(4, "big"))


def random_fields(rng: random.Random, opcode: int | None = None) -> dict[str, dict[str, int]]:
    """Random header values for every table an opcode needs (lengths etc. left out)."""
    op = rng.choice(OPCODES) if opcode is None else opcode
    f = {
        "eth": {"dst": rng.getrandbits(48), "src": rng.getrandbits(48)},
        "ip": {"tos": rng.getrandbits(8), "id": rng.getrandbits(16), "flags": 0b010,
               "ttl": rng.getrandbits(8), "src": rng.getrandbits(32), "dst": rng.getrandbits(32)},
        "udp": {"sport": rng.getrandbits(16), "dport": proto.ROCEV2_UDP_PORT},
        "bth": {"opcode": op, "solicited": rng.getrandbits(1), "migreq": rng.getrandbits(1),
                "pkey": rng.getrandbits(16), "fecn": rng.getrandbits(1),
                "becn": rng.getrandbits(1), "dqpn": rng.getrandbits(24),
                "ackreq": rng.getrandbits(1), "psn": rng.getrandbits(24)},
    }
    for h in extension_headers(op):
        key = {"RETH": "reth", "AETH": "aeth", "ImmDt": "immdt"}[h.name]
        f[key] = {fl.name: rng.getrandbits(fl.bits) for fl in h}
    return f


def scapy_frame(fields: dict, payload: bytes, *, ip_over: dict | None = None,
                udp_over: dict | None = None, bth_over: dict | None = None,
                eth_over: dict | None = None) -> bytes:
    """The frame scapy builds for these fields, with BTH pad bytes and ICRC."""
    e, i, u, b = fields["eth"], fields["ip"], fields["udp"], fields["bth"]
    pad = -len(payload) % 4
    pkt = Ether(dst=_mac(e["dst"]), src=_mac(e["src"]), **(eth_over or {}))
    pkt /= IP(tos=i["tos"], id=i["id"], flags=i["flags"], ttl=i["ttl"],
              src=_ip(i["src"]), dst=_ip(i["dst"]), **(ip_over or {}))
    pkt /= UDP(sport=u["sport"], dport=u["dport"], chksum=0, **(udp_over or {}))
    bth = {k: v for k, v in b.items() if k not in ("padcount", "version")}
    pkt /= BTH(**{**bth, "padcount": pad, **(bth_over or {})})
    if "reth" in fields:
        pkt /= RETH(**fields["reth"])
    if "aeth" in fields:
        pkt /= AETH(**fields["aeth"])
    if "immdt" in fields:
        pkt /= ImmDt(**fields["immdt"])
    body = payload + bytes(pad)
    if body:
        pkt /= Raw(body)
    return bytes(pkt)


def good_frame(rng: random.Random, max_payload: int = 300) -> tuple[bytes, dict, bytes]:
    fields = random_fields(rng)
    n = rng.choice([0, rng.randint(1, 16), rng.randint(1, max_payload)])
    payload = bytes(rng.getrandbits(8) for _ in range(n))
    frame = scapy_frame(fields, payload)
    if rng.random() < 0.1:
        frame += bytes(rng.randint(1, 12))  # Ethernet padding past the IP length
    return frame, fields, payload


def bad_frame(rng: random.Random, reason: DropReason) -> bytes:
    """A frame that the reference model drops for ``reason``."""
    for _ in range(100):
        frame = _bad_frame(rng, reason)
        if expect(frame) == reason:
            return frame
    raise AssertionError(f"could not make a frame dropped for {reason.name}")


def _bad_frame(rng: random.Random, reason: DropReason) -> bytes:
    fields = random_fields(rng)
    payload = bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 100)))
    R = DropReason
    kw: dict = {}
    if reason == R.BAD_ETHERTYPE:
        kw["eth_over"] = {"type": rng.choice([0x86DD, 0x0806, 0x8100])}
    elif reason == R.IPV4_VERSION:
        kw["ip_over"] = {"version": rng.choice([6, 5, 0])}
    elif reason == R.IPV4_OPTIONS:
        kw["ip_over"] = {"options": [IPOption_NOP()] * 4}
    elif reason == R.IPV4_FRAGMENT:
        kw["ip_over"] = rng.choice([{"flags": "MF"}, {"frag": rng.randint(1, 100)}])
        fields["ip"]["flags"] = (kw["ip_over"].pop("flags", 0) and 1) or 0
    elif reason == R.IPV4_CHECKSUM:
        kw["ip_over"] = {"chksum": rng.getrandbits(16)}
    elif reason == R.IPV4_PROTOCOL:
        kw["ip_over"] = {"proto": rng.choice([6, 1, 18])}
    elif reason == R.IPV4_LENGTH:
        frame = scapy_frame(fields, payload)
        too_long = len(frame) - 14 + rng.randint(1, 9)
        kw["ip_over"] = {"len": rng.choice([rng.randint(0, 27), too_long])}
    elif reason == R.UDP_PORT:
        fields["udp"]["dport"] = rng.choice([4790, 4792, 53, 0])
    elif reason == R.UDP_LENGTH:
        frame = scapy_frame(fields, payload)
        kw["udp_over"] = {"len": len(frame) - 34 + rng.choice([-2, 1, 7])}
    elif reason == R.BTH_VERSION:
        kw["bth_over"] = {"version": rng.randint(1, 15)}
    elif reason == R.UNKNOWN_OPCODE:
        fields["bth"]["opcode"] = rng.choice([0x0C, 0x10, 0x12, 0x64, 0xFF])
    elif reason == R.BAD_ICRC:
        frame = bytearray(scapy_frame(fields, payload))
        # Any invariant byte: IP addresses, BTH fields, payload or the ICRC itself.
        pos = rng.choice([38, 44, 50, len(frame) - 1, rng.randint(54, len(frame) - 1)])
        frame[pos] ^= 1 << rng.randint(0, 7)
        return bytes(frame)
    elif reason == R.TRUNCATED:
        frame = scapy_frame(fields, payload)
        if rng.random() < 0.5:
            return frame[:rng.randint(1, 57)]
        # IP length too short for BTH + ICRC (lengths consistent, checksum right).
        short = frame[:14 + 28 + rng.randint(0, 15)]
        return scapy_frame_from_ip_bytes(short)
    return scapy_frame(fields, payload, **kw)


def scapy_frame_from_ip_bytes(frame: bytes) -> bytes:
    """Rewrite IP/UDP lengths and the IP checksum to fit a cut frame."""
    pkt = Ether(frame)
    pkt[IP].len = None
    pkt[IP].chksum = None
    pkt[UDP].len = None
    return bytes(Ether(bytes(pkt)))[:len(frame)]


def expect(frame: bytes) -> proto.Frame | DropReason:
    try:
        return parse_frame(frame)
    except Dropped as d:
        return d.reason


def record_fields(word: int) -> dict:
    """Header record value -> {"eth": {...}, ..., "has_reth": 0/1, "payload_len": n}."""
    top = unpack(RECORD, word)
    out = {k: TABLES[k].from_int(top[k]) for k in TABLES}
    for k in ("has_reth", "has_aeth", "has_immdt", "payload_len"):
        out[k] = top[k]
    return out


def record_word(fields: dict, payload_len: int) -> int:
    """Header record value the builder takes for these fields."""
    from fpgaccl.sim.models.stream import pack

    values = {}
    for k, table in TABLES.items():
        vals = {**table.defaults(), **fields.get(k, {})} if k in fields else {}
        values[k] = table.to_int(vals) if k in fields else 0
    values["has_reth"] = int("reth" in fields)
    values["has_aeth"] = int("aeth" in fields)
    values["has_immdt"] = int("immdt" in fields)
    values["payload_len"] = payload_len
    return pack(RECORD, values)
