"""Wire-level models for the hw/eth tests: what a correct MAC puts on GMII, written
from the standard (zlib computes the FCS), and drivers/monitors for the simulator."""

from __future__ import annotations

import zlib

from fpgaccl.hw.stream.beat import beat_layout
from fpgaccl.sim.models.stream import beats_to_frame, frame_to_beats, pack, unpack

PREAMBLE = b"\x55" * 7 + b"\xd5"


def fcs(frame: bytes) -> bytes:
    return zlib.crc32(frame).to_bytes(4, "little")


def on_wire(frame: bytes) -> bytes:
    """Preamble, SFD, the frame padded to 60 bytes, its FCS."""
    padded = frame + bytes(max(0, 60 - len(frame)))
    return PREAMBLE + padded + fcs(padded)


def symbols(bursts: list[bytes | tuple[bytes, int]], gap: int = 12) -> list[tuple[int, int, int]]:
    """(rxd, rx_dv, rx_er) per cycle; a burst given as (bytes, k) has rx_er at byte k."""
    out = [(0, 0, 0)] * 3
    for b in bursts:
        raw, er_at = (b, -1) if isinstance(b, bytes) else b
        out += [(x, 1, int(i == er_at)) for i, x in enumerate(raw)]
        out += [(0, 0, 0)] * gap
    return out


def split_bursts(samples: list[tuple[int, int, int]]):
    """(bursts, gaps, errors) from per-cycle (txd, tx_en, tx_er): gaps are the idle
    runs between bursts."""
    bursts, gaps, errors = [], [], 0
    cur, idle = bytearray(), None
    for d, en, er in samples:
        errors += er
        if en:
            if not cur and idle is not None:
                gaps.append(idle)
            cur.append(d)
            idle = None
        else:
            if cur:
                bursts.append(bytes(cur))
                cur = bytearray()
                idle = 0
            if idle is not None:
                idle += 1
    assert not cur, "capture ended inside a frame"
    return bursts, gaps, errors


async def send_frames(ctx, port, frames: list[bytes], width: int) -> None:
    layout = beat_layout(width)
    for f in frames:
        for b in frame_to_beats(f, width):
            ctx.set(port.payload.as_value(), pack(layout, b))
            ctx.set(port.valid, 1)
            while True:
                # Sampled at the edge: a sink's ready may follow a testbench's write.
                _, _, ready = await ctx.tick().sample(port.ready)
                if ready:
                    break
    ctx.set(port.valid, 0)


async def collect_frames(ctx, port, width: int, out: list[bytes], cycles: int,
                         stall=None) -> None:
    """Take frames for ``cycles`` cycles; ``stall`` (a random.Random) drops ready."""
    layout = beat_layout(width)
    cur = []
    for _ in range(cycles):
        ready = 1 if stall is None else int(stall.random() < 0.5)
        ctx.set(port.ready, ready)
        _, _, valid, word = await ctx.tick().sample(port.valid, port.payload.as_value())
        if valid and ready:
            b = unpack(layout, word)
            assert b["first"] == (not cur), "first must mark exactly a frame's first beat"
            cur.append(b)
            if b["last"]:
                out.append(beats_to_frame(cur, width))
                cur = []
