"""A byte-addressed memory model with a request/response read port and a write port.

Generic on purpose (the DMA benches reuse it): the memory is sparse (4 KiB pages made on
first touch, reads of untouched bytes give ``fill``); :class:`ReadServer` answers read
requests in order after a fixed latency with beats whose byte 0 is the requested
address; writes are beats with an address and a byte mask. Cycle-driven: the bench calls
``request``/``peek``/``pop`` from its own per-cycle loop, so no extra coroutine runs.
"""

from __future__ import annotations

import random
from collections import deque

PAGE = 4096


class Memory:
    def __init__(self, fill: int = 0) -> None:
        self.pages: dict[int, bytearray] = {}
        self.fill = fill

    def _page(self, n: int) -> bytearray:
        page = self.pages.get(n)
        if page is None:
            page = self.pages[n] = bytearray([self.fill]) * PAGE
        return page

    def write(self, addr: int, data: bytes) -> None:
        pos = 0
        while pos < len(data):
            n, off = divmod(addr + pos, PAGE)
            k = min(PAGE - off, len(data) - pos)
            self._page(n)[off:off + k] = data[pos:pos + k]
            pos += k

    def read(self, addr: int, length: int) -> bytes:
        out = bytearray()
        while len(out) < length:
            n, off = divmod(addr + len(out), PAGE)
            k = min(PAGE - off, length - len(out))
            page = self.pages.get(n)
            out += page[off:off + k] if page is not None else bytes([self.fill]) * k
        return bytes(out)

    def write_beat(self, addr: int, data: int, keep: int, nbytes: int) -> None:
        """Bytes ``i`` of ``data`` with ``keep[i]`` set go to ``addr + i``."""
        raw = data.to_bytes(nbytes, "little")
        if keep & (keep + 1) == 0:  # contiguous low mask: the common case, one copy
            self.write(addr, raw[:keep.bit_length()])
            return
        for i in range(nbytes):
            if keep >> i & 1:
                self.write(addr + i, raw[i:i + 1])


class ReadServer:
    """In-order reads: a request made at cycle ``c`` yields its first beat at
    ``c + latency`` (plus random ``stall_prob`` gaps), one beat per cycle after."""

    def __init__(self, mem: Memory, width: int, *, latency: int = 8, stall_prob: float = 0.0,
                 rng: random.Random | None = None) -> None:
        self.mem = mem
        self.nbytes = width // 8
        self.latency = latency
        self.stall_prob = stall_prob
        self.rng = rng or random.Random(0)
        self.beats: deque[tuple[int, dict[str, int]]] = deque()

    def request(self, addr: int, length: int, cycle: int) -> None:
        # The bytes are read at request time: the requester must not expect to see
        # writes that land after it asked.
        data = self.mem.read(addr, length)
        nb = self.nbytes
        due = cycle + self.latency
        for off in range(0, length, nb):
            chunk = data[off:off + nb]
            self.beats.append((due, {"data": int.from_bytes(chunk, "little"),
                                     "keep": (1 << len(chunk)) - 1, "first": int(off == 0),
                                     "last": int(off + nb >= length)}))

    def peek(self, cycle: int) -> dict[str, int] | None:
        if not self.beats or self.beats[0][0] > cycle:
            return None
        if self.stall_prob and self.rng.random() < self.stall_prob:
            return None
        return self.beats[0][1]

    def pop(self) -> None:
        self.beats.popleft()
