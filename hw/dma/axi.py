"""AXI4 memory-mapped bus, one ``amaranth.lib.stream`` per channel.

A channel's payload is a struct (``ar__payload`` ...), so benches pack it with the same
layout the gateware uses. Only what the movers need is modelled: INCR bursts of full
bus width (``size`` = log2 of the bus bytes), one ID (responses in request order), a
``user`` field on AR/AW that carries the address space until the split that routes it.
"""

from __future__ import annotations

from amaranth.lib import data, stream, wiring
from amaranth.lib.wiring import In, Out

ADDR_BITS = 64
BURST_INCR = 1


class Resp:
    OKAY = 0
    EXOKAY = 1
    SLVERR = 2
    DECERR = 3


def addr_layout(user_bits: int = 0) -> data.StructLayout:
    return data.StructLayout({
        "addr": ADDR_BITS,
        "len": 8,       # beats - 1
        "size": 3,      # log2(bytes per beat)
        "burst": 2,
        "user": user_bits,
    })


def r_layout(width: int) -> data.StructLayout:
    return data.StructLayout({"data": width, "resp": 2, "last": 1})


def w_layout(width: int) -> data.StructLayout:
    return data.StructLayout({"data": width, "strb": width // 8, "last": 1})


B_LAYOUT = data.StructLayout({"resp": 2})


class AXI4Signature(wiring.Signature):
    """The manager's view: AR/AW/W go out, R/B come in."""

    def __init__(self, width: int, user_bits: int = 0) -> None:
        self.width = width
        self.user_bits = user_bits
        super().__init__({
            "ar": Out(stream.Signature(addr_layout(user_bits))),
            "r": In(stream.Signature(r_layout(width))),
            "aw": Out(stream.Signature(addr_layout(user_bits))),
            "w": Out(stream.Signature(w_layout(width))),
            "b": In(stream.Signature(B_LAYOUT)),
        })


class AXI4ReadSignature(wiring.Signature):
    def __init__(self, width: int, user_bits: int = 0) -> None:
        self.width = width
        super().__init__({
            "ar": Out(stream.Signature(addr_layout(user_bits))),
            "r": In(stream.Signature(r_layout(width))),
        })


class AXI4WriteSignature(wiring.Signature):
    def __init__(self, width: int, user_bits: int = 0) -> None:
        self.width = width
        super().__init__({
            "aw": Out(stream.Signature(addr_layout(user_bits))),
            "w": Out(stream.Signature(w_layout(width))),
            "b": In(stream.Signature(B_LAYOUT)),
        })
