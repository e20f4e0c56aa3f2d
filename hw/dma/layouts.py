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
from fpgaccl.proto.queues import (
    CQE_BYTES,
    CQE_FIELDS,
    WQE_BYTES,
    WQE_FIELDS,
)
from fpgaccl.proto.queues import Opcode as _Opcode
from fpgaccl.proto.queues import Space as _Space
from fpgaccl.proto.queues import Status as _Status
from fpgaccl.proto.regmap import Access, RegisterMap, default_map

# The queue formats and codes are proto's (the host runtime packs the same entries);
# they are re-exported here for the gateware and its benches.
__all__ = [
    "CPL",
    "CQE",
    "CQE_BYTES",
    "DESC",
    "SEG",
    "WORK_DONE",
    "WQE",
    "WQE_BYTES",
    "Opcode",
    "Space",
    "Status",
    "dma_beat_layout",
]



def _ints(enum) -> type:
    # Plain ints: Amaranth sizes an IntEnum member by the enum's largest member, which
    # would widen every status comparison in the movers.
    return type(enum.__name__, (), {m.name: int(m) for m in enum})


Space, Status, Opcode = _ints(_Space), _ints(_Status), _ints(_Opcode)

TAG_BITS = 8
LEN_BITS = 32


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


WQE = data.StructLayout(dict(WQE_FIELDS))
"""A submission-queue entry (:data:`fpgaccl.proto.queues.WQE_FIELDS`)."""

CQE = data.StructLayout(dict(CQE_FIELDS))
"""A completion-queue entry (:data:`fpgaccl.proto.queues.CQE_FIELDS`)."""

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
