"""``amaranth.lib.data`` layouts generated from the proto header tables.

The one place where wire order meets Amaranth's bit order. ``StructLayout`` puts its
first field at bit 0, while network headers send their most significant bit first. We
therefore list a header's fields in *reverse* so that the layout's value equals the
header read as one big-endian integer (``int.from_bytes(raw, "big")``): the host packs
it with :meth:`fpgaccl.proto.Header.to_int`, and :func:`from_wire`/:func:`to_wire`
byte-swap between that value and the stream's byte order (byte 0 at bit 0).
"""

from __future__ import annotations

from functools import cache

from amaranth.hdl import Cat, Value
from amaranth.lib import data

from fpgaccl.proto import Header


@cache
def header_layout(header: Header) -> data.StructLayout:
    return data.StructLayout({f.name: f.bits for f in reversed(header.fields)})


def byte_swap(value: Value) -> Value:
    """Reverse the byte order of a whole number of bytes."""
    n = len(value)
    assert n % 8 == 0, n
    return Cat(*(value[i:i + 8] for i in reversed(range(0, n, 8))))


def from_wire(header: Header, wire: Value) -> data.View:
    """View ``header.size`` stream bytes (byte 0 at bit 0) as the header's struct."""
    return data.View(header_layout(header), byte_swap(wire[: header.bits]))


def to_wire(view: Value) -> Value:
    """Stream bytes (byte 0 at bit 0) of a header struct value."""
    return byte_swap(Value.cast(view))
