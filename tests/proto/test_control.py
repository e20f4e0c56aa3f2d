"""The control protocol's codec: round trips, the documented byte layout, typed errors
naming the field, and the node's checks as the proto states them."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fpgaccl.errors import MalformedHeaderError
from fpgaccl.proto import control as ctl

u32 = st.integers(0, 2**32 - 1)
u64 = st.integers(0, 2**64 - 1)


@st.composite
def requests(draw):
    op = draw(st.sampled_from(list(ctl.Op)))
    seq, key, addr = draw(u32), draw(u64), draw(u64)
    if op == ctl.Op.CSR_WRITE:
        return ctl.csr_write(seq, key, draw(st.lists(st.tuples(u32, u32), max_size=20)))
    if op == ctl.Op.MEM_WRITE:
        return ctl.mem_write(seq, key, addr, draw(st.binary(max_size=200)))
    if op == ctl.Op.HELLO:
        return ctl.hello(seq, key)
    return ctl.Message(op, seq, key, addr, draw(st.integers(0, 0xFFFF)))


@settings(max_examples=200, deadline=None)
@given(req=requests(), status=st.sampled_from(list(ctl.Status)), data=st.data())
def test_round_trips(req, status, data):
    wire = ctl.encode(req)
    assert ctl.decode(wire) == req
    assert len(wire) == ctl.HEADER_BYTES + ctl.request_body_len(req.op, req.count)
    n = ctl.response_body_len(req.op, min(req.count, 300))
    req = ctl.Message(req.op, req.seq, req.key, req.addr, min(req.count, 300))
    body = data.draw(st.binary(min_size=n, max_size=n))
    resp = ctl.answer(req, status, body)
    assert ctl.decode(ctl.encode(resp)) == resp
    assert resp.key == 0 and resp.response
    assert (ctl.Flags.ERROR in resp.flags) == (status != ctl.Status.OK)


def test_documented_layout():
    wire = ctl.encode(ctl.csr_write(0x01020304, 0x1122334455667788, [(0x18, 0xCAFEF00D)]))
    assert wire.hex() == ("4643" "10" "02" "01020304" "1122334455667788" "0000000000000000"
                          "0001" "0000" "00000018" "cafef00d")
    resp = ctl.encode(ctl.answer(ctl.mem_read(7, 1, 0x100, 2), ctl.Status.OUT_OF_RANGE))
    assert resp[2] == 0x1C and resp[-2:] == b"\x00\x04"  # RESPONSE|ERROR, status 4
    assert ctl.CONTROL_PORT == 4792 and ctl.HEADER_BYTES == 28 and ctl.INFO.size == 32
    assert ctl.MAX_BODY_1500 == 1444


@pytest.mark.parametrize(("wire", "field"), [
    (b"\x46", "magic"),                                          # truncated
    (b"\x46\x44" + ctl.encode(ctl.hello(1, 2))[2:], "magic"),
    (b"\x46\x43\x20" + ctl.encode(ctl.hello(1, 2))[3:], "version"),
    (b"\x46\x43\x11" + ctl.encode(ctl.hello(1, 2))[3:], "flags"),  # reserved bit
    (ctl.encode(ctl.hello(1, 2))[:26] + b"\x00\x09", "status"),
    (ctl.encode(ctl.mem_write(1, 2, 0, b"abc"))[:-1], "count"),   # body short
    (ctl.encode(ctl.csr_read(1, 2, 0)) + b"x", "count"),          # body long
    (ctl.CONTROL.pack(flags=ctl.Flags.RESPONSE, op=ctl.Op.CSR_READ, count=2) + bytes(4),
     "count"),
])
def test_malformed_raises_naming_the_field(wire, field):
    with pytest.raises(MalformedHeaderError) as e:
        ctl.decode(wire)
    assert (e.value.header, e.value.field) == ("Control", field)


def test_encode_refuses_a_body_that_disagrees():
    with pytest.raises(MalformedHeaderError, match="count"):
        ctl.encode(ctl.Message(ctl.Op.MEM_WRITE, 1, 2, 0, 5, body=b"abc"))
    with pytest.raises(MalformedHeaderError, match="seq"):
        ctl.encode(ctl.hello(1 << 32, 0))


def test_unknown_op_decodes_for_bad_op():
    msg = ctl.decode(ctl.encode(ctl.answer(ctl.Message(9, 1, 2, 0, 0), ctl.Status.BAD_OP)))
    assert msg.op == 9 and msg.status == ctl.Status.BAD_OP


def test_checks_and_serial_order():
    chk = dict(body_max=100, mem_log2=16)
    assert ctl.check(ctl.csr_read(1, 2, 0x18, 25), **chk) == ctl.Status.OK
    assert ctl.check(ctl.csr_read(1, 2, 0x18, 26), **chk) == ctl.Status.BAD_LENGTH
    assert ctl.check(ctl.csr_read(1, 2, 0xFFFC, 2), **chk) == ctl.Status.OUT_OF_RANGE
    assert ctl.check(ctl.csr_write(1, 2, [(0x18, 1), (0x1A, 1)]), **chk) == \
        ctl.Status.OUT_OF_RANGE
    assert ctl.check(ctl.mem_write(1, 2, 0xFFFF, b"a"), **chk) == ctl.Status.OK
    assert ctl.check(ctl.mem_write(1, 2, 0xFFFF, b"ab"), **chk) == ctl.Status.OUT_OF_RANGE
    assert ctl.check(ctl.Message(7, 1, 2), **chk) == ctl.Status.BAD_OP
    assert ctl.seq_behind(5, 6) and ctl.seq_behind(0xFFFF_FFFF, 0)
    assert not ctl.seq_behind(0, 0xFFFF_FFFF) and not ctl.seq_behind(6, 6)
    assert ctl.pairs(ctl.csr_write(1, 2, [(4, 5)]).body) == [(4, 5)]
    assert ctl.words(bytes.fromhex("0000000100000002")) == [1, 2]
