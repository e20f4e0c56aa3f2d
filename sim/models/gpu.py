"""GPU-side models: GPU memory behind its BAR (an AXI memory model), the pinned-page
registration that fills the DMA's page table, and a "GPU kernel" that rings the DMA
doorbell through the peer window and polls a completion flag in its own memory.

The GPU's memory is addressed on its port by bus address (the BAR aperture). Buffers
get contiguous GPU virtual addresses backed by 64 KiB physical pages picked out of
order, as a real allocator leaves them, so a DMA that assumed contiguity would land in
the wrong page and the benches would see it.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from fpgaccl.proto.regmap import GPU_PAGE_BITS

from .host_memory import AxiMemory

GPU_PAGE = 1 << GPU_PAGE_BITS
BAR_BASE = 0x38_0000_0000      # where the GPU's memory appears on the bus
VA_BASE = 0x7F00_0000_0000     # where the model's allocations start (64 KiB aligned)


@dataclass(frozen=True)
class Pte:
    index: int        # page-table slot: (va - VA_BASE) >> 16
    bus: int          # bus address of the pinned page
    read: bool = True
    write: bool = True


class GpuMemory(AxiMemory):
    """GPU memory with ``pages`` physical 64 KiB pages; HBM is fast but the PCIe peer
    path has latency, hence the defaults."""

    def __init__(self, width: int, pages: int = 64, **kw) -> None:
        kw.setdefault("rd_latency", 60)
        kw.setdefault("wr_latency", 30)
        kw.setdefault("name", "gpu")
        super().__init__(width, base=BAR_BASE, size=pages * GPU_PAGE, **kw)
        order = list(range(pages))
        random.Random(self.seed + 99).shuffle(order)
        self.free = order
        self.va_next = VA_BASE
        self.va_map: dict[int, int] = {}     # VA page -> bus page address

    def alloc(self, nbytes: int) -> int:
        """A buffer of ``nbytes`` at a fresh, 64 KiB-aligned GPU VA."""
        va = self.va_next
        npages = -(-nbytes // GPU_PAGE)
        for i in range(npages):
            self.va_map[va + i * GPU_PAGE] = BAR_BASE + self.free.pop(0) * GPU_PAGE
        self.va_next += npages * GPU_PAGE
        return va

    def bus_of(self, va: int) -> int:
        page = va & ~(GPU_PAGE - 1)
        return self.va_map[page] + (va - page)

    def _runs(self, va: int, n: int) -> Iterator[tuple[int, int, int]]:
        pos = 0
        while pos < n:
            k = min(GPU_PAGE - (va + pos) % GPU_PAGE, n - pos)
            yield pos, self.bus_of(va + pos), k
            pos += k

    def write_va(self, va: int, data: bytes) -> None:
        for pos, bus, k in self._runs(va, len(data)):
            self.mem.write(bus, data[pos:pos + k])

    def read_va(self, va: int, n: int) -> bytes:
        return b"".join(self.mem.read(bus, k) for _, bus, k in self._runs(va, n))

    def register(self, va: int, nbytes: int, *, write: bool = True) -> list[Pte]:
        """What GPUDirect-RDMA registration (``nvidia_p2p_get_pages``) yields: one entry
        per pinned page, to install in the DMA's page table."""
        first = va & ~(GPU_PAGE - 1)
        return [Pte((p - VA_BASE) >> GPU_PAGE_BITS, self.va_map[p], True, write)
                for p in range(first, va + nbytes, GPU_PAGE)]


class GpuKernel:
    """A persistent GPU kernel: posts work, rings the doorbell with a store to the
    engine's BAR (``doorbell``: an async callable doing the peer-window write), then
    spins on a 64-bit completion counter in GPU memory. Cycle-driven: the bench calls
    :meth:`poll` every cycle; a real kernel's poll loop reads the flag every
    ``poll_interval`` cycles."""

    def __init__(self, gmem: GpuMemory, flag_va: int, doorbell: Callable,
                 poll_interval: int = 4) -> None:
        self.gmem = gmem
        self.flag_va = flag_va
        self.doorbell = doorbell
        self.poll_interval = poll_interval
        self.seen: list[tuple[int, int]] = []   # (cycle, flag value) at each change
        self.last = self.flag()

    def flag(self) -> int:
        return int.from_bytes(self.gmem.read_va(self.flag_va, 8), "little")

    def poll(self, cycle: int) -> None:
        if cycle % self.poll_interval == 0:
            v = self.flag()
            if v != self.last:
                self.last = v
                self.seen.append((cycle, v))

    def reached(self, value: int) -> int | None:
        """The cycle at which the kernel first saw the flag at ``value`` or more."""
        return next((c for c, v in self.seen if v >= value), None)
