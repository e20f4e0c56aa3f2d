"""Descriptor, segment, beat and queue-entry layouts of the DMA, and the shapes it
takes from the CSR bank.

A *descriptor* is what a user of the DMA asks for: ``space`` (host memory or the
GPU-peer window), a device address (host IOVA, or GPU VA), a byte length and a ``tag``
echoed in the completion. The node top turns a sequencer command (buffer + element
offset/length) into one by adding the buffer's base address and scaling by the element
size. The translator turns a descriptor into *segments*: bus-address runs that never
cross a GPU page, so the movers never see a virtual address.
"""

from __future__ import annotations

from amaranth.lib import data

from fpgaccl.hw.csr.bank import register_layout
from fpgaccl.proto.regmap import Access, RegisterMap, default_map

TAG_BITS = 8
LEN_BITS = 32


class Space:
    HOST = 0
    GPU = 1


class Status:
    OK = 0
    UNMAPPED = 1    # no window / page maps (part of) the range: nothing was moved
    FORBIDDEN = 2   # mapped, without the read or write right: nothing was moved
    BUS_ERROR = 3   # the memory answered SLVERR/DECERR (or, for a write, its data was
                    # poisoned by a faulted read): bytes may be partially moved


DESC = data.StructLayout({
    "space": 1,
    "addr": 64,
    "len": LEN_BITS,   # bytes; 0 completes at once and moves nothing
    "tag": TAG_BITS,
})

SEG = data.StructLayout({
    "addr": 64,        # bus address of this run
    "len": LEN_BITS,   # bytes in this run (0 only for a zero-length or refused desc)
    "space": 1,
    "first": 1,        # first run of its descriptor: carries the descriptor fields
    "last": 1,
    "dlen": LEN_BITS,  # the descriptor's length
    "tag": TAG_BITS,
    "status": 2,       # != OK: the translator refused the descriptor (len is 0)
})

CPL = data.StructLayout({"tag": TAG_BITS, "status": 2, "len": LEN_BITS})


def dma_beat_layout(width: int) -> data.StructLayout:
    """A packed data beat (byte 0 of the first beat is the descriptor's first byte,
    ``keep`` a low mask, as :mod:`fpgaccl.hw.stream.beat`), plus ``err``: the beat
    stands for data that could not be read. A refused read still emits all its beats
    (zeros, ``err`` set) so every consumer sees the framing it asked for; the write mover
    turns such beats into zero strobes, so a failed copy never writes its destination."""
    return data.StructLayout({
        "data": width, "keep": width // 8, "first": 1, "last": 1, "err": 1,
    })


class Opcode:
    NOP = 0
    COPY = 1        # len bytes from (src_space, src_addr) to (dst_space, dst_addr)
    WRITE_IMM = 2   # the low len (1..8) bytes of imm to (dst_space, dst_addr)
    WORK = 3        # handed to the node (collective start: imm = entry | coll_id << 16)


WQE_BYTES = 64
WQE = data.StructLayout({
    "opcode": 8,
    "flags": 8,
    "src_space": 1,
    "dst_space": 1,
    "_rsvd0": 14,
    "wr_id": 32,
    "len": 32,
    "_rsvd1": 32,
    "src_addr": 64,
    "dst_addr": 64,
    "imm": 64,
    "_rsvd2": 8 * WQE_BYTES - 320,
})
"""A submission-queue entry, 64 bytes little-endian in memory (field 0 at bit 0)."""

CQE_BYTES = 16
CQE = data.StructLayout({
    "wr_id": 32,
    "len": 32,
    "opcode": 8,
    "status": 8,       # Status of the work request
    "phase": 1,        # 1 on the ring's first pass, 0 on the second, ...: the consumer
                       # polls it instead of reading cq_tail
    "_rsvd": 8 * CQE_BYTES - 81,
})
"""A completion-queue entry, 16 bytes."""

WORK_DONE = data.StructLayout({"status": 8, "len": 32})
"""The node's answer to a WORK entry."""


def _block_layout(rmap: RegisterMap, block: str, accesses, one_bit: bool = False):
    b = rmap[block]
    regs = [r for r in b.registers if r.access in accesses]
    if one_bit:
        layout = data.StructLayout({r.name: 1 for r in regs})
    else:
        layout = data.StructLayout({r.name: register_layout(r) for r in regs})
    return data.ArrayLayout(layout, b.count) if b.count > 1 else layout


def dma_ctl_layout() -> data.StructLayout:
    """Exactly :class:`~fpgaccl.hw.csr.bank.CSRBank`'s ``dma_ctl``."""
    return _block_layout(default_map(), "dma", (Access.RW, Access.WO))


def dma_sts_layout() -> data.StructLayout:
    return _block_layout(default_map(), "dma", (Access.RO, Access.RC))


def dma_wstb_layout() -> data.StructLayout:
    return _block_layout(default_map(), "dma", (Access.WO,), one_bit=True)


def dma_clr_layout() -> data.StructLayout:
    return _block_layout(default_map(), "dma", (Access.RC,), one_bit=True)


def host_ctl_layout(windows: int) -> data.Layout:
    """Exactly the bank's ``dma_host_ctl`` for ``windows`` host windows."""
    return _block_layout(default_map(dma_host_windows=windows), "dma_host",
                         (Access.RW, Access.WO))


PTE = register_layout(default_map(gpu_pages=1)["dma_gpt"]["pte0"])
