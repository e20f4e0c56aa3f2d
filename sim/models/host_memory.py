"""An AXI4 subordinate memory model with latency and bandwidth, and the host memory.

The model is simulator-neutral: each cycle the glue (cocotb or Amaranth's simulator)
drives :meth:`AxiMemory.outputs`, samples the DUT's side of every channel and calls
:meth:`AxiMemory.commit` with what was handshaken at the clock edge. All work happens
per handshake (a burst is read from the sparse :class:`~fpgaccl.sim.models.memory.Memory`
when its AR arrives), so the per-cycle cost is a few comparisons.

Timing: a read burst's first beat is due ``rd_latency`` cycles after its AR; a write's B
is due ``wr_latency`` cycles after its last W. R and W each move at most
``bandwidth`` beats per cycle on average (a token bucket), and ``stall`` adds random
not-ready/not-valid cycles on every channel (back-pressure the DUT must survive).
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field

from .memory import Memory

OKAY, SLVERR, DECERR = 0, 2, 3


@dataclass
class Access:
    kind: str      # "r" or "w"
    addr: int      # first byte (bus-aligned burst address for reads)
    length: int    # bytes touched (writes: strobed bytes only)
    cycle: int


@dataclass
class _Burst:
    addr: int
    beats: int
    done: int = 0


@dataclass
class AxiMemory:
    width: int
    mem: Memory = field(default_factory=Memory)
    base: int = 0                 # bus address of mem offset ``base`` (mem is by bus addr)
    size: int = 1 << 40           # answers SLVERR outside [base, base + size)
    rd_latency: int = 20
    wr_latency: int = 20
    bandwidth: float = 1.0        # beats per cycle, R and W each
    stall: float = 0.0
    max_reads: int = 64           # AR requests the model queues before refusing more
    seed: int = 0
    name: str = "mem"

    def __post_init__(self) -> None:
        self.nb = self.width // 8
        self.rng = random.Random(self.seed)
        # (due, data, resp, last, addr)
        self.r_q: deque[tuple[int, int, int, int, int]] = deque()
        self.reads = 0                 # ARs not yet fully answered
        self.aw_q: deque[_Burst] = deque()
        self.aw_resp: deque[int] = deque()
        self.b_q: deque[tuple[int, int]] = deque()             # (due, resp)
        self.r_tokens = self.w_tokens = 1.0
        self.r_valid = self.b_valid = False
        self.log: list[Access] = []
        self.cycle = 0
        self.counts = {"ar": 0, "r": 0, "aw": 0, "w": 0, "b": 0}
        self.first_ar_cycle: int | None = None
        self.trace: dict[str, list[tuple[int, int]]] = {"r": [], "w": []}  # (cycle, addr)
        self.tracing = False

    def _ok(self, addr: int, length: int) -> bool:
        return self.base <= addr and addr + length <= self.base + self.size

    def _stall(self) -> bool:
        return bool(self.stall) and self.rng.random() < self.stall

    # -- per cycle ---------------------------------------------------------------
    def outputs(self) -> dict[str, object]:
        """What the subordinate drives until the next edge."""
        c = self.cycle
        if not self.r_valid and self.r_q and self.r_q[0][0] <= c and self.r_tokens >= 1 \
                and not self._stall():
            self.r_valid = True
        if not self.b_valid and self.b_q and self.b_q[0][0] <= c and not self._stall():
            self.b_valid = True
        r = self.r_q[0] if self.r_valid else None
        return {
            "ar_ready": self.reads < self.max_reads and not self._stall(),
            "r_valid": self.r_valid,
            "r": {"data": r[1], "resp": r[2], "last": r[3]} if r else None,
            "aw_ready": not self._stall(),
            "w_ready": bool(self.aw_q) and self.w_tokens >= 1 and not self._stall(),
            "b_valid": self.b_valid,
            "b": {"resp": self.b_q[0][1]} if self.b_valid else None,
        }

    def commit(self, *, ar=None, r: bool = False, aw=None, w=None, b: bool = False) -> None:
        """Record the edge's handshakes (payload dicts, or True for R/B), then advance."""
        c = self.cycle
        nb = self.nb
        if r:
            beat = self.r_q.popleft()
            if beat[3]:
                self.reads -= 1
            self.r_valid = False
            self.r_tokens -= 1
            self.counts["r"] += 1
            if self.tracing:
                self.trace["r"].append((c, beat[4]))
        if b:
            self.b_q.popleft()
            self.b_valid = False
            self.counts["b"] += 1
        if ar is not None:
            self.counts["ar"] += 1
            if self.first_ar_cycle is None:
                self.first_ar_cycle = c
            beats = ar["len"] + 1
            addr = ar["addr"] & ~(nb - 1)
            ok = self._ok(addr, beats * nb)
            raw = self.mem.read(addr, beats * nb) if ok else bytes(beats * nb)
            self.log.append(Access("r", addr, beats * nb, c))
            self.reads += 1
            due = c + self.rd_latency
            for i in range(beats):
                self.r_q.append((due, int.from_bytes(raw[i * nb:(i + 1) * nb], "little"),
                                 OKAY if ok else SLVERR, int(i == beats - 1), addr + i * nb))
        if aw is not None:
            self.counts["aw"] += 1
            addr = aw["addr"] & ~(nb - 1)
            beats = aw["len"] + 1
            self.aw_q.append(_Burst(addr, beats))
            self.aw_resp.append(OKAY if self._ok(addr, beats * nb) else SLVERR)
        if w is not None:
            self.counts["w"] += 1
            self.w_tokens -= 1
            burst = self.aw_q[0]
            addr = burst.addr + burst.done * nb
            if self.tracing:
                self.trace["w"].append((c, addr))
            strb = w["strb"]
            if strb and self.aw_resp[0] == OKAY:
                self.mem.write_beat(addr, w["data"], strb, nb)
                lo = (strb & -strb).bit_length() - 1
                self.log.append(Access("w", addr + lo, strb.bit_length() - lo, c))
            burst.done += 1
            if burst.done == burst.beats:
                self.aw_q.popleft()
                self.b_q.append((c + self.wr_latency, self.aw_resp.popleft()))
        self.r_tokens = min(self.r_tokens + self.bandwidth, 1.0 + self.bandwidth)
        self.w_tokens = min(self.w_tokens + self.bandwidth, 1.0 + self.bandwidth)
        self.cycle += 1

    def reset_stats(self, tracing: bool = False) -> None:
        self.counts = dict.fromkeys(self.counts, 0)
        self.first_ar_cycle = None
        self.tracing = tracing
        self.trace = {"r": [], "w": []}

    def beat_span(self, ch: str, lo: int, hi: int) -> tuple[int, int, int]:
        """(beats, first cycle, last cycle) of traced ``ch`` beats in [lo, hi)."""
        cycles = [c for c, a in self.trace[ch] if lo <= a < hi]
        return len(cycles), cycles[0], cycles[-1]

    def idle(self) -> bool:
        return not (self.r_q or self.aw_q or self.b_q)

    def writes(self) -> list[Access]:
        return [a for a in self.log if a.kind == "w"]


class HostMemory(AxiMemory):
    """Host DRAM behind PCIe: a few hundred ns of read latency, posted writes."""

    def __init__(self, width: int, **kw) -> None:
        kw.setdefault("rd_latency", 100)
        kw.setdefault("wr_latency", 40)
        kw.setdefault("name", "host")
        super().__init__(width, **kw)

    def alloc_guarded(self, addr: int, data: bytes, guard: int = 64,
                      guard_byte: int = 0xA5) -> None:
        """Place ``data`` at ``addr`` with guard bytes either side (as Corundum's benches
        do): a write that strays past the buffer shows up as a changed guard byte."""
        self.mem.write(addr - guard, bytes([guard_byte]) * guard)
        self.mem.write(addr, data)
        self.mem.write(addr + len(data), bytes([guard_byte]) * guard)

    def guards_intact(self, addr: int, length: int, guard: int = 64,
                      guard_byte: int = 0xA5) -> bool:
        g = bytes([guard_byte]) * guard
        return (self.mem.read(addr - guard, guard) == g
                and self.mem.read(addr + length, guard) == g)
