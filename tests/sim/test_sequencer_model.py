"""Every library program on the executable sequencer model, against numpy, under many
random interleavings -- and proof that the model catches a racy program."""

import numpy as np
import pytest

from fpgaccl.proto import programs as P
from fpgaccl.proto.isa import SeqOp
from fpgaccl.proto.reduce import DType, ReduceOp, reduce_reference
from fpgaccl.sim.models.sequencer import ProgramError, SequencerModel

WORLDS = [1, 2, 3, 4, 5, 8]
ALLREDUCES = ["ring_allreduce", "rhd_allreduce", "rd_allreduce"]
SEEDS = range(4)


def _inputs(world, n, dtype=np.int32, seed=0):
    rng = np.random.default_rng(seed)
    if np.issubdtype(dtype, np.floating):
        return [rng.standard_normal(n).astype(dtype) for _ in range(world)]
    return [rng.integers(-1000, 1000, n).astype(dtype) for _ in range(world)]


def _run(progs, xs, dtype=DType.INT32, op=ReduceOp.SUM, seed=0):
    return SequencerModel(progs, xs, dtype, op, seed=seed).run()


@pytest.mark.parametrize("name", ALLREDUCES)
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("n", [1, 7, 64])
def test_allreduce_programs(name, world, n):
    xs = _inputs(world, n, seed=world * n)
    for seed in SEEDS:
        outs = _run([P.LIBRARY[name](r, world) for r in range(world)], xs, seed=seed)
        for o in outs:
            np.testing.assert_array_equal(o, np.sum(xs, axis=0))


@pytest.mark.parametrize("pieces", [2, 3, 4])
@pytest.mark.parametrize("world", [2, 3, 4, 5])
@pytest.mark.parametrize("n", [5, 64, 1001])
def test_pipelined_ring_allreduce(pieces, world, n):
    """Each ring step as several messages (including empty ones when n is small)."""
    xs = _inputs(world, n, seed=world + n + pieces)
    for seed in SEEDS:
        outs = _run([P.ring_allreduce(r, world, pieces) for r in range(world)], xs,
                    seed=seed)
        for o in outs:
            np.testing.assert_array_equal(o, np.sum(xs, axis=0))


def test_pipelined_ring_needs_a_piece():
    with pytest.raises(ValueError, match="pieces"):
        P.ring_allreduce(0, 4, 0)


@pytest.mark.parametrize("name", ALLREDUCES)
@pytest.mark.parametrize("op", [ReduceOp.MAX, ReduceOp.BXOR, ReduceOp.PROD])
def test_allreduce_other_ops(name, op):
    world, n = 5, 33
    xs = _inputs(world, n, seed=3)
    want = xs[0]
    for x in xs[1:]:
        want = reduce_reference(DType.INT32, op, want, x)
    for o in _run([P.LIBRARY[name](r, world) for r in range(world)], xs, op=op, seed=1):
        np.testing.assert_array_equal(o, want)


@pytest.mark.parametrize("name", ALLREDUCES)
def test_float_results_are_bit_identical_across_ranks(name):
    world, n = 6, 101
    xs = _inputs(world, n, np.float32, seed=9)
    outs = _run([P.LIBRARY[name](r, world) for r in range(world)], xs, DType.FLOAT32, seed=2)
    for o in outs[1:]:
        assert o.tobytes() == outs[0].tobytes()
    np.testing.assert_allclose(outs[0], np.sum(xs, axis=0, dtype=np.float64), rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("name", ALLREDUCES)
@pytest.mark.parametrize("world", [2, 3, 4, 6, 8])
@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.MAX, ReduceOp.PROD])
def test_nan_payloads_agree_across_ranks(name, world, op):
    """Where two NaNs meet, the reference keeps the first operand's payload: a program in
    which each rank reduces its own result must still put the same operand first on
    every rank (recursive doubling puts the lower partner's first)."""
    n = 24
    xs = []
    for r in range(world):
        x = np.random.default_rng(r).standard_normal(n).astype(np.float32)
        x.view(np.uint32)[: n // 2] = 0x7FC00000 | (r * 131 + 7)  # a payload per rank
        xs.append(x)
    for seed in SEEDS:
        outs = _run([P.LIBRARY[name](r, world) for r in range(world)], xs, DType.FLOAT32,
                    op, seed=seed)
        for o in outs[1:]:
            assert o.tobytes() == outs[0].tobytes()
        assert np.isnan(outs[0][: n // 2]).all()


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16])
def test_recursive_doubling_in_any_world(world):
    """log2 steps plus the fold; its third landing reuses the first's scratch only after
    a grant, which the race-seeking interleavings would catch."""
    xs = _inputs(world, 9, seed=world + 40)
    for seed in range(8):
        outs = _run([P.rd_allreduce(r, world) for r in range(world)], xs, seed=seed)
        for o in outs:
            np.testing.assert_array_equal(o, np.sum(xs, axis=0))


@pytest.mark.parametrize("world", WORLDS)
def test_reduce_scatter_and_allgather(world):
    n = 3 * world + 1
    xs = _inputs(world, n, seed=world)
    cs = -(-n // world)
    total = np.sum(xs, axis=0)
    for seed in SEEDS:
        outs = _run([P.ring_reduce_scatter(r, world) for r in range(world)], xs, seed=seed)
        for r, o in enumerate(outs):
            np.testing.assert_array_equal(o[r * cs:(r + 1) * cs], total[r * cs:(r + 1) * cs])
        outs = _run([P.ring_allgather(r, world) for r in range(world)], xs, seed=seed)
        want = np.concatenate([xs[r][r * cs:(r + 1) * cs] for r in range(world)])
        for o in outs:
            np.testing.assert_array_equal(o, want)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("root", [0, 2])
def test_broadcast_and_reduce(world, root):
    root %= world
    xs = _inputs(world, 50, seed=root + world)
    for seed in SEEDS:
        outs = _run([P.chain_broadcast(r, world, root) for r in range(world)], xs, seed=seed)
        for o in outs:
            np.testing.assert_array_equal(o, xs[root])
        outs = _run([P.chain_reduce(r, world, root) for r in range(world)], xs, seed=seed)
        np.testing.assert_array_equal(outs[root], np.sum(xs, axis=0))


@pytest.mark.parametrize("world", WORLDS)
def test_alltoall(world):
    n = 4 * world
    xs = _inputs(world, n, seed=world + 1)
    cs = n // world
    for seed in SEEDS:
        outs = _run([P.alltoall(r, world) for r in range(world)], xs, seed=seed)
        for r, o in enumerate(outs):
            want = np.concatenate([xs[j][r * cs:(r + 1) * cs] for j in range(world)])
            np.testing.assert_array_equal(o, want)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("root", [0, 2])
@pytest.mark.parametrize("n", [1, 4, 23])
def test_gather_and_scatter(world, root, n):
    root %= world
    n *= world
    xs = _inputs(world, n, seed=world * 7 + root + n)
    cs = n // world
    for seed in SEEDS:
        outs = _run([P.gather(r, world, root) for r in range(world)], xs, seed=seed)
        want = np.concatenate([xs[r][r * cs:(r + 1) * cs] for r in range(world)])
        np.testing.assert_array_equal(outs[root], want)
        outs = _run([P.scatter(r, world, root) for r in range(world)], xs, seed=seed)
        for r, o in enumerate(outs):
            np.testing.assert_array_equal(o[r * cs:(r + 1) * cs], xs[root][r * cs:(r + 1) * cs])


@pytest.mark.parametrize("world,rows", [(4, 2), (6, 2), (6, 3), (8, 2), (8, 4)])
def test_hierarchical_allreduce_is_just_a_program(world, rows):
    xs = _inputs(world, 45, seed=world * rows)
    for seed in SEEDS:
        outs = _run([P.hierarchical_allreduce(r, world, rows) for r in range(world)], xs,
                    seed=seed)
        for o in outs:
            np.testing.assert_array_equal(o, np.sum(xs, axis=0))


def test_model_catches_a_racy_program():
    """Recursive halving with every step landing on the chunks it reduces (no packing of
    the scratch regions): a fast partner of a later step overwrites scratch data that an
    earlier step has not reduced yet, and some interleaving must give a wrong sum."""
    world, n = 8, 64
    xs = _inputs(world, n, seed=5)

    def racy(rank):
        return [P.Instr(i.op, i.buf, i.src, i.rbuf, i.peer, i.chunk, i.count, i.chunk, i.step)
                if i.rbuf is P.TMP and i.op in (SeqOp.SEND, SeqOp.RECV_REDUCE) else i
                for i in P.rhd_allreduce(rank, world)]

    wrong = 0
    for seed in range(40):
        outs = _run([racy(r) for r in range(world)], xs, seed=seed)
        wrong += any((o != np.sum(xs, axis=0)).any() for o in outs)
    assert wrong > 0


def test_deadlock_is_reported():
    prog = [P.Instr(SeqOp.SETUP, step=1), P.Instr(SeqOp.RECV, peer=1, step=0), P.DONE]
    with pytest.raises(ProgramError, match="deadlock"):
        _run([prog, prog], _inputs(2, 4))


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 7, 8, 9, 16])
def test_barrier_waits_for_every_rank(world):
    """Every rank gets through a barrier all ranks enter; where one rank never enters
    (its program ends at once), no other rank gets through."""
    n = P.barrier_elements(world)
    xs = _inputs(world, n, seed=world)
    for seed in SEEDS:
        _run([P.barrier(r, world) for r in range(world)], xs, seed=seed)
    for late in range(world if world > 1 else 0):
        progs = [P.barrier(k, world) for k in range(world)]
        progs[late] = [P.Instr(SeqOp.SETUP, step=1), P.DONE]
        model = SequencerModel(progs, xs, DType.INT32, ReduceOp.SUM, seed=late)
        with pytest.raises(ProgramError, match="deadlock"):
            model.run()
        assert not any(r.done for k, r in enumerate(model.ranks) if k != late)
