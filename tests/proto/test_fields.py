"""The field-table codec: packing, unpacking and the typed errors on bad input."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fpgaccl import proto
from fpgaccl.errors import MalformedHeaderError
from tests.conftest import header_values


@pytest.mark.parametrize("header", proto.HEADERS, ids=lambda h: h.name)
def test_sizes_match_the_specs(header):
    expected = {"Ether": 14, "IP": 20, "UDP": 8, "BTH": 12, "RETH": 16, "AETH": 4, "ImmDt": 4}
    assert header.size == expected[header.name]


@pytest.mark.parametrize("header", proto.HEADERS, ids=lambda h: h.name)
@given(data=st.data())
def test_pack_unpack_round_trip(header, data):
    values = data.draw(header_values(header))
    raw = header.pack(values)
    assert len(raw) == header.size
    assert header.unpack(raw, validate=False) == values
    assert int.from_bytes(raw, "big") == header.to_int(values)


def test_bth_bits_sit_where_the_spec_draws_them():
    raw = proto.BTH.pack(opcode=0x0A, solicited=1, padcount=3, pkey=0x1234, becn=1,
                         dqpn=0xABCDEF, ackreq=1, psn=0x123456)
    assert raw.hex() == "0ab012344" "0abcdef" "80123456"


def test_truncated_header_names_the_missing_field():
    raw = proto.RETH.pack(va=1, rkey=2, dlen=3)
    with pytest.raises(MalformedHeaderError) as e:
        proto.RETH.unpack(raw[:10])
    assert (e.value.header, e.value.field) == ("RETH", "rkey")


def test_wrong_ip_version_names_the_field():
    raw = bytearray(proto.IPV4.pack())
    raw[0] = 0x65
    with pytest.raises(MalformedHeaderError) as e:
        proto.IPV4.unpack(bytes(raw))
    assert (e.value.header, e.value.field) == ("IP", "version")


def test_unknown_opcode_names_the_field():
    raw = proto.BTH.pack(opcode=0x64)  # a UD-class opcode the engine never speaks
    with pytest.raises(MalformedHeaderError) as e:
        proto.BTH.unpack(raw)
    assert (e.value.header, e.value.field) == ("BTH", "opcode")
    assert "0x64" in str(e.value)


def test_value_too_wide_names_the_field():
    with pytest.raises(MalformedHeaderError) as e:
        proto.BTH.pack(psn=1 << 24)
    assert e.value.field == "psn"


def test_unknown_field_is_refused():
    with pytest.raises(KeyError):
        proto.UDP.pack(nope=1)
