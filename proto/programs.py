"""The library of collective programs, written in the sequencer ISA (:mod:`.isa`).

Each generator returns one rank's program. They are data, not hardware: a new
collective is a new function here (see :func:`hierarchical_allreduce`), loaded into the
engine's program memory with no re-synthesis, and run unchanged by the software engine.

Buffer conventions (``nchunks`` set by SETUP):
* allreduce, reduce, broadcast: IN and OUT hold the whole vector.
* reduce_scatter: rank r's result is OUT chunk r (of ``world`` chunks).
* allgather: rank r's contribution is IN chunk r; every rank ends with all of OUT.
* alltoall: IN chunk j goes to rank j; OUT chunk j came from rank j.
* gather: rank r's contribution is IN chunk r (of ``world``); the root's OUT ends with
  all of them. scatter: the root's IN chunk j goes to rank j's OUT chunk j.
* barrier: ``barrier_elements(world)`` elements whose values do not matter.
* p2p_send / p2p_recv: the sender's IN lands in the receiver's OUT; only the two ranks
  run a program (one message: tag 0).
"""

from __future__ import annotations

from .isa import Buf, Instr, SeqOp

OUT, TMP, TMP2, IN = Buf.OUT, Buf.TMP, Buf.TMP2, Buf.IN


def _setup(nchunks: int, copy: bool = True, chunk: int = 0, count: int | None = None):
    prog = [Instr(SeqOp.SETUP, step=nchunks)]
    if copy:
        prog.append(Instr(SeqOp.COPY, buf=OUT, src=IN, chunk=chunk,
                          count=nchunks if count is None else count))
    return prog


def _send(peer, chunk, step, rbuf, count=1, xchunk=None, src=OUT):
    return Instr(SeqOp.SEND, src=src, rbuf=rbuf, peer=peer, chunk=chunk, count=count,
                 xchunk=chunk if xchunk is None else xchunk, step=step)


def _grant(peer, step):
    return Instr(SeqOp.GRANT, peer=peer, step=step)


def _recv(peer, chunk, step, count=1):
    return Instr(SeqOp.RECV, buf=OUT, peer=peer, chunk=chunk, count=count, step=step)


def _recv_reduce(peer, chunk, step, count=1, scratch=TMP, xchunk=None, src=OUT):
    return Instr(SeqOp.RECV_REDUCE, buf=OUT, src=src, rbuf=scratch, peer=peer, chunk=chunk,
                 count=count, xchunk=chunk if xchunk is None else xchunk, step=step)


DONE = Instr(SeqOp.DONE)


def _ring_rs(ranks: list[int], me: int, block: int, base_step: int, scratch: Buf,
             pieces: int = 1, fresh: bool = False) -> list:
    """Ring reduce-scatter among ``ranks`` over blocks of ``block`` chunks; position i
    ends owning block i fully reduced. Each step's block goes as ``pieces`` messages
    (``block`` must be a multiple): piece j is reduced and passed on while piece j+1 is
    still on the wire, which keeps an engine that overlaps sending and reducing busy.

    ``fresh``: OUT was not set from IN first. Position i sends block i-1 at step 0 and
    reduces every other block exactly once, so step 0 can send straight from IN and each
    reduction take its own term from IN: no COPY of the whole vector up front (on the
    HDL node that copy alone took as long as a third of the collective)."""
    n, i = len(ranks), ranks.index(me)
    right, left = ranks[(i + 1) % n], ranks[(i - 1) % n]
    per = block // pieces
    msgs = (n - 1) * pieces
    mine = IN if fresh else OUT
    prog = [_grant(left, base_step + k) for k in range(msgs)]  # scratch blocks are disjoint
    for s in range(n - 1):
        out_b, in_b = (i - s - 1) % n, (i - s - 2) % n
        for j in range(pieces):
            step = base_step + s * pieces + j
            prog.append(_send(right, out_b * block + j * per, step, scratch, count=per,
                              src=mine if s == 0 else OUT))
            prog.append(_recv_reduce(left, in_b * block + j * per, step, count=per,
                                     scratch=scratch, src=mine))
    return prog


def _ring_ag_grants(ranks: list[int], me: int, base_step: int, pieces: int = 1) -> list:
    n, i = len(ranks), ranks.index(me)
    return [_grant(ranks[(i - 1) % n], base_step + k) for k in range((n - 1) * pieces)]


def _ring_ag(ranks: list[int], me: int, block: int, base_step: int, pieces: int = 1,
             grants: bool = True) -> list:
    """Ring allgather among ``ranks``: position i starts owning block i of OUT; blocks go
    as ``pieces`` messages each, as in :func:`_ring_rs`. ``grants=False``: the caller
    granted the landing regions already (:func:`_ring_ag_grants`)."""
    n, i = len(ranks), ranks.index(me)
    right, left = ranks[(i + 1) % n], ranks[(i - 1) % n]
    per = block // pieces
    # Granted only now: the blocks these land in were sources of earlier SENDs.
    prog = _ring_ag_grants(ranks, me, base_step, pieces) if grants else []
    for s in range(n - 1):
        for j in range(pieces):
            step = base_step + s * pieces + j
            prog.append(_send(right, ((i - s) % n) * block + j * per, step, OUT, count=per))
            prog.append(_recv(left, ((i - s - 1) % n) * block + j * per, step, count=per))
    return prog


def ring_allreduce(rank: int, world: int, pieces: int = 1) -> list[Instr]:
    """Ring reduce-scatter then ring allgather; ``pieces`` > 1 pipelines each step (see
    :func:`_ring_rs`) at the cost of ``pieces`` times the messages and instructions."""
    if pieces < 1:
        raise ValueError(f"pieces: at least 1, not {pieces}")
    ranks = list(range(world))
    fresh = world > 1   # a world of one only copies
    ag_base = (world - 1) * pieces
    # The allgather's grants go out with the reduce-scatter's, at the start: the blocks
    # the allgather lands in are this rank's RS sources, but a block can only come back
    # around the ring after the rank it was sent to received it whole, i.e. after this
    # rank's SEND read it (a later go-back-N re-read only makes duplicates the peer
    # drops). Granting at the boundary instead would wait there for everything in
    # flight, the last reduction included: about 4% of the link.
    rs = _ring_rs(ranks, rank, pieces, 0, TMP, pieces, fresh)
    n_rs_grants = (world - 1) * pieces   # grants are consumed in step order
    return (_setup(world * pieces, copy=not fresh) + rs[:n_rs_grants]
            + _ring_ag_grants(ranks, rank, ag_base, pieces) + rs[n_rs_grants:]
            + _ring_ag(ranks, rank, pieces, ag_base, pieces, grants=False) + [DONE])


def ring_reduce_scatter(rank: int, world: int) -> list[Instr]:
    # Copies IN to OUT first (unlike the allreduce) so every chunk of OUT is defined:
    # the other ranks' chunks hold this rank's partial sums.
    return _setup(world) + _ring_rs(list(range(world)), rank, 1, 0, TMP) + [DONE]


def ring_allgather(rank: int, world: int) -> list[Instr]:
    return (_setup(world, chunk=rank, count=1)
            + _ring_ag(list(range(world)), rank, 1, 0) + [DONE])


def chain_broadcast(rank: int, world: int, root: int = 0, segments: int = 4) -> list[Instr]:
    """Pipelined chain root -> root+1 -> ...: segment k is forwarded as soon as it lands."""
    pos = (rank - root) % world
    nxt, prev = (rank + 1) % world, (rank - 1) % world
    prog = _setup(segments, copy=pos == 0)
    if pos > 0:
        prog += [_grant(prev, k) for k in range(segments)]
    for k in range(segments):
        if pos > 0:
            prog.append(_recv(prev, k, k))
        if pos < world - 1:
            prog.append(_send(nxt, k, k, OUT))
    return [*prog, DONE]


def chain_reduce(rank: int, world: int, root: int = 0, segments: int = 4) -> list[Instr]:
    """Pipelined chain from the rank farthest from ``root`` towards it; only the root's
    OUT holds the result."""
    pos = (rank - root) % world
    towards, away = (rank - 1) % world, (rank + 1) % world
    prog = _setup(segments)
    if pos < world - 1:
        prog += [_grant(away, k) for k in range(segments)]
    for k in range(segments):
        if pos < world - 1:
            prog.append(_recv_reduce(away, k, k))
        if pos > 0:
            prog.append(_send(towards, k, k, TMP))
    return [*prog, DONE]


def rhd_allreduce(rank: int, world: int) -> list[Instr]:
    """Recursive halving reduce-scatter + recursive doubling allgather (Rabenseifner).

    A world that is not a power of two first folds: of the first ``2*rem`` ranks, each
    even one hands its vector to its odd neighbour (landing in TMP2) and waits for the
    result at the end.
    """
    p = 1 << (world.bit_length() - 1)
    rem = world - p
    # OUT is not set from IN first (a world of one only copies): each rank's first SEND
    # and first reduction take its own term from IN, as in the ring (see _ring_rs).
    fresh = world > 1
    prog = _setup(p, copy=not fresh)
    final_step = 1 + 2 * p.bit_length()
    mine = IN if fresh else OUT
    if rank < 2 * rem and rank % 2 == 0:
        prog.append(_send(rank + 1, 0, 0, TMP2, count=p, src=mine))
        prog.append(_grant(rank + 1, final_step))
        prog.append(_recv(rank + 1, 0, final_step, count=p))
        return [*prog, DONE]
    if rank < 2 * rem:
        prog.append(_grant(rank - 1, 0))
        prog.append(_recv_reduce(rank - 1, 0, 0, count=p, scratch=TMP2, src=mine))
        mine = OUT   # the fold wrote all of OUT
        nr = rank // 2
    else:
        nr = rank - rem

    def real(n: int) -> int:
        return 2 * n + 1 if n < rem else n + rem

    # Halving: step k's scratch chunks are packed after step k-1's, so no two steps'
    # messages land on the same chunks.
    lo, size, tbase, dist, step = 0, p, 0, p // 2, 1
    plan = []
    while dist >= 1:
        plan.append((lo, size, tbase, dist, step))
        half = size // 2
        lo = lo if nr & dist == 0 else lo + half
        size, tbase, dist, step = half, tbase + half, dist // 2, step + 1
    # The doubling's grants go out with the halving's, at the start, in step order (the
    # order each partner consumes them in). What a doubling step lands in OUT is the
    # half this rank gave away at the halving step of the same distance: the partner can
    # only send it back after it received that give whole and reduced it (so this
    # rank's SEND read it: a later go-back-N re-read only makes duplicates the partner
    # drops), and no later reduction here writes it (they stay inside what this rank
    # keeps). Granting just before each doubling step cost a grant round trip per step.
    prog += [_grant(real(nr ^ d), st) for (_, _, _, d, st) in plan]
    prog += [_grant(real(nr ^ d), st + p.bit_length()) for (_, _, _, d, st) in reversed(plan)]
    for lo_, size_, tb, d, st in plan:
        half = size_ // 2
        keep = lo_ if nr & d == 0 else lo_ + half
        give = lo_ + half if nr & d == 0 else lo_
        prog.append(_send(real(nr ^ d), give, st, TMP, count=half, xchunk=tb, src=mine))
        prog.append(_recv_reduce(real(nr ^ d), keep, st, count=half, xchunk=tb, src=mine))
        mine = OUT   # later steps work inside `keep`, reduced into OUT
    # Doubling: mirror the plan; each step sends what this rank owns to the partner,
    # which is exactly the region that partner does not own yet.
    own_lo, own = lo, size
    for lo_, size_, _tb, d, st in reversed(plan):
        partner_lo = lo_ if own_lo != lo_ else lo_ + size_ // 2
        prog.append(_send(real(nr ^ d), own_lo, st + p.bit_length(), OUT, count=own))
        prog.append(_recv(real(nr ^ d), partner_lo, st + p.bit_length(), count=own))
        own_lo, own = lo_, size_
    if rank < 2 * rem:
        prog.append(_send(rank - 1, 0, final_step, OUT, count=p))
    return [*prog, DONE]


def rd_allreduce(rank: int, world: int) -> list[Instr]:
    """Recursive doubling: log2(world) steps, each exchanging the whole vector with one
    partner and reducing it in. Half the steps of :func:`rhd_allreduce` for twice its
    bytes on the wire: the small-message choice, where a step costs its latency.

    Every rank computes its own result, so results agree bit for bit only if both
    partners of a step compute the same thing: each puts the lower virtual rank's
    vector first (the reference's NaN rule keeps the first operand's payload, so the
    operation is not commutative in general). A partner's vector lands in scratch, and
    the higher partner reduces ``op(scratch, OUT)`` into OUT rather than
    ``op(OUT, scratch)``.

    OUT is set from IN first: every step's SEND reads all of OUT while its reduction
    writes all of OUT (the engine holds the write until the peer acknowledged, see the
    ISA's ordering rules); starting from IN instead would let a go-back-N re-read of IN
    see the reduction's result when the caller runs in place (IN and OUT one address).

    A world that is not a power of two folds first, as :func:`rhd_allreduce` does.
    Landings alternate between TMP and TMP2 in the order a rank reduces them, so the
    grant for its third landing waits until the first one has been reduced.
    """
    p = 1 << (world.bit_length() - 1)
    rem = world - p
    steps = p.bit_length() - 1
    final_step = steps + 1
    prog = _setup(1)
    if world == 1:
        return [*prog, DONE]

    def folds_in(r: int) -> bool:  # an odd rank of the fold: its first landing is the fold
        return r < 2 * rem and r % 2 == 1

    def landing(r: int, k: int) -> Buf:  # where rank r reduces doubling step k from
        return TMP if (k + folds_in(r)) % 2 == 0 else TMP2

    if rank < 2 * rem and rank % 2 == 0:
        prog.append(_send(rank + 1, 0, 0, TMP, src=OUT))
        prog.append(_grant(rank + 1, final_step))
        prog.append(_recv(rank + 1, 0, final_step))
        return [*prog, DONE]

    def real(n: int) -> int:
        return 2 * n + 1 if n < rem else n + rem

    nr = rank // 2 if rank < 2 * rem else rank - rem
    # (peer, step, landing, this rank's vector goes first) in the order reduced
    reductions = []
    if folds_in(rank):
        reductions.append((rank - 1, 0, TMP, False))
    reductions += [(real(nr ^ (1 << k)), 1 + k, landing(rank, k), nr & (1 << k) == 0)
                   for k in range(steps)]
    prog += [_grant(peer, st) for peer, st, _, _ in reductions[:2]]
    for j, (peer, st, land, first) in enumerate(reductions):
        if st:  # a doubling step sends before it reduces; the fold only receives
            k = st - 1
            prog.append(_send(peer, 0, st, landing(peer, k), src=OUT))
        src, scratch = (OUT, land) if first else (land, OUT)
        prog.append(Instr(SeqOp.RECV_REDUCE, buf=OUT, src=src, rbuf=scratch, peer=peer,
                          chunk=0, count=1, xchunk=0, step=st))
        if j + 2 < len(reductions):  # that landing is free again: grant the next one
            prog.append(_grant(reductions[j + 2][0], reductions[j + 2][1]))
    if folds_in(rank):
        prog.append(_send(rank - 1, 0, final_step, OUT))
    return [*prog, DONE]


def alltoall(rank: int, world: int) -> list[Instr]:
    """Pairwise exchange: step s sends to rank+s and receives from rank-s. The element
    count must be a multiple of ``world`` (one equal block per peer)."""
    prog = _setup(world, chunk=rank, count=1)
    prog += [_grant((rank - s) % world, s) for s in range(1, world)]
    for s in range(1, world):
        dst, src = (rank + s) % world, (rank - s) % world
        prog.append(_send(dst, dst, s, OUT, xchunk=rank, src=IN))
        prog.append(_recv(src, src, s))
    return [*prog, DONE]


def gather(rank: int, world: int, root: int = 0) -> list[Instr]:
    """Every rank's chunk straight to the root, one message each (step 0: each peer
    sends the root one message, and tags are per peer)."""
    if rank == root:
        others = [(root + k) % world for k in range(1, world)]
        return (_setup(world, chunk=root, count=1) + [_grant(p, 0) for p in others]
                + [_recv(p, p, 0) for p in others] + [DONE])
    return [*_setup(world, copy=False), _send(root, rank, 0, OUT, src=IN), DONE]


def scatter(rank: int, world: int, root: int = 0) -> list[Instr]:
    """The root sends chunk j of its IN to rank j, in rank order after itself."""
    if rank == root:
        others = [(root + k) % world for k in range(1, world)]
        return (_setup(world, chunk=root, count=1)
                + [_send(p, p, 0, OUT, src=IN) for p in others] + [DONE])
    return [*_setup(world, copy=False), _grant(root, 0), _recv(root, rank, 0), DONE]


def barrier_elements(world: int) -> int:
    """Elements a :func:`barrier` runs over: one per round (at least one)."""
    return max(1, (world - 1).bit_length())


def barrier(rank: int, world: int) -> list[Instr]:
    """Dissemination barrier: in round k a rank sends one element to rank + 2^k and waits
    for rank - 2^k's, so after ceil(log2 world) rounds every rank has heard, directly or
    through others, from every rank that entered. Round k lands in chunk k: every
    landing has its own place (and is granted up front), and the 2^k are distinct mod
    the world, so no two rounds share a peer's message order."""
    rounds = barrier_elements(world) if world > 1 else 0
    prog = _setup(max(1, rounds), copy=False)
    prog += [_grant((rank - (1 << k)) % world, k) for k in range(rounds)]
    for k in range(rounds):
        prog.append(_send((rank + (1 << k)) % world, k, k, OUT, src=IN))
        prog.append(_recv((rank - (1 << k)) % world, k, k))
    return [*prog, DONE]


def p2p_send(rank: int, world: int, dst: int | None = None) -> list[Instr]:
    """send: all of IN to ``dst``'s OUT (default: the next rank), once ``dst`` has
    granted it (its p2p_recv)."""
    dst = (rank + 1) % world if dst is None else dst
    return [*_setup(1, copy=False), _send(dst, 0, 0, OUT, src=IN), DONE]


def p2p_recv(rank: int, world: int, src: int | None = None) -> list[Instr]:
    """recv: grant ``src`` (default: the previous rank) and wait for its message in OUT."""
    src = (rank - 1) % world if src is None else src
    return [*_setup(1, copy=False), _grant(src, 0), _recv(src, 0, 0), DONE]


def hierarchical_allreduce(rank: int, world: int, rows: int) -> list[Instr]:
    """2D allreduce on a ``rows`` x ``world/rows`` grid, added purely as a program:
    ring reduce-scatter along the row, ring allreduce of the owned block down the column
    (its own scratch, TMP2, so it cannot collide with row traffic), ring allgather back
    along the row."""
    if world % rows:
        raise ValueError(f"world {world} is not a multiple of rows {rows}")
    cols = world // rows
    row, col = divmod(rank, cols)
    row_ranks = [row * cols + c for c in range(cols)]
    col_ranks = [r * cols + col for r in range(rows)]
    pos = row_ranks.index(rank)
    prog = _setup(rows * cols)
    prog += _ring_rs(row_ranks, rank, rows, 0, TMP)
    # Column phase on the block this rank owns: blocks are `rows` chunks, one per column
    # member, so the column ring runs over single chunks inside the block.
    col_prog = _ring_rs(col_ranks, rank, 1, cols, TMP2) + _ring_ag(col_ranks, rank, 1,
                                                                    cols + rows)
    for ins in col_prog:
        if ins.op in (SeqOp.SEND, SeqOp.RECV, SeqOp.RECV_REDUCE):
            ins = Instr(ins.op, ins.buf, ins.src, ins.rbuf, ins.peer,
                        ins.chunk + pos * rows, ins.count, ins.xchunk + pos * rows, ins.step)
        prog.append(ins)
    prog += _ring_ag(row_ranks, rank, rows, cols + 2 * rows)
    return [*prog, DONE]


LIBRARY = {
    "ring_allreduce": ring_allreduce,
    "rhd_allreduce": rhd_allreduce,
    "rd_allreduce": rd_allreduce,
    "ring_reduce_scatter": ring_reduce_scatter,
    "ring_allgather": ring_allgather,
    "chain_broadcast": chain_broadcast,
    "chain_reduce": chain_reduce,
    "alltoall": alltoall,
    "gather": gather,
    "scatter": scatter,
    "barrier": barrier,
    "p2p_send": p2p_send,
    "p2p_recv": p2p_recv,
    "hierarchical_allreduce": hierarchical_allreduce,
}
