"""The reference frame builder/parser: the software twin of the HDL net path."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fpgaccl import proto
from fpgaccl.proto import Dropped, DropReason, Opcode
from fpgaccl.proto.checksum import ipv4_checksum
from fpgaccl.proto.opcodes import psn_add, psn_diff, write_opcode

ADDR = {"eth": {"dst": 0x02_00_00_00_00_02, "src": 0x02_00_00_00_00_01},
        "ip": {"src": 0x7F000001, "dst": 0x7F000002}}


def write(payload=b"\x11" * 64, **bth):
    return proto.build_frame(**ADDR, bth={"opcode": Opcode.RDMA_WRITE_ONLY, "dqpn": 0x11,
                                          "psn": 7, **bth},
                             reth={"va": 0x1000, "rkey": 0xBEEF, "dlen": len(payload)},
                             payload=payload)


@given(payload=st.binary(min_size=0, max_size=300), psn=st.integers(0, (1 << 24) - 1),
       op=st.sampled_from(sorted(Opcode)))
def test_build_parse_round_trip(payload, psn, op):
    ext = {h.name.lower(): h.defaults() for h in proto.extension_headers(op)}
    frame = proto.build_frame(**ADDR, bth={"opcode": op, "psn": psn}, payload=payload, **ext)
    got = proto.parse_frame(frame)
    assert got.bth["psn"] == psn and got.bth["opcode"] == op
    assert got.payload == payload
    assert proto.check_icrc(frame[proto.ETH.size:])
    assert ipv4_checksum(frame[14:34]) == 0


def test_ethernet_padding_is_ignored():
    frame = write(payload=b"")
    assert proto.parse_frame(frame + bytes(20)).payload == b""


def _mutate(frame, offset, value):
    f = bytearray(frame)
    f[offset] = value
    return bytes(f)


@pytest.mark.parametrize("mutate,reason", [
    (lambda f: f[:40], DropReason.TRUNCATED),
    (lambda f: _mutate(f, 12, 0x86), DropReason.BAD_ETHERTYPE),
    (lambda f: _mutate(f, 14, 0x65), DropReason.IPV4_VERSION),
    (lambda f: _mutate(f, 14, 0x46), DropReason.IPV4_OPTIONS),
    (lambda f: _mutate(f, 20, 0x20), DropReason.IPV4_FRAGMENT),
    (lambda f: _mutate(f, 30, f[30] ^ 1), DropReason.IPV4_CHECKSUM),
    (lambda f: _mutate(f, 37, 0xB8), DropReason.UDP_PORT),
    (lambda f: _mutate(f, 60, f[60] ^ 0x80), DropReason.BAD_ICRC),
])
def test_every_drop_reason(mutate, reason):
    with pytest.raises(Dropped) as e:
        proto.parse_frame(mutate(write()))
    assert e.value.reason == reason


def test_unknown_opcode_is_dropped_before_icrc():
    frame = _mutate(write(), 42, 0x64)
    with pytest.raises(Dropped) as e:
        proto.parse_frame(frame)
    assert e.value.reason == DropReason.UNKNOWN_OPCODE


def test_variant_fields_do_not_change_the_icrc():
    """Routers rewrite TTL, ECN and the IP checksum; the ICRC must survive that."""
    frame = bytearray(write())
    frame[14 + 1] = 0x03  # ECN = CE
    frame[14 + 8] = 1  # TTL
    frame[14 + 10:14 + 12] = bytes(2)
    frame[14 + 10:14 + 12] = ipv4_checksum(bytes(frame[14:34])).to_bytes(2, "big")
    assert proto.check_icrc(bytes(frame[14:]))
    frame[14 + 20 + 6] ^= 0xFF  # UDP checksum is variant too
    assert proto.check_icrc(bytes(frame[14:]))
    frame[14 + 20 + 8 + 5] ^= 1  # but the QPN is not
    assert not proto.check_icrc(bytes(frame[14:]))


def test_psn_arithmetic_wraps_at_24_bits():
    assert psn_add((1 << 24) - 1, 2) == 1
    assert psn_diff(1, (1 << 24) - 1) == 2
    assert psn_diff((1 << 24) - 1, 1) == -2


def test_write_opcodes():
    assert write_opcode(True, True, True) == Opcode.RDMA_WRITE_ONLY_WITH_IMMEDIATE
    assert write_opcode(True, False, True) == Opcode.RDMA_WRITE_FIRST
    assert write_opcode(False, False, False) == Opcode.RDMA_WRITE_MIDDLE
    assert write_opcode(False, True, False) == Opcode.RDMA_WRITE_LAST
