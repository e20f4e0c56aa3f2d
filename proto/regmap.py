"""The engine's register map: one table that the CSR bank (``fpgaccl.hw.csr``), the
host runtime's register accessors and the documentation are all generated from.

Registers are 32 bits wide at byte addresses. A :class:`Block` is a group of registers;
a block with ``count > 1`` repeats at ``stride`` (one copy per queue pair, per memory
region, ...). Fields pack LSB-first inside a register, as software reads them.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from enum import Enum, IntEnum
from itertools import pairwise

from .drops import DropReason
from .reduce import DTYPE_BITS, OP_BITS, DType, ReduceOp

REG_BYTES = 4
ENGINE_ID = 0x4643_434C  # "FCCL"
REGMAP_VERSION = 5
"""2: ctrl.features, ctrl.config, status.cause/datapath. 3: the build's MTU is
``ctrl.config.mtu_log2``; ``ctrl.control.mtu_log2``, which no logic read, is gone;
``ctrl.reduce`` packs dtype and op in the widths the reduction unit decodes. 4: two
different maps, made apart: 3 plus ``drops.service_busy`` (70acc6e), or 3 plus the
signature registers below (3a95104). 5: both, 3 plus ``drops.service_busy`` and the
call's signature digest (``coll.sig_lo/hi``), the peer that granted with another
(``coll.mismatch_peer``, ``coll.peer_sig_lo/hi``) and cause :attr:`StopCause.SIGNATURE`."""


class StopCause(IntEnum):
    """``ctrl.status.cause``: why the sequencer stopped the last program."""
    NONE = 0
    BAD_OP = 1
    BAD_SETUP = 2
    CHUNK_RANGE = 3
    PEER_RANGE = 4
    RUNAWAY = 5        # ran off the end of program memory
    SIGNATURE = 6      # a peer granted with another call's signature digest


class Access(Enum):
    RO = "ro"    # hardware drives it; writes are ignored
    RW = "rw"    # software drives it; hardware reads it
    WO = "wo"    # a write pulses a strobe with the data (doorbells); reads return 0
    RC = "rc"    # read-only counter; a write of any value clears it


@dataclass(frozen=True)
class RegField:
    name: str
    bits: int
    doc: str
    reset: int = 0


@dataclass(frozen=True)
class Register:
    name: str
    offset: int
    access: Access
    doc: str
    fields: tuple[RegField, ...] = ()
    reset: int = 0

    def __post_init__(self) -> None:
        if self.offset % REG_BYTES:
            raise ValueError(f"{self.name}: offset {self.offset:#x} is not word aligned")
        if not self.fields:
            object.__setattr__(self, "fields", (RegField("value", 32, self.doc, self.reset),))
        if sum(f.bits for f in self.fields) > 32:
            raise ValueError(f"{self.name}: fields exceed 32 bits")

    def field_offset(self, name: str) -> int:
        pos = 0
        for f in self.fields:
            if f.name == name:
                return pos
            pos += f.bits
        raise KeyError(name)

    def encode(self, **values: int) -> int:
        word = 0
        for f in self.fields:
            v = values.pop(f.name, f.reset)
            if not 0 <= v < (1 << f.bits):
                raise ValueError(f"{self.name}.{f.name}: {v} does not fit {f.bits} bits")
            word |= v << self.field_offset(f.name)
        if values:
            raise KeyError(f"{self.name} has no field(s) {sorted(values)}")
        return word

    def decode(self, word: int) -> dict[str, int]:
        return {f.name: (word >> self.field_offset(f.name)) & ((1 << f.bits) - 1)
                for f in self.fields}


@dataclass(frozen=True)
class Block:
    name: str
    base: int
    registers: tuple[Register, ...]
    doc: str
    count: int = 1
    stride: int = 0
    memory: bool = False
    """Backed by a RAM that the consumer reads (program memory), not by flip-flops."""

    def __post_init__(self) -> None:
        if self.memory and any(r.access is not Access.RW for r in self.registers):
            raise ValueError(f"block {self.name}: a memory block holds RW words only")
        span = max(r.offset for r in self.registers) + REG_BYTES
        if self.count > 1 and self.stride < span:
            raise ValueError(f"block {self.name}: stride {self.stride:#x} < span {span:#x}")
        names = [r.name for r in self.registers]
        if len(set(names)) != len(names):
            raise ValueError(f"block {self.name}: duplicate register names")

    @property
    def size(self) -> int:
        return self.stride * self.count if self.count > 1 else (
            max(r.offset for r in self.registers) + REG_BYTES)

    def __getitem__(self, name: str) -> Register:
        for r in self.registers:
            if r.name == name:
                return r
        raise KeyError(f"block {self.name} has no register {name}")

    def address(self, register: str, index: int = 0) -> int:
        if not 0 <= index < self.count:
            raise IndexError(f"{self.name}[{index}] out of range (count {self.count})")
        return self.base + index * self.stride + self[register].offset


@dataclass(frozen=True)
class RegisterMap:
    blocks: tuple[Block, ...]

    def __post_init__(self) -> None:
        spans = sorted((b.base, b.base + b.size, b.name) for b in self.blocks)
        for (_, end, a), (start, _, b) in pairwise(spans):
            if start < end:
                raise ValueError(f"register blocks {a} and {b} overlap")

    def __getitem__(self, name: str) -> Block:
        for b in self.blocks:
            if b.name == name:
                return b
        raise KeyError(f"no register block {name}")

    def __iter__(self) -> Iterator[Block]:
        return iter(self.blocks)

    def address(self, path: str, index: int = 0) -> int:
        """Byte address of ``"block.register"``, copy ``index`` of a repeated block."""
        block, reg = path.split(".")
        return self[block].address(reg, index)

    def flat(self) -> Iterator[tuple[int, Block, int, Register]]:
        """Every (address, block, copy index, register), in address order."""
        rows = [(b.address(r.name, i), b, i, r)
                for b in self.blocks for i in range(b.count) for r in b.registers]
        return iter(sorted(rows, key=lambda row: row[0]))


DMA_MAX_OUTSTANDING = 16
GPU_PAGE_BITS = 16  # GPUDirect RDMA pins GPU memory in 64 KiB pages


DMA_BLOCKS = ("dma", "dma_host", "dma_gpt")


def default_map(*, qps: int = 8, regions: int = 8, imem_words: int = 256,
                dma_host_windows: int = 4, gpu_pages: int = 256,
                dma: bool = True) -> RegisterMap:
    """The register map of a node with ``qps`` queue pairs, ``regions`` memory
    regions, ``dma_host_windows`` host DMA windows and a GPU-peer page table of
    ``gpu_pages`` entries; the parameters match the build's. ``dma=False`` leaves out
    the :data:`DMA_BLOCKS` (a build without the DMA engine); every other address is the
    same either way, and ``ctrl.features.dma`` tells the host which map it faces."""
    full = _full_map(qps, regions, imem_words, dma_host_windows, gpu_pages)
    if dma:
        return full
    return RegisterMap(tuple(b for b in full if b.name not in DMA_BLOCKS))


def features_word(*, dma: bool, dtypes, ops) -> int:
    """``ctrl.features`` of a build with (or without) DMA reducing ``dtypes`` x ``ops``."""
    return _CTRL_FEATURES.encode(dma=int(dma), dtypes=sum(1 << int(d) for d in set(dtypes)),
                                 ops=sum(1 << int(o) for o in set(ops)))


def config_word(*, qps: int, regions: int, imem_words: int, width: int, mtu: int) -> int:
    """``ctrl.config`` of a build with these parameters."""
    if imem_words & (imem_words - 1) or width % 8 or (width // 8) & (width // 8 - 1) \
            or mtu & (mtu - 1):
        raise ValueError("imem_words, the beat's bytes and the MTU must be powers of two")
    return _CTRL_CONFIG.encode(qps=qps, regions=regions,
                               imem_log2=imem_words.bit_length() - 1,
                               beat_log2=(width // 8).bit_length() - 1,
                               mtu_log2=mtu.bit_length() - 1)


def config_fields(word: int) -> dict[str, int]:
    """The build parameters a ``ctrl.config`` word holds, as :func:`config_word` takes
    them."""
    c = _CTRL_CONFIG.decode(word)
    return {"qps": c["qps"], "regions": c["regions"], "imem_words": 1 << c["imem_log2"],
            "width": 8 << c["beat_log2"], "mtu": 1 << c["mtu_log2"]}


def _full_map(qps: int, regions: int, imem_words: int, dma_host_windows: int,
              gpu_pages: int) -> RegisterMap:
    RO, RW, WO, RC = Access.RO, Access.RW, Access.WO, Access.RC
    return RegisterMap((
        Block("ctrl", 0x0000, (
            Register("id", 0x00, RO, "constant 'FCCL': proves the bus reaches the engine",
                     reset=ENGINE_ID),
            Register("version", 0x04, RO, "register-map version", reset=REGMAP_VERSION),
            Register("control", 0x08, RW, "engine control", (
                RegField("enable", 1, "accept traffic and run programs"),
            )),
            Register("status", 0x0C, RO, "engine status", (
                RegField("busy", 1, "a program is running"),
                RegField("error", 1, "the last program ended in error"),
                RegField("cause", 4, "why the sequencer stopped the last program: 0 it did "
                         "not, 1 bad opcode, 2 bad setup, 3 chunk out of range, 4 peer out "
                         "of range, 5 ran off the end of program memory, 6 a peer's grant "
                         "carried another signature digest (StopCause)"),
                RegField("datapath", 1, "the router refused a command or a transfer "
                         "completed in error (sticky until reset)"),
            )),
            Register("doorbell", 0x10, WO, "start program at this entry point; the host or a "
                     "GPU kernel (through the peer window) writes it", (
                         RegField("entry", 16, "instruction index"),
                         RegField("coll_id", 16, "collective number put in ImmDt"),
                     )),
            Register("reduce", 0x14, RW, "element type and operation of the reduction unit", (
                RegField("dtype", DTYPE_BITS, "fpgaccl.proto.reduce.DType value"),
                RegField("op", OP_BITS, "fpgaccl.proto.reduce.ReduceOp value"),
            )),
            Register("scratch", 0x18, RW, "free for software: bus read-back tests"),
            Register("completions", 0x1C, RC, "programs completed since last cleared"),
            Register("features", 0x20, RO, "what this build implements; blocks it leaves "
                     "out are absent from its register map and read as zero", (
                         RegField("dma", 1, "the dma, dma_host and dma_gpt blocks (queues, "
                                  "windows, GPU page table) are served"),
                         RegField("dtypes", len(DType), "bit d: DType d is reduced"),
                         RegField("ops", len(ReduceOp), "bit o: ReduceOp o is reduced"),
                     )),
            Register("config", 0x24, RO, "build parameters the host must match", (
                RegField("qps", 8, "queue pairs (= peers; copies of qp and peer)"),
                RegField("regions", 8, "memory regions (copies of mr)"),
                RegField("imem_log2", 5, "program memory holds 2**imem_log2 words"),
                RegField("beat_log2", 4, "datapath beat is 2**beat_log2 bytes"),
                RegField("mtu_log2", 4, "packets carry at most 2**mtu_log2 payload bytes "
                         "(Node(mtu=)); every engine of a world must have the same"),
            )),
        ), "identification, control and the doorbell"),
        Block("drops", 0x0100, tuple(
            Register(reason.name.lower(), 4 * reason.value, RC,
                     f"frames dropped: {reason.name.lower().replace('_', ' ')} (saturating)")
            for reason in DropReason), "per-reason drop counters"),
        Block("qp", 0x1000, (
            Register("local_qpn", 0x00, RW, "this QP's number (24 bits)"),
            Register("remote_qpn", 0x04, RW, "peer QP number (24 bits)"),
            Register("next_psn", 0x08, RW, "requester: PSN of the next new packet"),
            Register("expected_psn", 0x0C, RW, "responder: PSN expected next"),
            Register("state", 0x10, RW, "QP state", (
                RegField("state", 3, "0 reset, 1 init, 2 RTR, 3 RTS, 4 error"),
            )),
            Register("retries", 0x14, RO, "retransmissions since QP reset"),
            Register("peer_ip", 0x18, RW, "peer IPv4 address"),
            Register("peer_mac_lo", 0x1C, RW, "peer MAC bits 31:0"),
            Register("peer_mac_hi", 0x20, RW, "peer MAC bits 47:32", (
                RegField("mac_hi", 16, "peer MAC bits 47:32"),
            )),
        ), "queue-pair contexts, one copy per QP", count=qps, stride=0x40),
        Block("mr", 0x2000, (
            Register("base_lo", 0x00, RW, "region start address bits 31:0"),
            Register("base_hi", 0x04, RW, "region start address bits 63:32"),
            Register("length", 0x08, RW, "region length in bytes"),
            Register("key", 0x0C, RW, "rkey a peer must present"),
            Register("access", 0x10, RW, "what peers may do", (
                RegField("remote_write", 1, "RDMA WRITE allowed"),
                RegField("remote_read", 1, "RDMA READ allowed"),
                RegField("space", 1, "0 host memory, 1 GPU-peer window"),
            )),
        ), "memory regions, one copy per region", count=regions, stride=0x20),
        Block("port", 0x0300, (
            Register("mac_lo", 0x00, RW, "this port's MAC bits 31:0"),
            Register("mac_hi", 0x04, RW, "this port's MAC bits 47:32", (
                RegField("mac_hi", 16, "MAC bits 47:32"),
            )),
            Register("ip", 0x08, RW, "this port's IPv4 address"),
            Register("udp_sport", 0x0C, RW, "UDP source port base (ECMP entropy)", (
                RegField("sport", 16, "source port of QP 0; QP i uses sport + i", reset=0xC000),
            )),
        ), "the network port's own addresses"),
        Block("coll", 0x0200, (
            *(Register(f"{buf}_{half}", 8 * i + 4 * j, RW,
                       f"{buf.upper()} buffer address bits {'31:0' if j == 0 else '63:32'}")
              for i, buf in enumerate(("in", "out", "tmp", "tmp2"))
              for j, half in enumerate(("lo", "hi"))),
            Register("count", 0x20, RW, "elements in the collective (the programs' n)"),
            Register("sig_lo", 0x24, RW, "the call's signature digest bits 31:0 "
                     "(fpgaccl.proto.signature; 0 with sig_hi: none): sent in each GRANT's "
                     "RETH VA, compared with each received GRANT's"),
            Register("sig_hi", 0x28, RW, "the call's signature digest bits 63:32"),
            Register("mismatch_peer", 0x2C, RO, "the first peer whose GRANT carried a "
                     "non-zero digest other than sig (valid while status.cause is 6)", (
                         RegField("peer", 8, "its queue pair (= rank)"),
                     )),
            Register("peer_sig_lo", 0x30, RO, "the digest that peer granted with, bits 31:0"),
            Register("peer_sig_hi", 0x34, RO, "the digest that peer granted with, bits 63:32"),
        ), "the running collective: local buffers the sequencer's IN/OUT/TMP/TMP2 name, "
            "and its signature"),
        Block("peer", 0x4000, (
            *(Register(f"{buf}_{half}", 8 * i + 4 * j, RW,
                       f"peer's {buf.upper()} buffer address bits "
                       f"{'31:0' if j == 0 else '63:32'}")
              for i, buf in enumerate(("in", "out", "tmp", "tmp2"))
              for j, half in enumerate(("lo", "hi"))),
            *(Register(f"{buf}_key", 0x20 + 4 * i, RW, f"rkey of the peer's {buf.upper()}")
              for i, buf in enumerate(("in", "out", "tmp", "tmp2"))),
        ), "per peer rank: where its buffers are, exchanged at rendezvous (QP i = rank i)",
            count=qps, stride=0x40),
        Block("dma", 0x5000, _dma_registers(),
              "DMA engine: submission/completion queues in memory, the GPU completion "
              "flag, the GPU window base, outstanding-request limits and fault counters"),
        Block("dma_host", 0x5100, (
            Register("base_lo", 0x00, RW, "window start (host bus address) bits 31:0"),
            Register("base_hi", 0x04, RW, "window start bits 63:32"),
            Register("length", 0x08, RW, "window length in bytes; 0 disables the window"),
            Register("access", 0x0C, RW, "what the engine may do in the window", (
                RegField("read", 1, "DMA reads allowed"),
                RegField("write", 1, "DMA writes allowed"),
            )),
        ), "host-memory DMA windows (identity-mapped IOVA ranges), one copy per window",
            count=dma_host_windows, stride=0x10),
        Block("dma_gpt", 0x6000, tuple(
            Register(f"pte{i}", 4 * i, RW, f"GPU page {i}: GPU VA gpu_va + {i} * 64 KiB", (
                RegField("valid", 1, "the page is pinned and mapped"),
                RegField("read", 1, "DMA reads allowed"),
                RegField("write", 1, "DMA writes allowed"),
                RegField("page", 29, "bus address bits 44:16 of the pinned page"),
            )) for i in range(gpu_pages)),
            "GPU-peer window page table, as GPUDirect-RDMA registration installs it",
            memory=True),
        Block("imem", 0x8000, tuple(
            Register(f"word{i}", 4 * i, RW, "sequencer instruction memory word")
            for i in range(imem_words)), "sequencer program memory", memory=True),
    ))


def _dma_registers() -> tuple[Register, ...]:
    RO, RW, WO, RC = Access.RO, Access.RW, Access.WO, Access.RC
    ring = (RegField("log2_size", 4, "ring holds 2**log2_size entries"),
            RegField("space", 1, "0 host memory, 1 GPU-peer window"))
    return (
        Register("control", 0x00, RW, "DMA control", (
            RegField("enable", 1, "process the submission queue"),
            RegField("max_rd", 5, "read bursts in flight (1..16)", reset=DMA_MAX_OUTSTANDING),
            RegField("max_wr", 5, "write bursts in flight (1..16)", reset=DMA_MAX_OUTSTANDING),
        )),
        Register("status", 0x04, RO, "DMA status", (
            RegField("busy", 1, "a work request is in progress"),
            RegField("error", 1, "a queue access faulted; the engine stopped (clear: "
                     "disable then enable)"),
        )),
        Register("sq_base_lo", 0x08, RW, "submission ring address bits 31:0 (64 B entries)"),
        Register("sq_base_hi", 0x0C, RW, "submission ring address bits 63:32"),
        Register("sq_cfg", 0x10, RW, "submission ring geometry", ring),
        Register("sq_tail", 0x14, WO, "doorbell: producer index (free-running, 16 bits); "
                 "the host or a GPU kernel (through the peer window) writes it", (
                     RegField("index", 16, "entries posted so far, modulo 2**16"),)),
        Register("sq_head", 0x18, RO, "entries consumed so far, modulo 2**16"),
        Register("cq_base_lo", 0x1C, RW, "completion ring address bits 31:0 (16 B entries)"),
        Register("cq_base_hi", 0x20, RW, "completion ring address bits 63:32"),
        Register("cq_cfg", 0x24, RW, "completion ring geometry", ring),
        Register("cq_head", 0x28, RW, "completions consumed by software, modulo 2**16"),
        Register("cq_tail", 0x2C, RO, "completions written, modulo 2**16"),
        Register("flag_lo", 0x30, RW, "completion flag address bits 31:0 (8 B counter)"),
        Register("flag_hi", 0x34, RW, "completion flag address bits 63:32"),
        Register("flag_cfg", 0x38, RW, "completion flag write-back", (
            RegField("enable", 1, "write the completion count after every CQE"),
            RegField("space", 1, "0 host memory, 1 GPU-peer window"),
        )),
        Register("gpu_va_lo", 0x3C, RW, "GPU VA of page-table entry 0, bits 31:0 "
                 "(64 KiB aligned)"),
        Register("gpu_va_hi", 0x40, RW, "GPU VA of page-table entry 0, bits 63:32"),
        Register("completed", 0x44, RC, "work requests completed"),
        Register("unmapped", 0x48, RC, "descriptors refused: address not mapped"),
        Register("forbidden", 0x4C, RC, "descriptors refused: mapped without the right"),
        Register("bus_errors", 0x50, RC, "bursts answered with an AXI error response"),
    )


REGMAP = default_map()
_CTRL_FEATURES = REGMAP["ctrl"]["features"]
_CTRL_CONFIG = REGMAP["ctrl"]["config"]
