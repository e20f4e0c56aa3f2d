"""Python side of the transport benches: header records <-> dicts <-> frames.

The transport's header record (:data:`fpgaccl.hw.transport.HDR`) holds the BTH, RETH,
AETH and ImmDt as big-endian integers (see :mod:`fpgaccl.hw.net.layouts`), so a frame
parsed by :func:`fpgaccl.proto.parse_frame` converts field by field. Until the HDL
parser/builder join the bench, these functions stand in for them.
"""

from __future__ import annotations

from fpgaccl.hw.transport.layouts import HDR
from fpgaccl.proto import AETH, BTH, IMMDT, RETH, build_frame, parse_frame
from fpgaccl.proto.opcodes import Opcode, write_opcode

_EXT = (("reth", RETH), ("aeth", AETH), ("immdt", IMMDT))


def hdr(*, opcode: int, psn: int, dqpn: int, ackreq: int = 0, reth: dict | None = None,
        aeth: dict | None = None, imm: int | None = None, payload_len: int = 0,
        qp: int = 0) -> dict:
    """A header record as a nested dict (the shape ``HDR.const`` takes)."""
    return {
        "bth": {**BTH.defaults(), "opcode": opcode, "psn": psn, "dqpn": dqpn, "ackreq": ackreq},
        "reth": reth or {}, "aeth": aeth or {}, "immdt": {"imm": imm or 0},
        "has_reth": int(reth is not None), "has_aeth": int(aeth is not None),
        "has_immdt": int(imm is not None), "payload_len": payload_len, "qp": qp,
    }


def write_hdr(*, psn: int, dqpn: int, first: bool, last: bool, imm: int | None = None,
              va: int = 0, rkey: int = 0, dlen: int = 0, payload_len: int = 0,
              ackreq: int = 0) -> dict:
    op = write_opcode(first, last, imm is not None)
    return hdr(opcode=op, psn=psn, dqpn=dqpn, ackreq=ackreq or int(last),
               reth={"va": va, "rkey": rkey, "dlen": dlen} if first else None,
               imm=imm if last else None, payload_len=payload_len)


def pack(values: dict) -> int:
    return HDR.const(values).as_value().value


def unpack(word: int) -> dict:
    c = HDR.from_bits(word)
    out = {}
    for name, fld in HDR:
        v = c[name]
        out[name] = {n: int(v[n]) for n, _ in fld.shape} if hasattr(v, "shape") else int(v)
    return out


def to_frame(h: dict, payload: bytes = b"", *, src_ip: int = 0x0A000001,
             dst_ip: int = 0x0A000002, sport: int | None = None) -> bytes:
    """The frame the builder makes of a transmit header record and its payload."""
    kw = {}
    for name, header in _EXT:
        if h[f"has_{name}"]:
            kw[name] = {f.name: h[name][f.name] for f in header}
    assert len(payload) == h["payload_len"], (len(payload), h["payload_len"])
    bth = {f.name: h["bth"][f.name] for f in BTH}
    udp = {} if sport is None else {"sport": sport}
    return build_frame(ip={"src": src_ip, "dst": dst_ip}, udp=udp, bth=bth, payload=payload,
                       **kw)


def from_frame(frame: bytes) -> tuple[dict, bytes]:
    """What the parser hands the transport for a frame (raises proto.Dropped)."""
    f = parse_frame(frame)
    h = hdr(opcode=f.bth["opcode"], psn=f.bth["psn"], dqpn=f.bth["dqpn"],
            ackreq=f.bth["ackreq"], reth=f.reth, aeth=f.aeth,
            imm=None if f.immdt is None else f.immdt["imm"], payload_len=len(f.payload))
    h["bth"] = dict(f.bth)
    h["src_ip"] = f.ip["src"]
    return h, f.payload


def describe(h: dict) -> str:
    op = h["bth"]["opcode"]
    name = Opcode(op).name if op in Opcode._value2member_map_ else hex(op)
    s = f"{name} psn={h['bth']['psn']:#x} dqpn={h['bth']['dqpn']:#x}"
    if h["has_aeth"]:
        s += f" syn={h['aeth']['syndrome']:#x} msn={h['aeth']['msn']}"
    return s + f" len={h['payload_len']}"
