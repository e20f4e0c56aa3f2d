"""cocotb models of an ``amaranth.lib.stream`` port carrying packet beats.

Amaranth flattens a stream ``x`` into ``x__payload`` (the packed struct), ``x__valid``
and ``x__ready``; the helpers here pack and unpack the struct by the layout's own field
offsets, so benches never hard-code bit positions.
"""

from __future__ import annotations

import random
from collections.abc import Iterable

from amaranth.hdl import Shape
from amaranth.lib import data
from cocotb.triggers import RisingEdge

from fpgaccl.hw.stream.beat import beat_layout


def pack(layout: data.StructLayout, values: dict[str, int]) -> int:
    word = 0
    for name, fld in layout:
        width = Shape.cast(fld.shape).width
        word |= (int(values.get(name, 0)) & ((1 << width) - 1)) << fld.offset
    return word


def unpack(layout: data.StructLayout, word: int) -> dict[str, int]:
    return {name: (word >> fld.offset) & ((1 << Shape.cast(fld.shape).width) - 1)
            for name, fld in layout}


def frame_to_beats(frame: bytes, width: int) -> list[dict[str, int]]:
    """Split a frame into beats: wire byte 0 in the low byte of the first beat."""
    nbytes = width // 8
    if not frame:
        raise ValueError("empty frame")
    beats = []
    for off in range(0, len(frame), nbytes):
        chunk = frame[off:off + nbytes]
        beats.append({
            "data": int.from_bytes(chunk, "little"),
            "keep": (1 << len(chunk)) - 1,
            "first": int(off == 0),
            "last": int(off + nbytes >= len(frame)),
        })
    return beats


def beats_to_frame(beats: Iterable[dict[str, int]], width: int) -> bytes:
    out = bytearray()
    nbytes = width // 8
    for b in beats:
        raw = b["data"].to_bytes(nbytes, "little")
        keep = b["keep"]
        if keep & (keep + 1):
            raise AssertionError(f"keep {keep:#x} is not a contiguous low-byte mask")
        out += raw[:keep.bit_length()]
    return bytes(out)


class _StreamPort:
    """The three flattened signals of stream ``prefix`` and how to pack its beats."""

    def __init__(self, dut, prefix: str, clk, width: int, rng: random.Random) -> None:
        self.payload = getattr(dut, f"{prefix}__payload")
        self.valid = getattr(dut, f"{prefix}__valid")
        self.ready = getattr(dut, f"{prefix}__ready")
        self.clk = clk
        self.layout = beat_layout(width)
        self.width = width
        self.rng = rng


class StreamSource(_StreamPort):
    """Drives beats into a DUT stream sink, idling at random with ``idle_prob``."""

    def __init__(self, dut, prefix: str, clk, width: int, *, idle_prob: float = 0.0,
                 rng: random.Random | None = None) -> None:
        super().__init__(dut, prefix, clk, width, rng or random.Random(0))
        self.idle_prob = idle_prob
        self.valid.value = 0

    async def send_beats(self, beats: Iterable[dict[str, int]]) -> None:
        for beat in beats:
            while self.idle_prob and self.rng.random() < self.idle_prob:
                self.valid.value = 0
                await RisingEdge(self.clk)
            self.payload.value = pack(self.layout, beat)
            self.valid.value = 1
            while True:
                await RisingEdge(self.clk)
                if self.ready.value:
                    break
        self.valid.value = 0

    async def send(self, frame: bytes) -> None:
        await self.send_beats(frame_to_beats(frame, self.width))


class StreamSink(_StreamPort):
    """Accepts beats from a DUT stream source, stalling at random with ``stall_prob``."""

    def __init__(self, dut, prefix: str, clk, width: int, *, stall_prob: float = 0.0,
                 rng: random.Random | None = None) -> None:
        super().__init__(dut, prefix, clk, width, rng or random.Random(1))
        self.stall_prob = stall_prob
        self.ready.value = 0

    async def recv_beat(self) -> dict[str, int]:
        # Values read right after an edge are those the flops saw at that edge, so a
        # beat is taken when valid and ready were both high there.
        while True:
            self.ready.value = int(not (self.stall_prob and self.rng.random() < self.stall_prob))
            await RisingEdge(self.clk)
            if self.ready.value and self.valid.value:
                return unpack(self.layout, int(self.payload.value))

    async def recv(self) -> bytes:
        beats = []
        while True:
            beat = await self.recv_beat()
            beats.append(beat)
            if beat["last"]:
                break
        self.ready.value = 0
        return beats_to_frame(beats, self.width)
