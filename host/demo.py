"""The protocol demo: one segmented RDMA WRITE with immediate, its ACK and a NAK, built
from the proto tables, written to a pcap and judged by tshark and scapy."""

from __future__ import annotations

from pathlib import Path

from scapy.contrib.roce import BTH
from scapy.layers.l2 import Ether
from scapy.utils import wrpcap

from fpgaccl import proto
from fpgaccl.proto.opcodes import (
    ACK_CREDIT_INVALID,
    AethKind,
    NakCode,
    Opcode,
    aeth_syndrome,
    psn_add,
    write_opcode,
)

from .tshark import decode

MTU = 1024
_A = {"eth": {"src": 0x02_00_00_00_00_01, "dst": 0x02_00_00_00_00_02},
      "ip": {"src": 0x0A000001, "dst": 0x0A000002}, "udp": {"sport": 0xC001}}
_B = {"eth": {"src": 0x02_00_00_00_00_02, "dst": 0x02_00_00_00_00_01},
      "ip": {"src": 0x0A000002, "dst": 0x0A000001}, "udp": {"sport": 0xC002}}


def demo_frames(message: bytes, *, qpn: int = 0x11, psn: int = 0xFFFFFE) -> list[bytes]:
    """A WRITE of ``message`` segmented at :data:`MTU` (PSNs wrap past 2^24), then the
    responder's coalesced ACK and a NAK-sequence-error."""
    frames = []
    segs = [message[i:i + MTU] for i in range(0, len(message), MTU)]
    imm = proto.COLLECTIVE_IMM.to_int(coll_id=1, step=0)
    for i, seg in enumerate(segs):
        op = write_opcode(i == 0, i == len(segs) - 1, immediate=True)
        ext = {}
        if op in proto.opcodes.RETH_OPCODES:
            ext["reth"] = {"va": 0x7F00_0000_0000, "rkey": 0x1234, "dlen": len(message)}
        if op in proto.opcodes.IMMDT_OPCODES:
            ext["immdt"] = {"imm": imm}
        frames.append(proto.build_frame(
            **_A, bth={"opcode": op, "dqpn": qpn, "psn": psn_add(psn, i),
                       "ackreq": int(i == len(segs) - 1)}, payload=seg, **ext))
    last = psn_add(psn, len(segs) - 1)
    frames.append(proto.build_frame(
        **_B, bth={"opcode": Opcode.ACKNOWLEDGE, "dqpn": qpn + 1, "psn": last},
        aeth={"syndrome": aeth_syndrome(AethKind.ACK, ACK_CREDIT_INVALID), "msn": 1}))
    frames.append(proto.build_frame(
        **_B, bth={"opcode": Opcode.ACKNOWLEDGE, "dqpn": qpn + 1, "psn": psn_add(last, 1)},
        aeth={"syndrome": aeth_syndrome(AethKind.NAK, NakCode.PSN_SEQUENCE_ERROR), "msn": 1}))
    return frames


def run_demo(pcap: str | Path) -> int:
    pcap = Path(pcap)
    pcap.parent.mkdir(parents=True, exist_ok=True)
    frames = demo_frames(bytes(range(256)) * 14)
    wrpcap(str(pcap), [Ether(f) for f in frames])
    rows = decode(pcap)
    print(f"wrote {len(frames)} frames to {pcap}; tshark decodes:")
    print(f"{'#':>3} {'opcode':<32} {'dqpn':>8} {'psn':>9} {'icrc':>10}  scapy-icrc  verdict")
    bad = 0
    for frame, row in zip(frames, rows, strict=True):
        # scapy recomputes the ICRC from scratch: an independent check of ours.
        pkt = Ether(frame)
        want = pkt[BTH].compute_icrc(None)
        scapy_ok = want == frame[-4:]
        ok = row.is_rocev2 and not row.malformed and not row.expert and scapy_ok
        bad += not ok
        name = Opcode(row.opcode).name if row.opcode in proto.opcodes.SUPPORTED_OPCODES else "?"
        print(f"{row.number:>3} {name:<32} {row.dqpn:#08x} {row.psn:>9} {row.icrc:#010x}  "
              f"{'match' if scapy_ok else 'MISMATCH':<10}  {'ok' if ok else 'BAD'}")
    print("all frames valid RoCEv2" if not bad else f"{bad} invalid frame(s)")
    return 1 if bad else 0
