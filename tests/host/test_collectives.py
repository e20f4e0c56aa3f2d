"""Every collective x dtype x op against numpy, for world sizes 1, 2, 3, 4, 5 and 8."""

from __future__ import annotations

import pytest

from ._world import all_ok, run_world
from .cases import run_all

# Each world size also runs a different path MTU so segmentation is covered widely.
WORLDS = [(1, 4096), (2, 256), (3, 1024), (4, 4096), (5, 9000), (8, 2048)]


@pytest.mark.parametrize(("world", "mtu"), WORLDS, ids=[f"world{w}-mtu{m}" for w, m in WORLDS])
def test_every_collective_dtype_op(world: int, mtu: int) -> None:
    seed = 1000 + world
    res = all_ok(run_world(world, run_all, seed=seed, big=world in (2, 4),
                           comm_kw={"mtu": mtu, "deadline_s": 60}, timeout=240))
    fails = [f for r in res for f in r["fails"]]
    assert not fails, "\n".join(fails[:30])
    # Floating-point reductions must give the same bytes on every rank.
    digests = {r["digest"] for r in res}
    assert len(digests) == 1, "ranks disagree on float reduction results"


@pytest.mark.parametrize("nt", ["float16", "float32", "float64", "bfloat16"])
@pytest.mark.parametrize("opname", ["SUM", "PROD"])
def test_reduce_into_is_the_reference_bit_for_bit(nt: str, opname: str) -> None:
    # The executor's reduction (NaN-free inputs go straight into ``out``) against the
    # reference, with NaN payloads, infinities whose sum/product is NaN, signed zeros
    # and overflow, and ``out`` aliasing either input as RECV_REDUCE makes it do.
    import numpy as np

    from fpgaccl.host.buffers import DTYPES
    from fpgaccl.host.executor import reduce_into
    from fpgaccl.proto.reduce import DType, ReduceOp, reduce_reference

    dt = DTYPES[nt]
    dtype, op = DType.from_numpy(dt), ReduceOp[opname]
    rng = np.random.default_rng(7)
    specials = np.array([np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, 1.0, -1.5, 6e4, -6e4])
    for trial in range(60):
        n = int(rng.integers(0, 40))
        pick = trial % 4
        with np.errstate(over="ignore"):
            a = (rng.choice(specials[2:], n) if pick == 0 else rng.choice(specials, n)
                 if pick == 1 else rng.standard_normal(n)).astype(dt)
            b = (rng.choice(specials[2:], n) if pick in (0, 2) else
                 rng.standard_normal(n)).astype(dt)
        want = reduce_reference(dtype, op, a, b)
        for alias in ("none", "a", "b"):
            x, y = a.copy(), b.copy()
            out = np.empty_like(x) if alias == "none" else x if alias == "a" else y
            reduce_into(dtype, op, x, y, out)
            assert out.view(np.uint8).tobytes() == want.view(np.uint8).tobytes(), \
                (nt, opname, alias, a, b)


@pytest.mark.parametrize("nt", ["float16", "float32", "float64"])
@pytest.mark.parametrize("opname", ["SUM", "PROD"])
def test_long_reductions_go_block_by_block_bit_for_bit(nt: str, opname: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    # Vectors longer than the executor's cache block, cut mid-block: every element of
    # every block, with ``out`` aliasing either input, equals the reference, NaN-free
    # blocks and blocks with a NaN (an input NaN, or inf - inf / 0 * inf made inside
    # the block, on either side of a block boundary) alike. (On x86 the ufunc's own NaNs
    # already follow the reference's rule, so this checks the blocking, not the rule.)
    import numpy as np

    from fpgaccl.host import executor
    from fpgaccl.host.buffers import DTYPES
    from fpgaccl.proto.reduce import DType, ReduceOp, reduce_reference

    dt = np.dtype(DTYPES[nt])
    dtype, op = DType.from_numpy(dt), ReduceOp[opname]
    step = executor._BLOCK_BYTES // dt.itemsize
    n = 3 * step + 17
    rng = np.random.default_rng(11)
    a = rng.standard_normal(n).astype(dt)
    b = rng.standard_normal(n).astype(dt)
    a[step - 1], b[step - 1] = np.inf, (-np.inf if opname == "SUM" else 0.0)
    a[step], b[2 * step + 5] = dt.type(np.nan), -dt.type(np.nan)
    a[n - 1] = np.inf
    want = reduce_reference(dtype, op, a, b)
    clean = slice(step + 1, 2 * step)  # a block with no NaN in or out
    assert not np.isnan(want[clean]).any() and np.isnan(want[step - 1])
    real_fixup = executor.nan_fixup
    for alias in ("none", "a", "b"):
        x, y = a.copy(), b.copy()
        out = np.empty_like(x) if alias == "none" else x if alias == "a" else y
        seen = []

        def fixup(d, p, q, r, seen=seen, alias=alias):
            # The rule must see the block's own inputs, whichever path wrote ``out``.
            lo = len(seen) * step  # blocks 0, 1 and 2 have a NaN, in that order
            seen.append(lo)
            assert p.tobytes() == a[lo:lo + step].tobytes(), (nt, alias, lo)
            assert q.tobytes() == b[lo:lo + step].tobytes(), (nt, alias, lo)
            return real_fixup(d, p, q, r)

        monkeypatch.setattr(executor, "nan_fixup", fixup)
        executor.reduce_into(dtype, op, x, y, out)
        assert out.view(np.uint8).tobytes() == want.view(np.uint8).tobytes(), (nt, alias)
        assert seen == [0, step, 2 * step], (nt, alias, seen)


def test_cached_library_programs_keep_their_facts() -> None:
    # The communicator builds each library program once (a tuple) and the executor
    # remembers each tuple's chunk count and whether it writes IN; a list, or a new
    # program, is looked at afresh, and the answers agree with a direct reading.
    from fpgaccl.host.communicator import _library
    from fpgaccl.host.executor import setup_chunks, writes_in
    from fpgaccl.proto import programs as lib
    from fpgaccl.proto.isa import Buf, SeqOp

    for name in ("ring_allreduce", "rhd_allreduce", "ring_reduce_scatter", "ring_allgather",
                 "chain_broadcast", "chain_reduce", "alltoall"):
        gen = lib.LIBRARY[name]
        for world in (2, 3, 4, 5):
            for rank in range(world):
                listed = gen(rank, world)
                cached = _library(gen, rank, world)
                assert cached is _library(gen, rank, world) and list(cached) == listed
                nch = max((i.step for i in listed if i.op is SeqOp.SETUP), default=1)
                writes = (SeqOp.COPY, SeqOp.RECV, SeqOp.RECV_REDUCE)
                w_in = any((i.buf is Buf.IN and i.op in writes)
                           or (i.op is SeqOp.RECV_REDUCE and i.rbuf is Buf.IN) for i in listed)
                for prog in (cached, cached, listed):
                    assert setup_chunks(prog) == nch and writes_in(prog) == w_in


def _segmented_allreduce(comm) -> dict:
    # A vector several times the collective region: each segment's OUT is the caller's
    # result slice itself, bound over the region's OUT (peers' WRITEs land in it), so
    # the region's OUT is never written; in place (IN = OUT) and out of place alike.
    import numpy as np

    from fpgaccl.proto.isa import Buf
    n = 100_003
    rng = np.random.default_rng(17)
    xs = rng.standard_normal((comm.world_size, n)).astype(np.float32)
    results = {}
    for algo in ("ring", "rhd"):
        for inplace in (True, False):
            buf = xs[comm.rank].copy()
            out = comm.allreduce(buf, None if inplace else np.empty_like(buf), algo=algo)
            results[algo, inplace] = np.asarray(out).tobytes()
            if not inplace:
                assert np.array_equal(buf, xs[comm.rank])  # the input is left as it was
    region_out = comm.impl.region.view(Buf.OUT, np.dtype(np.uint8))
    _, nseg, _, _ = comm._segments((), m=n, blocks=1, dt=np.dtype(np.float32))
    return {"results": results, "xs": xs, "segments": nseg,
        "out_untouched": not region_out.any(), "window": comm.impl.region.mr.window}


@pytest.mark.parametrize("world", [3, 4])
def test_segmented_allreduce_lands_in_the_callers_buffer(world: int) -> None:
    import numpy as np

    res = all_ok(run_world(world, _segmented_allreduce, comm_kw={"stage_bytes": 64 << 10}))
    xs = res[0]["xs"]
    for r in res:
        assert r["segments"] > 4 and r["out_untouched"] and r["window"] is None
    for key, got in res[0]["results"].items():
        vals = np.frombuffer(got, np.float32)
        # Float sums in ring/rhd order differ from numpy's in the last bits; every rank
        # must agree byte for byte and be close to the exact sum.
        assert all(r["results"][key] == got for r in res), key
        assert np.allclose(vals, xs.astype(np.float64).sum(0), rtol=1e-5, atol=1e-5), key
    for algo in ("ring", "rhd"):  # same program, same order: in place changes no bit
        assert res[0]["results"][algo, True] == res[0]["results"][algo, False], algo


def _recv_posted_first(comm) -> dict:
    # MPI's Irecv / Isend / Waitall, and a receive posted before a collective: the
    # pending receive must hold back neither the send nor the allreduce behind it.
    import numpy as np

    r, p = comm.rank, comm.world_size
    nxt, prv = (r + 1) % p, (r - 1) % p
    got = np.zeros(1000, np.int64)
    hr = comm.recv(got, prv, async_op=True)
    x = np.full(64, r + 1, np.int32)
    comm.allreduce(x)                      # while the receive is pending
    hs = comm.send(np.arange(1000, dtype=np.int64) * (r + 1), nxt, async_op=True)
    hs.wait()
    hr.wait()
    return {"ring": bool(np.array_equal(got, np.arange(1000) * (prv + 1))),
            "sum": int(x[0]), "all_same": bool((x == x[0]).all())}


@pytest.mark.parametrize("world", [2, 3])
def test_a_receive_posted_first_holds_nothing_back(world: int) -> None:
    res = all_ok(run_world(world, _recv_posted_first, comm_kw={"deadline_s": 10},
                           timeout=60))
    for r in res:
        assert r["ring"] and r["all_same"] and r["sum"] == world * (world + 1) // 2, r


@pytest.mark.parametrize(("nbytes", "world", "algo"), [
    (8, 4, "rd"), (256 << 10, 3, "rd"), ((256 << 10) + 4, 3, "rhd"), (1 << 20, 5, "rhd"),
    ((1 << 20) + 4, 5, "ring"), ((1 << 20) + 4, 3, "ring"), (64 << 20, 6, "ring"),
    ((1 << 20) + 4, 4, "rhd"), (64 << 20, 4, "rhd"), (64 << 20, 8, "rhd"), (64 << 20, 2, "rhd"),
    (64 << 20, 1, "rhd"),
])
def test_the_default_allreduce_program(nbytes: int, world: int, algo: str) -> None:
    # Halving-doubling at every size past recursive doubling's in a world of 2^k ranks;
    # elsewhere the ring past 1 MiB, where the fold to 2^k ranks would cost a vector.
    from fpgaccl.host.communicator import _allreduce_default

    assert _allreduce_default(nbytes, world) == algo
