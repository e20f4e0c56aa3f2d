"""DMA queue formats and node addressing: what the host runtime, a GPU kernel and the
hardware must agree on byte for byte.

* Submission-queue entries (:data:`WQE_FIELDS`, 64 bytes) and completion-queue entries
  (:data:`CQE_FIELDS`, 16 bytes) live in host or GPU memory. Fields are listed from bit 0
  up and the entry is little-endian in memory, so the first field is the first byte
  (``amaranth.lib.data.StructLayout`` order; the HDL builds its layouts from these
  tables, :mod:`fpgaccl.hw.dma.layouts`).
* :func:`node_addr`: how one 64-bit address on a node's memory port names the host
  space or the GPU-peer window.

Pure Python, no dependencies, like the rest of ``proto``.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import IntEnum


class Space(IntEnum):
    HOST = 0   # host memory: the address is an IOVA checked against the host windows
    GPU = 1    # GPU-peer window: the address is a GPU VA translated by the page table


class Status(IntEnum):
    """Completion status of a descriptor or a work request (CQE ``status``)."""
    OK = 0
    UNMAPPED = 1      # no window / page maps (part of) the range: nothing was moved
    FORBIDDEN = 2     # mapped, without the read or write right: nothing was moved
    BUS_ERROR = 3     # the memory answered SLVERR/DECERR: bytes may be partially moved
    BAD_OPCODE = 4    # the entry's opcode is unknown
    NOT_STARTED = 5   # WORK: the node did not start the program (ctrl.control.enable off)
    PROGRAM_ERROR = 6  # WORK: the program ended with ctrl.status.error


class Opcode(IntEnum):
    NOP = 0
    COPY = 1        # len bytes from (src_space, src_addr) to (dst_space, dst_addr)
    WRITE_IMM = 2   # the low len (1..8) bytes of imm to (dst_space, dst_addr)
    WORK = 3        # start a collective on the node: imm = work_imm(entry, coll_id)


WQE_BYTES = 64
WQE_FIELDS: tuple[tuple[str, int], ...] = (
    ("opcode", 8),
    ("flags", 8),
    ("src_space", 1),
    ("dst_space", 1),
    ("_rsvd0", 14),
    ("wr_id", 32),
    ("len", 32),
    ("_rsvd1", 32),
    ("src_addr", 64),
    ("dst_addr", 64),
    ("imm", 64),
    ("_rsvd2", 8 * WQE_BYTES - 320),
)
"""A submission-queue entry, from bit 0 up."""

CQE_BYTES = 16
CQE_FIELDS: tuple[tuple[str, int], ...] = (
    ("wr_id", 32),
    ("len", 32),
    ("opcode", 8),
    ("status", 8),
    # 1 on the ring's first pass, 0 on the second, ...: the consumer polls it instead
    # of reading cq_tail.
    ("phase", 1),
    ("_rsvd", 8 * CQE_BYTES - 81),
)
"""A completion-queue entry, from bit 0 up."""

FLAG_BYTES = 8
"""The completion flag: a little-endian count of completed work requests."""

NODE_SPACE_BIT = 63
"""On a node's memory port (program buffers, RDMA target addresses, memory regions)
bit 63 selects the space: clear = host IOVA, set = GPU VA in the peer window. GPU and
host virtual addresses stay far below 2**63, so the bit is free; the runtime tags GPU
buffers with :func:`node_addr` wherever it hands the node an address (coll/peer buffer
registers, mr.base, the addresses it exchanges with peers)."""


def node_addr(space: int, addr: int) -> int:
    if not 0 <= addr < (1 << NODE_SPACE_BIT):
        raise ValueError(f"address {addr:#x} does not fit below bit {NODE_SPACE_BIT}")
    return addr | (int(space) << NODE_SPACE_BIT)


def split_node_addr(addr: int) -> tuple[Space, int]:
    return Space(addr >> NODE_SPACE_BIT & 1), addr & ((1 << NODE_SPACE_BIT) - 1)


def work_imm(entry: int, coll_id: int) -> int:
    """A WORK entry's ``imm``: exactly the value of the node's ``ctrl.doorbell``."""
    if not (0 <= entry < 1 << 16 and 0 <= coll_id < 1 << 16):
        raise ValueError("entry and coll_id are 16-bit")
    return entry | coll_id << 16


def _pack(fields: tuple[tuple[str, int], ...], nbytes: int, values: Mapping[str, int]) -> bytes:
    known = {n for n, _ in fields}
    if extra := set(values) - known:
        raise KeyError(f"unknown field(s) {sorted(extra)}")
    word, pos = 0, 0
    for name, bits in fields:
        v = int(values.get(name, 0))
        if not 0 <= v < 1 << bits:
            raise ValueError(f"{name}: {v} does not fit {bits} bits")
        word |= v << pos
        pos += bits
    return word.to_bytes(nbytes, "little")


def _unpack(fields: tuple[tuple[str, int], ...], raw: bytes) -> dict[str, int]:
    word, pos, out = int.from_bytes(raw, "little"), 0, {}
    for name, bits in fields:
        if not name.startswith("_"):
            out[name] = word >> pos & ((1 << bits) - 1)
        pos += bits
    return out


def pack_wqe(**values: int) -> bytes:
    return _pack(WQE_FIELDS, WQE_BYTES, values)


def unpack_wqe(raw: bytes) -> dict[str, int]:
    return _unpack(WQE_FIELDS, raw[:WQE_BYTES])


def pack_cqe(**values: int) -> bytes:
    return _pack(CQE_FIELDS, CQE_BYTES, values)


def unpack_cqe(raw: bytes) -> dict[str, int]:
    return _unpack(CQE_FIELDS, raw[:CQE_BYTES])


assert sum(b for _, b in WQE_FIELDS) == 8 * WQE_BYTES
assert sum(b for _, b in CQE_FIELDS) == 8 * CQE_BYTES
