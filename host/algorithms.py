"""Collective schedules (the sequencer's program library), written as generators.

Each program posts sends/receives through a :class:`Ctx` and yields the completions it
must wait for; the engine resumes it when they are done. Two rules keep results right:

* A region handed to ``send`` is not overwritten until that send has completed
  (acknowledged), because go-back-N may need to read it again.
* Every element of a reduction is combined by exactly one rank in a fixed order and
  then *copied* to the others, so floating-point results are bit-identical on every
  rank (recursive doubling is avoided for that reason).
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import numpy as np

from . import wire
from .engine import Engine
from .qp import Completion

Program = Generator[Any, None, None]


class Ctx:
    """What a program sees: its rank, the world, and posting primitives for one call."""

    def __init__(self, engine: Engine, rank: int, size: int, coll_id: int) -> None:
        self.engine = engine
        self.rank = rank
        self.size = size
        self.coll_id = coll_id & 0xFFFF

    def send(self, peer: int, step: int, arr: np.ndarray) -> Completion:
        return self.engine.send(peer, self.coll_id, step, memoryview(_bytes(arr)))

    def recv(self, peer: int, step: int, dest: np.ndarray, ufunc: Any | None = None,
             what: str = "recvbuf") -> Completion:
        return self.engine.recv(peer, self.coll_id, step, dest, ufunc, what)


def _bytes(arr: np.ndarray) -> np.ndarray:
    return arr.view(np.uint8).reshape(-1)


def chunk_bounds(n: int, parts: int) -> list[int]:
    """Offsets splitting n elements into ``parts`` nearly equal chunks."""
    base, extra = divmod(n, parts)
    out = [0]
    for i in range(parts):
        out.append(out[-1] + base + (1 if i < extra else 0))
    return out


# --------------------------------------------------------------------------- allreduce
def allreduce_ring(ctx: Ctx, work: np.ndarray, ufunc: Any) -> Program:
    """Reduce-scatter then allgather around the ring: 2(P-1)/P of the data per link."""
    p, r = ctx.size, ctx.rank
    if p == 1:
        return
    b = chunk_bounds(len(work), p)

    def chunk(c: int) -> np.ndarray:
        c %= p
        return work[b[c]:b[c + 1]]

    nxt, prv = (r + 1) % p, (r - 1) % p
    sends = []
    for s in range(p - 1):
        sends.append(ctx.send(nxt, s, chunk(r - s)))
        yield ctx.recv(prv, s, chunk(r - s - 1), ufunc)
    for t in range(p - 1):
        sends.append(ctx.send(nxt, p - 1 + t, chunk(r + 1 - t)))
        yield sends[t]  # chunk r-t left in reduce-scatter step t; it must be acked first
        yield ctx.recv(prv, p - 1 + t, chunk(r - t))
    yield sends


def _fold(p: int) -> tuple[int, int]:
    p2 = 1 << (p.bit_length() - 1)
    return p2, p - p2


def allreduce_rhd(ctx: Ctx, work: np.ndarray, ufunc: Any) -> Program:
    """Rabenseifner: recursive-halving reduce-scatter + recursive-doubling allgather.

    A non-power-of-two world first folds its extra ranks into partners (even ranks
    below 2*rem hand their data to the odd neighbour) and unfolds at the end.
    """
    p, r = ctx.size, ctx.rank
    if p == 1:
        return
    p2, rem = _fold(p)
    final = 0x7000
    if r < 2 * rem:
        if r % 2 == 0:
            yield ctx.send(r + 1, 0, work)
            yield ctx.recv(r + 1, final, work)
            return
        yield ctx.recv(r - 1, 0, work, ufunc)
        nr = r // 2
    else:
        nr = r - rem

    def real(n: int) -> int:
        return 2 * n + 1 if n < rem else n + rem

    lo, hi = 0, len(work)
    levels = []
    sends = []
    step = 1
    mask = p2 >> 1
    while mask:
        partner = real(nr ^ mask)
        mid = lo + (hi - lo) // 2
        keep, give = ((lo, mid), (mid, hi)) if not nr & mask else ((mid, hi), (lo, mid))
        sends.append(ctx.send(partner, step, work[give[0]:give[1]]))
        yield ctx.recv(partner, step, work[keep[0]:keep[1]], ufunc)
        levels.append((lo, hi, mask))
        lo, hi = keep
        mask >>= 1
        step += 1
    yield sends  # the allgather overwrites the halves given away above
    for plo, phi, m in reversed(levels):
        partner = real(nr ^ m)
        other = (hi, phi) if lo == plo else (plo, lo)
        sends.append(ctx.send(partner, step, work[lo:hi]))
        yield ctx.recv(partner, step, work[other[0]:other[1]])
        lo, hi = plo, phi
        step += 1
    if r < 2 * rem:
        sends.append(ctx.send(r - 1, final, work))
    yield sends


def allreduce_tree(ctx: Ctx, work: np.ndarray, ufunc: Any) -> Program:
    """Binomial reduce to rank 0, binomial broadcast back: 2 log P latency steps."""
    yield from reduce_tree(ctx, work, ufunc, 0, 0)
    yield from bcast_tree(ctx, work, 0, 0x100)


# --------------------------------------------------------------------------- reduce/bcast
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


def bcast_chain(ctx: Ctx, work: np.ndarray, root: int, segment: int) -> Program:
    """Pipelined chain: every rank forwards each segment as soon as it has it."""
    p, r = ctx.size, ctx.rank
    vr = (r - root) % p
    nseg = max(1, -(-len(work) // segment))
    nseg = min(nseg, wire.STEP_MAX)
    b = chunk_bounds(len(work), nseg)
    prv, nxt = (r - 1) % p, (r + 1) % p
    sends = []
    for i in range(nseg):
        seg = work[b[i]:b[i + 1]]
        if vr > 0:
            yield ctx.recv(prv, i, seg)
        if vr < p - 1:
            sends.append(ctx.send(nxt, i, seg))
    yield sends


# --------------------------------------------------------------------------- others
def reduce_scatter_ring(ctx: Ctx, work: np.ndarray, ufunc: Any, out: np.ndarray) -> Program:
    """Ring reduce-scatter leaving chunk r, fully reduced, on rank r (copied to ``out``)."""
    p, r = ctx.size, ctx.rank
    n = len(out)
    if p > 1:
        nxt, prv = (r + 1) % p, (r - 1) % p
        sends = []
        for s in range(p - 1):
            c_send, c_recv = (r - s - 1) % p, (r - s - 2) % p
            sends.append(ctx.send(nxt, s, work[c_send * n:(c_send + 1) * n]))
            yield ctx.recv(prv, s, work[c_recv * n:(c_recv + 1) * n], ufunc)
        yield sends
    out[:] = work[r * n:(r + 1) * n]


def allgather_ring(ctx: Ctx, out: np.ndarray, n: int) -> Program:
    p, r = ctx.size, ctx.rank
    if p == 1:
        return
    nxt, prv = (r + 1) % p, (r - 1) % p
    sends = []
    for s in range(p - 1):
        c_send, c_recv = (r - s) % p, (r - s - 1) % p
        sends.append(ctx.send(nxt, s, out[c_send * n:(c_send + 1) * n]))
        yield ctx.recv(prv, s, out[c_recv * n:(c_recv + 1) * n])
    yield sends


def alltoallv_direct(ctx: Ctx, send: np.ndarray, sdispl: list[int], scount: list[int],
                     recv: np.ndarray, rdispl: list[int], rcount: list[int]) -> Program:
    """Every pair exchanges directly; posts are staggered so no rank is hit by all at once."""
    p, r = ctx.size, ctx.rank
    recv[rdispl[r]:rdispl[r] + rcount[r]] = send[sdispl[r]:sdispl[r] + scount[r]]
    waits = []
    for s in range(1, p):
        to, frm = (r + s) % p, (r - s) % p
        waits.append(ctx.send(to, 0, send[sdispl[to]:sdispl[to] + scount[to]]))
        waits.append(ctx.recv(frm, 0, recv[rdispl[frm]:rdispl[frm] + rcount[frm]],
                              what="recvcounts"))
    yield waits


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
