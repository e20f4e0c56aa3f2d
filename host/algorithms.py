"""Host schedules, written as generators, for what has no sequencer program yet.

The collectives the sequencer runs are programs in :mod:`fpgaccl.proto.programs`; what
has none (the ``tree`` algorithms, all-to-all-v, barrier) runs as one of these instead;
send/recv post through :class:`Ctx` directly. Each schedule posts sends/receives through
a :class:`Ctx` and yields the completions it must wait for; the engine resumes it when
they are done. Two rules keep results right:

* A region handed to ``send`` is not overwritten until that send has completed
  (acknowledged), because go-back-N may need to read it again.
* Every element of a reduction is combined by exactly one rank in a fixed order and
  then *copied* to the others, so floating-point results are bit-identical on every
  rank.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import numpy as np

from .engine import Engine

Program = Generator[Any, None, None]


class Ctx:
    """What a program sees: its rank, the world, and posting primitives for one call.
    With a ``check`` (:class:`fpgaccl.host.schedule_check.ScheduleCheck`), a peer's data
    lands only once its call signature agrees."""

    def __init__(self, engine: Engine, rank: int, size: int, coll_id: int,
                 check: Any = None) -> None:
        self.engine = engine
        self.rank = rank
        self.size = size
        self.coll_id = coll_id & 0xFFFF
        self.check = check

    def send(self, peer: int, step: int, arr: np.ndarray) -> Any:
        if self.check is None:
            return self.engine.send(peer, self.coll_id, step, memoryview(_bytes(arr)))
        return self.check.send(peer, step, memoryview(_bytes(arr)))

    def recv(self, peer: int, step: int, dest: np.ndarray, ufunc: Any | None = None,
             what: str = "recvbuf") -> Any:
        if self.check is None:
            return self.engine.recv(peer, self.coll_id, step, dest, ufunc, what)
        return self.check.recv(peer, step, dest, ufunc, what)


def _bytes(arr: np.ndarray) -> np.ndarray:
    return arr.view(np.uint8).reshape(-1)


def allreduce_tree(ctx: Ctx, work: np.ndarray, ufunc: Any) -> Program:
    """Binomial reduce to rank 0, binomial broadcast back: 2 log P latency steps."""
    yield from reduce_tree(ctx, work, ufunc, 0, 0)
    yield from bcast_tree(ctx, work, 0, 0x100)


def reduce_tree(ctx: Ctx, work: np.ndarray, ufunc: Any, root: int, step0: int) -> Program:
    p, r = ctx.size, ctx.rank
    vr = (r - root) % p
    mask, level = 1, 0
    while mask < p:
        if vr & mask:
            yield ctx.send((vr - mask + root) % p, step0 + level, work)
            return
        if vr + mask < p:
            yield ctx.recv((vr + mask + root) % p, step0 + level, work, ufunc)
        mask <<= 1
        level += 1


def bcast_tree(ctx: Ctx, work: np.ndarray, root: int, step: int) -> Program:
    p, r = ctx.size, ctx.rank
    vr = (r - root) % p
    mask = 1
    while mask < p:
        if vr & mask:
            yield ctx.recv((vr - mask + root) % p, step, work)
            break
        mask <<= 1
    mask >>= 1
    sends = []
    while mask:
        if vr + mask < p:
            sends.append(ctx.send((vr + mask + root) % p, step, work))
        mask >>= 1
    yield sends


def alltoallv_direct(ctx: Ctx, send: np.ndarray, sdispl: list[int], scount: list[int],
                     recv: np.ndarray, rdispl: list[int], rcount: list[int]) -> Program:
    """Every pair exchanges directly; posts are staggered so no rank is hit by all at once."""
    p, r = ctx.size, ctx.rank
    # Sends first: with a check, each then carries this rank's record to its peer.
    waits = [ctx.send(to, 0, send[sdispl[to]:sdispl[to] + scount[to]])
             for to in ((r + s) % p for s in range(1, p))]
    waits += [ctx.recv(frm, 0, recv[rdispl[frm]:rdispl[frm] + rcount[frm]], what="recvcounts")
              for frm in ((r - s) % p for s in range(1, p))]
    yield waits
    # Last: a call that fails its check leaves recv as it was.
    recv[rdispl[r]:rdispl[r] + rcount[r]] = send[sdispl[r]:sdispl[r] + scount[r]]


def barrier_dissemination(ctx: Ctx) -> Program:
    p, r = ctx.size, ctx.rank
    empty = np.zeros(0, np.uint8)
    k, step = 1, 0
    sends = []
    while k < p:
        sends.append(ctx.send((r + k) % p, step, empty))
        yield ctx.recv((r - k) % p, step, empty)
        k <<= 1
        step += 1
    yield sends
