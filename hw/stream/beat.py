"""The beat every packet stream in the engine carries.

Byte ``i`` of a beat is ``data[8*i : 8*i+8]`` and is the ``i``-th byte on the wire
(AXI-Stream order); ``keep[i]`` says whether it is valid. ``first``/``last`` frame a
packet, since :mod:`amaranth.lib.stream` has no framing of its own.
"""

from __future__ import annotations

from amaranth.lib import data, stream

SUPPORTED_WIDTHS = (32, 64, 128, 256, 512)


def beat_layout(width: int) -> data.StructLayout:
    if width not in SUPPORTED_WIDTHS:
        raise ValueError(f"data width {width} not in {SUPPORTED_WIDTHS}")
    return data.StructLayout({
        "data": width,
        "keep": width // 8,
        "first": 1,
        "last": 1,
    })


def beat_stream(width: int) -> stream.Signature:
    return stream.Signature(beat_layout(width))
