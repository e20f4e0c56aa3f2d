"""Executable model of N engines running sequencer programs (:mod:`fpgaccl.proto.isa`).

It is the reference the HDL sequencer and the software engine are checked against, and
a race detector for programs: ranks advance and messages land in a seeded random
interleaving (RC order kept per peer pair), so a program that relies on timing -- a
message overwriting data not yet sent or reduced -- gives wrong results under some seed.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from fpgaccl.proto.isa import Buf, Instr, SeqOp, chunk_size
from fpgaccl.proto.reduce import DType, ReduceOp, reduce_reference


class ProgramError(RuntimeError):
    """A program deadlocked or broke a rule of the ISA."""


@dataclass
class _Rank:
    program: list[Instr]
    bufs: dict[Buf, np.ndarray]
    pc: int = 0
    nchunks: int = 1
    # Per peer, in arrival order: hardware keeps only a counter per peer, so a program
    # must consume grants and messages from one peer in the order that peer sent them.
    granted: dict = field(default_factory=dict)  # peer -> deque of granted steps
    landed: dict = field(default_factory=dict)   # peer -> deque of landed steps
    allowed: set = field(default_factory=set)   # (peer, step) this rank has granted
    done: bool = False


@dataclass
class _Msg:
    src: int
    dst: int
    step: int
    grant: bool
    rbuf: Buf = Buf.OUT
    lo: int = 0
    data: np.ndarray | None = None


class SequencerModel:
    def __init__(self, programs: list[list[Instr]], inputs: list[np.ndarray],
                 dtype: DType, op: ReduceOp, *, seed: int = 0) -> None:
        if len(programs) != len(inputs):
            raise ValueError("one program and one input per rank")
        self.dtype, self.op = DType(dtype), ReduceOp(op)
        self.rng = random.Random(seed)
        self.n = len(inputs[0])
        self.ranks = []
        for prog, x in zip(programs, inputs, strict=True):
            x = np.asarray(x, dtype=self.dtype.numpy_dtype())
            bufs = {Buf.IN: x.copy(), Buf.OUT: np.zeros_like(x), Buf.TMP: np.zeros_like(x),
                    Buf.TMP2: np.zeros_like(x)}
            self.ranks.append(_Rank(list(prog), bufs))
        # One FIFO per ordered pair: RC delivers in order on a queue pair.
        self.links: dict[tuple[int, int], deque[_Msg]] = {}
        self.instructions = 0
        self.messages = 0
        world = len(inputs)
        self.speed = {("rank", i): self.rng.choice((0.05, 1.0, 20.0)) for i in range(world)}
        self.speed |= {("link", (a, b)): self.rng.choice((0.05, 1.0, 20.0))
                       for a in range(world) for b in range(world)}

    def _span(self, r: _Rank, chunk: int, count: int) -> slice:
        if chunk + count > r.nchunks:
            raise ProgramError(f"chunks [{chunk}, {chunk + count}) beyond {r.nchunks}")
        cs = chunk_size(self.n, r.nchunks)
        return slice(min(chunk * cs, self.n), min((chunk + count) * cs, self.n))

    def _post(self, msg: _Msg) -> None:
        self.links.setdefault((msg.src, msg.dst), deque()).append(msg)

    def _step_rank(self, idx: int) -> bool:
        """Run rank ``idx``'s next instruction if it can; report progress."""
        r = self.ranks[idx]
        if r.done:
            return False
        if r.pc >= len(r.program):
            raise ProgramError(f"rank {idx} ran off the end of its program without DONE")
        ins = r.program[r.pc]
        op = ins.op
        if op is SeqOp.SETUP:
            r.nchunks = ins.step
            size = r.nchunks * chunk_size(self.n, r.nchunks)
            for b in (Buf.TMP, Buf.TMP2):
                r.bufs[b] = np.zeros(size, dtype=r.bufs[Buf.IN].dtype)
        elif op is SeqOp.COPY:
            s = self._span(r, ins.chunk, ins.count)
            r.bufs[ins.buf][s] = r.bufs[ins.src][s]
        elif op is SeqOp.GRANT:
            r.allowed.add((ins.peer, ins.step))
            self._post(_Msg(idx, ins.peer, ins.step, grant=True))
        elif op is SeqOp.SEND:
            if not self._take(idx, r.granted, ins, "grant"):
                return False
            s = self._span(r, ins.chunk, ins.count)
            self._post(_Msg(idx, ins.peer, ins.step, grant=False, rbuf=ins.rbuf,
                            lo=ins.xchunk, data=r.bufs[ins.src][s].copy()))
        elif op in (SeqOp.RECV, SeqOp.RECV_REDUCE):
            if not self._take(idx, r.landed, ins, "message"):
                return False
            if op is SeqOp.RECV_REDUCE:
                s = self._span(r, ins.chunk, ins.count)
                lo = ins.xchunk * chunk_size(self.n, r.nchunks)
                t = slice(lo, lo + s.stop - s.start)
                r.bufs[ins.buf][s] = reduce_reference(self.dtype, self.op, r.bufs[ins.src][s],
                                                      r.bufs[ins.rbuf][t])
        elif op is SeqOp.DONE:
            r.done = True
        elif op is not SeqOp.NOP:
            raise ProgramError(f"rank {idx}: unknown op {op}")
        r.pc += 1
        self.instructions += 1
        return True

    @staticmethod
    def _take(idx: int, queues: dict, ins: Instr, what: str) -> bool:
        q = queues.get(ins.peer)
        if not q:
            return False
        if q[0] != ins.step:
            raise ProgramError(f"rank {idx}: waits for {what} step {ins.step} from rank "
                               f"{ins.peer}, but step {q[0]} arrived first")
        q.popleft()
        return True

    def _deliver(self, key: tuple[int, int]) -> None:
        msg = self.links[key].popleft()
        if not self.links[key]:
            del self.links[key]
        dst = self.ranks[msg.dst]
        self.messages += 1
        if msg.grant:
            dst.granted.setdefault(msg.src, deque()).append(msg.step)
            return
        if (msg.src, msg.step) not in dst.allowed:
            raise ProgramError(f"rank {msg.src} step {msg.step} landed on rank {msg.dst} "
                               "without a grant")
        dst.allowed.discard((msg.src, msg.step))
        lo = msg.lo * chunk_size(self.n, dst.nchunks)
        dst.bufs[msg.rbuf][lo:lo + len(msg.data)] = msg.data
        dst.landed.setdefault(msg.src, deque()).append(msg.step)

    def run(self, max_events: int = 1_000_000) -> list[np.ndarray]:
        """Run every rank to DONE; return each rank's OUT buffer."""
        for _ in range(max_events):
            if all(r.done for r in self.ranks) and not self.links:
                return [r.bufs[Buf.OUT] for r in self.ranks]
            choices = [("rank", i) for i, r in enumerate(self.ranks) if not r.done]
            choices += [("link", k) for k in self.links]
            # Weighted shuffle: under some seeds a rank or link is far faster than the
            # rest, the interleavings where timing races show.
            order = sorted(choices, key=lambda c: self.rng.random() ** (1 / self.speed[c]))
            for kind, key in reversed(order):
                if kind == "link":
                    self._deliver(key)
                    break
                if self._step_rank(key):
                    break
            else:
                stuck = {i: str(r.program[r.pc]) for i, r in enumerate(self.ranks)
                         if not r.done}
                raise ProgramError(f"deadlock: {stuck}")
        raise ProgramError("program did not finish")
