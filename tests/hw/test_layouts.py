"""Amaranth header layouts agree bit for bit with the proto tables (and so with scapy)."""

import pytest
from amaranth.hdl import Const, Signal
from amaranth.sim import Simulator
from hypothesis import given
from hypothesis import strategies as st

from fpgaccl import proto
from fpgaccl.hw.net.layouts import from_wire, header_layout, to_wire
from tests.conftest import header_values


@pytest.mark.parametrize("header", proto.HEADERS, ids=lambda h: h.name)
@given(data=st.data())
def test_struct_const_equals_big_endian_header(header, data):
    values = data.draw(header_values(header))
    layout = header_layout(header)
    assert layout.size == header.bits
    word = layout.const(values).as_value().value
    assert word == int.from_bytes(header.pack(values), "big")


@pytest.mark.parametrize("header", [proto.IPV4, proto.BTH, proto.RETH], ids=lambda h: h.name)
def test_from_wire_and_to_wire_in_simulation(header):
    """Stream bytes in (byte 0 at bit 0) -> struct fields -> stream bytes out."""
    values = {f.name: (0x5A5A5A5A5A5A5A5A * (i + 1)) & ((1 << f.bits) - 1)
              for i, f in enumerate(header)}
    raw = header.pack(values)
    wire = Signal(header.bits)
    view = from_wire(header, wire)
    back = Signal(header.bits)
    sig_view = Signal(header_layout(header))

    async def bench(ctx):
        ctx.set(wire, int.from_bytes(raw, "little"))
        for f in header:
            assert ctx.get(view[f.name]) == values[f.name], f.name
        ctx.set(sig_view, header_layout(header).const(values))
        assert ctx.get(back).to_bytes(header.size, "little") == raw

    from amaranth.hdl import Module
    m = Module()
    m.d.comb += back.eq(to_wire(sig_view))
    sim = Simulator(m)
    sim.add_testbench(bench)
    sim.run()


def test_layout_field_order_is_reversed_for_msb_first_wire():
    layout = header_layout(proto.IPV4)
    assert layout["dst"].offset == 0
    assert layout["version"].offset == proto.IPV4.bits - 4
    assert isinstance(Const(0, layout.size), Const)
