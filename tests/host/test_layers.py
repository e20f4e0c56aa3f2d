"""scapy layers: proto's tables match scapy's own BTH/AETH, our generated RETH/ImmDt
round-trip, ICRCs equal scapy's, and the strict dissector names malformed fields."""

import pytest
from hypothesis import given
from hypothesis import strategies as st
from scapy.compat import raw
from scapy.contrib.roce import AETH, BTH
from scapy.fields import BitField, FCSField
from scapy.layers.inet import IP, UDP
from scapy.layers.l2 import Ether
from scapy.packet import Raw

from fpgaccl import proto
from fpgaccl.errors import IcrcError, MalformedHeaderError
from fpgaccl.host.layers import RETH, ImmDt, dissect
from fpgaccl.proto import Opcode
from tests.conftest import header_values


def _scapy_widths(cls):
    """(name, bits, default) of a scapy layer, ICRC trailer excluded."""
    out = []
    for f in cls.fields_desc:
        if isinstance(f, FCSField):
            continue
        bits = f.size if isinstance(f, BitField) else f.sz * 8
        out.append((f.name, bits, f.default))
    return out


@pytest.mark.parametrize("table,cls", [(proto.BTH, BTH), (proto.AETH, AETH),
                                       (proto.RETH, RETH), (proto.IMMDT, ImmDt)],
                         ids=["BTH", "AETH", "RETH", "ImmDt"])
def test_proto_table_matches_scapy_layer_field_for_field(table, cls):
    assert [(f.name, f.bits, f.default) for f in table] == _scapy_widths(cls)


@pytest.mark.parametrize("table,cls", [(proto.BTH, BTH), (proto.AETH, AETH),
                                       (proto.RETH, RETH), (proto.IMMDT, ImmDt),
                                       (proto.UDP, UDP)],
                         ids=["BTH", "AETH", "RETH", "ImmDt", "UDP"])
@given(data=st.data())
def test_scapy_bytes_equal_proto_bytes(table, cls, data):
    values = data.draw(header_values(table))
    pkt = cls(**values)
    if cls is BTH:
        pkt.icrc = 0  # the trailer is not part of the 12-byte header
    assert raw(pkt)[: table.size] == table.pack(values)
    back = cls(table.pack(values) + (b"\0" * 4 if cls is BTH else b""))
    assert {f.name: back.getfieldval(f.name) for f in table} == values


@given(op=st.sampled_from(sorted(Opcode)), psn=st.integers(0, (1 << 24) - 1),
       dqpn=st.integers(0, (1 << 24) - 1), payload=st.binary(max_size=64).map(
           lambda b: b + bytes(-len(b) % 4)),
       ttl=st.integers(1, 255), tos=st.integers(0, 255), ipid=st.integers(0, 0xFFFF))
def test_our_icrc_equals_scapys(op, psn, dqpn, payload, ttl, tos, ipid):
    ext = {h.name.lower(): h.defaults() for h in proto.extension_headers(op)}
    ours = proto.build_frame(
        ip={"src": 0x0A000001, "dst": 0x0A000002, "ttl": ttl, "tos": tos, "id": ipid},
        udp={"sport": 0xC123}, bth={"opcode": op, "psn": psn, "dqpn": dqpn},
        payload=payload, **ext)
    layers = BTH(opcode=op, psn=psn, dqpn=dqpn)
    for name, hdr in (("reth", RETH), ("aeth", AETH), ("immdt", ImmDt)):
        if name in ext:
            layers = layers / hdr()
    theirs = raw(Ether(dst="ff:ff:ff:ff:ff:ff", src="00:00:00:00:00:00")
                 / IP(src="10.0.0.1", dst="10.0.0.2", ttl=ttl, tos=tos, id=ipid, flags="DF")
                 / UDP(sport=0xC123, dport=4791, chksum=0) / layers / Raw(payload))
    assert ours == theirs


def test_dissect_builds_the_expected_layer_stack():
    frame = proto.build_frame(bth={"opcode": Opcode.RDMA_WRITE_ONLY_WITH_IMMEDIATE, "psn": 9},
                              reth={"va": 0x1000, "rkey": 0x42, "dlen": 8},
                              immdt={"imm": 0x00010002}, payload=b"12345678")
    pkt = dissect(frame)
    assert pkt[BTH].psn == 9 and pkt[RETH].rkey == 0x42 and pkt[ImmDt].imm == 0x00010002
    assert pkt[Raw].load == b"12345678"


def _frame():
    return bytearray(proto.build_frame(
        bth={"opcode": Opcode.RDMA_WRITE_FIRST, "psn": 1},
        reth={"va": 0, "rkey": 1, "dlen": 4096}, payload=bytes(256)))


@pytest.mark.parametrize("mutate,header,field", [
    (lambda f: f.__setitem__(14, 0x65), "IP", "version"),
    (lambda f: f.__setitem__(14, 0x46), "IP", "ihl"),
    (lambda f: f.__setitem__(42, 0x64), "BTH", "opcode"),
    (lambda f: f.__setitem__(43, 0x05), "BTH", "version"),
])
def test_dissect_names_the_malformed_field(mutate, header, field):
    frame = _frame()
    mutate(frame)
    with pytest.raises(MalformedHeaderError) as e:
        dissect(bytes(frame), check_icrc=False)
    assert (e.value.header, e.value.field) == (header, field)


def test_dissect_names_a_cut_frame():
    with pytest.raises(MalformedHeaderError) as e:
        dissect(bytes(_frame()[:64]), check_icrc=False)
    assert (e.value.header, e.value.field) == ("IP", "len")


def test_dissect_names_the_truncated_extension_field():
    # Lengths are consistent, but the RETH that RDMA_WRITE_FIRST needs is 6 bytes short.
    frame = raw(Ether() / IP() / UDP(sport=1, dport=4791) / BTH(opcode=Opcode.RDMA_WRITE_FIRST)
                / Raw(bytes(10)))
    with pytest.raises(MalformedHeaderError) as e:
        dissect(frame, check_icrc=False)
    assert (e.value.header, e.value.field) == ("RETH", "rkey")


def test_dissect_rejects_a_bad_icrc():
    frame = _frame()
    frame[-1] ^= 0xFF
    with pytest.raises(IcrcError):
        dissect(bytes(frame))
