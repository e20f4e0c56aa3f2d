"""The software backend runs the proto program library with results bit-identical to
the reference model (:class:`fpgaccl.sim.models.sequencer.SequencerModel`), which the
HDL sequencer is checked against too."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from fpgaccl.host.executor import reduce_into
from fpgaccl.proto.isa import Instr, SeqOp
from fpgaccl.proto.programs import LIBRARY
from fpgaccl.proto.reduce import SUPPORTED, DType, ReduceOp, reduce_reference
from fpgaccl.sim.models.sequencer import SequencerModel

from ._world import all_ok, run_world

WORLDS = (1, 2, 3, 4, 5, 8)
CASES = (("float32", "sum"), ("float16", "prod"), ("bfloat16", "min"), ("int32", "sum"),
         ("float64", "max"))


# send/recv run as a pair: rank 0 sends to the last rank, the others run nothing.
NAMES = [n for n in LIBRARY if not n.startswith("p2p_")] + ["p2p"]


def _program(name: str, rank: int, world: int) -> list:
    if name == "p2p":
        if world > 1 and rank == 0:
            return LIBRARY["p2p_send"](rank, world, world - 1)
        if world > 1 and rank == world - 1:
            return LIBRARY["p2p_recv"](rank, world, 0)
        return [Instr(SeqOp.SETUP, step=1), Instr(SeqOp.DONE)]
    gen = LIBRARY[name]
    if name in ("chain_broadcast", "chain_reduce", "gather", "scatter"):
        return gen(rank, world, root=1 % world)
    if name == "hierarchical_allreduce":
        return gen(rank, world, rows=2 if world % 2 == 0 else 1)
    return gen(rank, world)


def _count(name: str, world: int, k: int) -> int:
    n = 997 + 131 * k  # chunks of unequal length
    return n - n % world if name == "alltoall" else n


def _inputs(world: int, count: int, dtype: str, seed: int) -> list[np.ndarray]:
    dt = DType[dtype.upper()].numpy_dtype()
    rng = np.random.default_rng(seed)
    if dt.kind in "iu":
        return [rng.integers(-1000, 1000, count).astype(dt) for _ in range(world)]
    # Mixed magnitudes: a different summation order gives different bits.
    return [(rng.standard_normal(count) * 10.0 ** rng.integers(-3, 4, count)).astype(dt)
            for _ in range(world)]


def _defined(name: str, rank: int, world: int, got: np.ndarray, want: np.ndarray) -> tuple:
    """The parts of OUT a program defines: gather fills the root's alone, scatter chunk
    r of rank r (the rest is whatever the engine's memory held)."""
    root = 1 % world
    if (name == "gather" and rank != root) or (name == "p2p" and rank != world - 1) or (
            name in ("barrier", "p2p") and world == 1):
        return got[:0], want[:0]
    if name == "scatter":
        cs = -(-len(got) // world)
        return got[rank * cs:(rank + 1) * cs], want[rank * cs:(rank + 1) * cs]
    return got, want


def _rank_runs(comm) -> dict:
    out = {}
    for name in NAMES:
        for k, (dtype, op) in enumerate(CASES):
            count = _count(name, comm.world_size, k)
            xs = _inputs(comm.world_size, count, dtype, zlib.crc32(f"{name}{k}".encode()))
            prog = _program(name, comm.rank, comm.world_size)
            out[name, k] = comm.run_program(prog, xs[comm.rank], op)
    return out


@pytest.mark.parametrize("world", WORLDS)
def test_software_backend_equals_sequencer_model(world: int) -> None:
    res = all_ok(run_world(world, _rank_runs, timeout=180))
    for name in NAMES:
        for k, (dtype, op) in enumerate(CASES):
            count = _count(name, world, k)
            xs = _inputs(world, count, dtype, zlib.crc32(f"{name}{k}".encode()))
            progs = [_program(name, r, world) for r in range(world)]
            want = SequencerModel(progs, xs, DType[dtype.upper()], ReduceOp[op.upper()],
                                  seed=world).run()
            for r in range(world):
                got, exp = _defined(name, r, world, res[r][name, k], want[r])
                assert got.dtype == exp.dtype
                assert got.view(np.uint8).tobytes() == exp.view(np.uint8).tobytes(), (
                    f"{name} world={world} rank={r} {dtype} {op}")


# reduce_into's float sum/prod paths: a temporary for short vectors, NaN-tested inputs
# then straight into OUT, and cache-sized blocks for long ones (host/executor.py).
@pytest.mark.parametrize("n", [4096, 20_000, 140_000], ids=["short", "direct", "blocks"])
@pytest.mark.parametrize(("dtype", "op"), SUPPORTED,
                         ids=[f"{d.name}-{o.name}" for d, o in SUPPORTED])
def test_fast_reduction_equals_the_reference(dtype: DType, op: ReduceOp, n: int) -> None:
    rng = np.random.default_rng(int(dtype) * 16 + int(op))
    nt = dtype.numpy_dtype()
    bits = np.dtype(f"uint{dtype.bits}")
    # Random bit patterns: NaNs with payloads, infinities, subnormals, signed zeros.
    a = rng.integers(0, 1 << dtype.bits, n, dtype=np.uint64).astype(bits).view(nt)
    b = rng.integers(0, 1 << dtype.bits, n, dtype=np.uint64).astype(bits).view(nt)
    if dtype.is_float:
        specials = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1.0, -1.0], np.float64)
        a[:49] = np.repeat(specials, 7).astype(nt)
        b[:49] = np.tile(specials, 7).astype(nt)
    want = reduce_reference(dtype, op, a, b)
    out = a.copy()
    reduce_into(dtype, op, out, b, out)  # aliasing, as RECV_REDUCE OUT = op(OUT, TMP)
    assert out.view(bits).tobytes() == np.asarray(want).view(bits).tobytes()


@pytest.mark.parametrize("n", [3, 140_000], ids=["short", "blocks"])
@pytest.mark.parametrize("dtype", list(DType), ids=[d.name for d in DType])
def test_average_equals_the_reference(dtype: DType, n: int) -> None:
    # op="avg"'s scaling on the host (reduce_into's fast PROD for floats), aliasing its
    # input as the communicator's tree schedules make it, against proto's definition.
    from fpgaccl.host.executor import average_into
    from fpgaccl.proto.reduce import average_reference

    rng = np.random.default_rng(int(dtype))
    nt = dtype.numpy_dtype()
    bits = np.dtype(f"uint{dtype.bits}")
    x = rng.integers(0, 1 << dtype.bits, n, dtype=np.uint64).astype(bits).view(nt)
    for world in (1, 3, 6):
        want = average_reference(dtype, x, world)
        out = np.empty_like(x)
        average_into(dtype, x, world, out)
        assert out.view(bits).tobytes() == np.asarray(want).view(bits).tobytes()
        y = x.copy()
        average_into(dtype, y, world, y)
        assert y.view(bits).tobytes() == out.view(bits).tobytes()
