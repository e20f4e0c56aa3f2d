"""Frame headers as registers: capture a frame's first bytes from its beats as they
pass, and put a register's bytes over them on the way out."""

from __future__ import annotations

from amaranth.hdl import Cat, Module, Mux, Signal, Value


def header_beats(size: int, nbytes: int) -> int:
    return -(-size // nbytes)


def capture(m: Module, hdr: Signal, take: Value, data: Value, idx: Value) -> None:
    """On ``take`` of the frame's beat ``idx``, copy its bytes below ``len(hdr) // 8``
    into ``hdr`` (wire byte 0 at bit 0)."""
    for k in range(header_beats(len(hdr), len(data))):
        lo = k * len(data)
        n = min(len(data), len(hdr) - lo)
        with m.If(take & (idx == k)):
            m.d.sync += hdr[lo:lo + n].eq(data[:n])


def overlay(data: Value, hdr: Value, idx: Value) -> Value:
    """``data``, the frame's beat ``idx``, with its bytes below ``len(hdr) // 8``
    replaced by ``hdr``'s."""
    out = data
    for k in range(header_beats(len(hdr), len(data))):
        lo = k * len(data)
        n = min(len(data), len(hdr) - lo)
        out = Mux(idx == k, Cat(hdr[lo:lo + n], data[n:]), out)
    return out


def admit(m: Module, take: Value, last: Value, free: Value) -> tuple[Signal, Signal]:
    """Frame-level admission for a unit that never back-pressures: a frame whose first
    beat finds ``free`` is taken whole (``mine`` on each of its beats), any other is
    ignored whole (``refused`` on its last beat)."""
    mid = Signal()       # inside a frame
    taking = Signal()    # the current frame is admitted
    mine = Signal()
    refused = Signal()
    with m.If(take):
        m.d.sync += mid.eq(~last)
        with m.If(~mid):
            m.d.sync += taking.eq(free)
    m.d.comb += [mine.eq(take & Mux(mid, taking, free)),
                 refused.eq(take & last & ~Mux(mid, taking, free))]
    return mine, refused
