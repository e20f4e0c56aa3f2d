"""The engine's queue driver: what the host runtime does to a DMA-capable node through
its register window and its DMA memory, and nothing else.

* :class:`Device` is the boundary: a BAR for registers plus DMA-able pinned host memory
  and, for GPU buffers, the GPU-peer window's registration. A board implements it over
  PCIe; :class:`fpgaccl.host.board_device.SimDevice` implements it over a Verilator
  simulation of the same node (:mod:`fpgaccl.sim.board`), so the code below runs
  unchanged on both.
* :class:`QueueDriver` owns the submission and completion rings (formats in
  :mod:`fpgaccl.proto.queues`, registers in :mod:`fpgaccl.proto.regmap`): it posts work
  entries, rings the doorbell, reaps completions by their phase bit and installs GPU
  page-table entries.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from fpgaccl.errors import CollectiveTimeoutError, InvalidArgumentError, TransportError
from fpgaccl.proto.queues import (
    CQE_BYTES,
    WQE_BYTES,
    Opcode,
    Space,
    Status,
    pack_cqe,
    pack_wqe,
    unpack_cqe,
)
from fpgaccl.proto.regmap import GPU_PAGE_BITS, RegisterMap

Writes = Sequence[tuple[int, int]]


@dataclass(frozen=True)
class PageEntry:
    """One pinned GPU page as GPUDirect-RDMA registration reports it."""

    index: int       # page-table slot: (va - gpu_va_base) >> 16
    bus: int         # bus address of the page
    read: bool = True
    write: bool = True


class Device(Protocol):
    """A node's host interface: registers, pinned host memory, the GPU-peer window."""

    gpu_va_base: int
    """GPU virtual address of page-table slot 0 (the window's base)."""

    def csr_write(self, writes: Writes) -> None:
        """Posted register writes, applied in order."""

    def csr_read(self, addr: int) -> int: ...

    def host_write(self, iova: int, data: bytes) -> None:
        """Store into pinned host memory the engine reaches at ``iova``."""

    def host_read(self, iova: int, n: int) -> bytes: ...

    def gpu_write(self, va: int, data: bytes) -> None: ...

    def gpu_read(self, va: int, n: int) -> bytes: ...

    def gpu_pin(self, va: int, nbytes: int, *, write: bool) -> list[PageEntry]:
        """Pin GPU pages and return their bus addresses (``nvidia_p2p_get_pages``)."""

    def pause(self) -> None:
        """Let the engine run a little before the next poll."""


class QueueDriver:
    """Rings in pinned host memory at ``ring_base``: the SQ (``2**sq_log2`` entries of
    64 bytes) and, 64 KiB above it, the CQ (16-byte entries)."""

    def __init__(self, dev: Device, rmap: RegisterMap, *, ring_base: int,
                 sq_log2: int = 4, cq_log2: int = 4) -> None:
        self.dev, self.rmap = dev, rmap
        self.sq_log2, self.cq_log2 = sq_log2, cq_log2
        self.sq = ring_base
        self.cq = ring_base + 0x1_0000
        if (WQE_BYTES << sq_log2) > 0x1_0000:
            raise InvalidArgumentError("sq_log2", f"{sq_log2}: the SQ must fit 64 KiB")
        self.tail = 0
        self.cq_head = 0
        self.next_id = 1
        self.posted = 0

    def _w(self, path: str, value: int | None = None, at: int = 0,
           **fields: int) -> tuple[int, int]:
        """(address, word) of register ``path`` in copy ``at`` of its block: ``value``
        as is, or the register's ``fields`` encoded."""
        block, reg = path.split(".")
        word = self.rmap[block][reg].encode(**fields) if value is None else value
        return self.rmap.address(path, at), word

    def read(self, path: str, at: int = 0) -> int:
        return self.dev.csr_read(self.rmap.address(path, at))

    def setup(self, *, host_windows: Sequence[tuple[int, int, bool, bool]],
              max_rd: int = 16, max_wr: int = 16) -> None:
        """Program the host windows (base, length, read, write), the rings and enable the
        engine. Only memory inside a window is ever touched by a DMA."""
        n_windows = self.rmap["dma_host"].count
        if len(host_windows) > n_windows:
            raise InvalidArgumentError("host_windows", f"{len(host_windows)} windows; the "
                                       f"engine has {n_windows}")
        w = []
        for i, (base, length, r, wr) in enumerate(host_windows):
            w += [self._w("dma_host.base_lo", base & 0xFFFF_FFFF, at=i),
                  self._w("dma_host.base_hi", base >> 32, at=i),
                  self._w("dma_host.length", length, at=i),
                  self._w("dma_host.access", at=i, read=int(r), write=int(wr))]
        # The engine keeps its ring indices across enable/disable (a driver that reloads
        # attaches to a running card): continue from them, and fill the CQ with entries
        # whose phase says "not yet written" for the pass each slot is on.
        self.dev.csr_write([self._w("dma.control", enable=0)])
        self.tail = self.read("dma.sq_head")
        self.cq_head = self.read("dma.cq_tail")
        size = 1 << self.cq_log2
        self.dev.host_write(self.cq, b"".join(
            pack_cqe(phase=1 - self._phase(self.cq_head + (s - self.cq_head) % size))
            for s in range(size)))
        base = self.dev.gpu_va_base
        w += [self._w("dma.gpu_va_lo", base & 0xFFFF_FFFF),
              self._w("dma.gpu_va_hi", base >> 32),
              self._w("dma.sq_base_lo", self.sq & 0xFFFF_FFFF),
              self._w("dma.sq_base_hi", self.sq >> 32),
              self._w("dma.sq_cfg", log2_size=self.sq_log2, space=Space.HOST),
              self._w("dma.cq_base_lo", self.cq & 0xFFFF_FFFF),
              self._w("dma.cq_base_hi", self.cq >> 32),
              self._w("dma.cq_cfg", log2_size=self.cq_log2, space=Space.HOST),
              self._w("dma.cq_head", self.cq_head),
              self._w("dma.sq_tail", index=self.tail),
              self._w("dma.control", enable=1, max_rd=max_rd, max_wr=max_wr)]
        self.dev.csr_write(w)

    def register_gpu(self, va: int, nbytes: int, *, write: bool = True) -> None:
        """Pin ``[va, va + nbytes)`` and install its pages in the window's page table."""
        pages = self.rmap["dma_gpt"].registers
        lo = va - self.dev.gpu_va_base
        if lo < 0 or (lo + nbytes - 1) >> GPU_PAGE_BITS >= len(pages):
            raise InvalidArgumentError("buffer", f"GPU range {va:#x}+{nbytes} is outside the "
                                       f"engine's {len(pages)}-page window")
        reg = pages[0]
        self.dev.csr_write([
            (self.rmap.address(f"dma_gpt.pte{e.index}"),
             reg.encode(valid=1, read=int(e.read), write=int(e.write),
                        page=e.bus >> GPU_PAGE_BITS))
            for e in self.dev.gpu_pin(va, nbytes, write=write)])

    def post(self, opcode: Opcode, *, imm: int = 0, **fields: int) -> int:
        """Write one entry into the SQ (no doorbell); returns its ``wr_id``."""
        if self.posted >= 1 << self.sq_log2:
            raise TransportError("the submission queue is full: reap completions first")
        wr_id = self.next_id
        self.next_id = self.next_id % 0xFFFF_FFFF + 1
        slot = self.tail % (1 << self.sq_log2)
        self.dev.host_write(self.sq + slot * WQE_BYTES,
                            pack_wqe(opcode=int(opcode), wr_id=wr_id, imm=imm, **fields))
        self.tail = (self.tail + 1) & 0xFFFF
        self.posted += 1
        return wr_id

    def doorbell(self) -> None:
        self.dev.csr_write([self._w("dma.sq_tail", index=self.tail)])

    def _phase(self, index: int) -> int:
        """The phase the engine writes into CQ entry ``index`` (free-running): 1 on the
        ring's first pass, 0 on the next, ..."""
        return 1 - (index >> self.cq_log2) % 2

    def poll(self) -> dict[str, int] | None:
        slot = self.cq_head % (1 << self.cq_log2)
        cqe = unpack_cqe(self.dev.host_read(self.cq + slot * CQE_BYTES, CQE_BYTES))
        if cqe["phase"] != self._phase(self.cq_head):
            return None
        self.cq_head = (self.cq_head + 1) & 0xFFFF
        self.posted -= 1
        return cqe

    def reap(self, n: int, *, timeout_s: float, name: str, rank: int) -> list[dict[str, int]]:
        """``n`` completions, oldest first; the CQ head register follows."""
        out: list[dict[str, int]] = []
        end = time.monotonic() + timeout_s
        while len(out) < n:
            cqe = self.poll()
            if cqe is not None:
                out.append(cqe)
                continue
            if time.monotonic() > end:
                # Not the fault counters: they clear on read.
                regs = {r: self.read(f"dma.{r}") for r in ("status", "sq_head", "cq_tail")}
                raise CollectiveTimeoutError(name, rank, timeout_s,
                                             f"{len(out)} of {n} completions; engine {regs}")
            self.dev.pause()
        self.dev.csr_write([self._w("dma.cq_head", self.cq_head)])
        return out


def check_completion(cqe: dict[str, int], *, wr_id: int, name: str, rank: int) -> None:
    """Raise the typed error a failed completion stands for."""
    if cqe["wr_id"] != wr_id:
        raise TransportError(f"rank {rank}: {name}: completion for work request "
                             f"{cqe['wr_id']}, expected {wr_id}")
    status = Status(cqe["status"])
    if status is not Status.OK:
        raise TransportError(f"rank {rank}: {name}: the engine completed it with "
                             f"{status.name} (see the engine's dma.* fault counters)")
