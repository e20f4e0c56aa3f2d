"""The collective sequencer's instruction set: the single definition of how a program
is encoded, shared by the HDL sequencer, the software engine and the assembler.

A program runs on every rank's engine (each rank gets its own, assembled for its rank).
It sees four buffers: ``IN`` (the user's send buffer) and ``OUT`` (the receive buffer)
of ``n`` elements, and two engine scratch buffers ``TMP``/``TMP2`` that peers' RDMA
WRITEs land in before they are reduced. SETUP splits them into ``nchunks`` chunks of
``cs = ceil(n / nchunks)`` elements (chunk ``c`` is ``[c*cs, min((c+1)*cs, n))`` in
IN/OUT, and the full ``[c*cs, (c+1)*cs)`` in scratch, so scratch holds
``nchunks * cs`` elements): equal strides keep the scratch regions of different chunks
disjoint whatever ``n`` is.

Ordering rules the engines guarantee:

* instructions take effect in order. An engine may start one before an earlier one has
  finished (the HDL node streams a SEND out while the next RECV_REDUCE runs) only where
  no program can tell: nothing writes a range an earlier SEND may still read (until the
  peer acknowledged it, go-back-N re-reads the source), no SEND reads a range an
  earlier instruction is still writing, and GRANT and DONE wait for everything before
  them;
* flow control is by credit: a SEND of tag ``step`` to ``peer`` waits until that peer
  has run ``GRANT`` for it (a zero-length RDMA WRITE with immediate data). A receiver
  grants only once the region the message lands in is free, so no RDMA WRITE can
  overwrite data still to be sent or reduced -- in this collective or the next;
* a RECV/RECV_REDUCE waits until the whole message ``(peer, step)`` has landed, in the
  buffer and chunks the *sender* named (``rbuf``/``xchunk``).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

from .fields import Field, Header, one_of
from .headers import COLLECTIVE_IMM


class SeqOp(IntEnum):
    NOP = 0
    SETUP = 1         # split buffers into `step` chunks
    COPY = 2          # buf[chunk..+count] = src[chunk..+count]
    SEND = 3          # RDMA WRITE src[chunk..] to peer's rbuf[xchunk..], tag step
    RECV = 4          # wait for (peer, step) to land (it was written in place)
    RECV_REDUCE = 5   # wait for (peer, step) in TMP*[xchunk..]; buf[chunk..] = op(src, it)
    GRANT = 6         # tell peer it may send message `step` (its landing region is free)
    DONE = 15         # signal completion


class Buf(IntEnum):
    IN = 0
    OUT = 1
    TMP = 2
    TMP2 = 3


INSTRUCTION = Header("SeqInstr", (
    Field("op", 4, 0, "SeqOp", check=one_of(frozenset(int(o) for o in SeqOp), "sequencer op")),
    Field("buf", 2, 0, "destination (COPY, RECV_REDUCE) or landing buffer (RECV)"),
    Field("src", 2, 0, "local source buffer (COPY, SEND, RECV_REDUCE)"),
    Field("rbuf", 2, 0, "SEND: buffer the data lands in at the peer; RECV_REDUCE: scratch"),
    Field("resv", 6, 0, "reserved, zero"),
    Field("peer", 8, 0, "rank sent to or received from"),
    Field("chunk", 8, 0, "first local chunk"),
    Field("count", 8, 0, "number of consecutive chunks"),
    Field("xchunk", 8, 0, "SEND: first chunk at the peer; RECV_REDUCE: first scratch chunk"),
    Field("step", 16, 0, "message tag (ImmDt step) or, for SETUP, the number of chunks"),
), "one 64-bit sequencer instruction; stored low word first in program memory")

WORDS_PER_INSTRUCTION = INSTRUCTION.bits // 32


@dataclass(frozen=True)
class Instr:
    op: SeqOp
    buf: Buf = Buf.IN
    src: Buf = Buf.IN
    rbuf: Buf = Buf.IN
    peer: int = 0
    chunk: int = 0
    count: int = 1
    xchunk: int = 0
    step: int = 0

    def encode(self) -> int:
        return INSTRUCTION.to_int(op=int(self.op), buf=int(self.buf), src=int(self.src),
                                  rbuf=int(self.rbuf), peer=self.peer, chunk=self.chunk,
                                  count=self.count, xchunk=self.xchunk, step=self.step)

    @classmethod
    def decode(cls, word: int) -> Instr:
        v = INSTRUCTION.from_int(word)
        INSTRUCTION.validate(v)
        return cls(SeqOp(v["op"]), Buf(v["buf"]), Buf(v["src"]), Buf(v["rbuf"]), v["peer"],
                   v["chunk"], v["count"], v["xchunk"], v["step"])

    def __str__(self) -> str:
        o = self.op
        if o is SeqOp.SETUP:
            return f"SETUP nchunks={self.step}"
        if o is SeqOp.DONE or o is SeqOp.NOP:
            return o.name
        rng = f"[{self.chunk}:{self.chunk + self.count}]"
        if o is SeqOp.COPY:
            return f"COPY {self.buf.name}{rng} <- {self.src.name}"
        if o is SeqOp.SEND:
            return (f"SEND {self.src.name}{rng} -> rank {self.peer} "
                    f"{self.rbuf.name}[{self.xchunk}] step={self.step}")
        if o is SeqOp.GRANT:
            return f"GRANT rank {self.peer} step={self.step}"
        if o is SeqOp.RECV:
            return f"RECV {self.buf.name}{rng} <- rank {self.peer} step={self.step}"
        return (f"RECV_REDUCE {self.buf.name}{rng} = op({self.src.name}, "
                f"{self.rbuf.name}[{self.xchunk}]) <- rank {self.peer} step={self.step}")


MAX_STEP = (1 << COLLECTIVE_IMM["step"].bits) - 1
"""The largest message tag a SEND/RECV/GRANT may carry: the ISA's 16-bit ``step`` goes
on the wire in COLLECTIVE_IMM's 15-bit field."""

PEER_OPS = frozenset({SeqOp.SEND, SeqOp.RECV, SeqOp.RECV_REDUCE, SeqOp.GRANT})
"""The operations whose ``peer`` names another rank."""


def checked_program(program: object, rank: int, world_size: int) -> list[Instr]:
    """``program`` (rank ``rank`` of ``world_size``) with its op and buffer fields as
    :class:`SeqOp`/:class:`Buf` members, up to its DONE; ValueError naming the first
    instruction that cannot run: not an :class:`Instr`, a field that does not fit its
    width or names no op or buffer, a peer outside the world or the rank itself, a tag
    beyond :data:`MAX_STEP`, a SETUP of zero chunks, local or remote (``xchunk``) chunks
    beyond the last SETUP's, or no DONE at all. The engines would fail such a program
    only when they reach it, part-way through a collective the other ranks are already
    running."""
    nchunks = 1
    out: list[Instr] = []
    for pc, ins in enumerate(program):  # type: ignore[call-overload]
        if not isinstance(ins, Instr):
            raise ValueError(f"instruction {pc} is a {type(ins).__name__}, not an Instr")
        try:
            ins.encode()
            ins = Instr(SeqOp(ins.op), Buf(ins.buf), Buf(ins.src), Buf(ins.rbuf), ins.peer,
                        ins.chunk, ins.count, ins.xchunk, ins.step)
        except (ValueError, TypeError) as e:
            raise ValueError(f"instruction {pc} ({ins!r}): {e}") from None
        where = f"instruction {pc} ({ins})"
        out.append(ins)
        o = ins.op
        if o is SeqOp.DONE:
            return out
        if o is SeqOp.SETUP:
            if ins.step == 0:
                raise ValueError(f"{where}: SETUP of zero chunks")
            nchunks = ins.step
            continue
        if o in PEER_OPS:
            if ins.peer >= world_size or ins.peer == rank:
                raise ValueError(f"{where}: peer {ins.peer} is not another rank of "
                                 f"0..{world_size - 1} (this is rank {rank})")
            if ins.step > MAX_STEP:
                raise ValueError(f"{where}: step {ins.step} does not fit the "
                                 f"{MAX_STEP.bit_length()}-bit message tag of COLLECTIVE_IMM")
        if o in (SeqOp.COPY, SeqOp.SEND, SeqOp.RECV_REDUCE) and \
                ins.chunk + ins.count > nchunks:
            raise ValueError(f"{where}: chunks [{ins.chunk}, {ins.chunk + ins.count}) are "
                             f"beyond the {nchunks} of the last SETUP")
        if o in (SeqOp.SEND, SeqOp.RECV_REDUCE) and ins.xchunk + ins.count > nchunks:
            raise ValueError(f"{where}: chunks [{ins.xchunk}, {ins.xchunk + ins.count}) of "
                             f"{ins.rbuf.name} are beyond the {nchunks} of the last SETUP")
    raise ValueError("the program has no DONE")


def chunk_size(n: int, nchunks: int) -> int:
    return -(-n // nchunks) if nchunks else 0


def assemble(program: list[Instr]) -> list[int]:
    """Program-memory words (32-bit, low word of each instruction first)."""
    words = []
    for ins in program:
        w = ins.encode()
        words += [(w >> (32 * i)) & 0xFFFFFFFF for i in range(WORDS_PER_INSTRUCTION)]
    return words


def disassemble(words: list[int]) -> list[Instr]:
    if len(words) % WORDS_PER_INSTRUCTION:
        raise ValueError("program length is not a whole number of instructions")
    out = []
    for i in range(0, len(words), WORDS_PER_INSTRUCTION):
        w = sum(words[i + j] << (32 * j) for j in range(WORDS_PER_INSTRUCTION))
        out.append(Instr.decode(w))
    return out
