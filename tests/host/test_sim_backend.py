"""The sim backend: one user script, run unchanged by ``fpgaccl run -n 4`` on the software
backend and on ``--backend sim`` (four HDL nodes of the standard Verilator cluster behind
the simulation server): every collective with a library program (gather and scatter, every
op on uint16/32/64 with wraparound, and avg included) bit-exact against numpy for integers
and bit-identical to the software backend for every dtype; unsupported calls raise typed
errors naming the argument."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from fpgaccl.errors import BackendUnavailableError, UnsupportedError
from fpgaccl.host import Communicator
from fpgaccl.host.backends.sim import SOCKET_ENV
from fpgaccl.sim.server import build_env

from .cases import overlapping_want

WORLD = 4

SCRIPT = textwrap.dedent("""
    import os
    import sys

    import numpy as np

    import fpgaccl
    from fpgaccl.errors import CollectiveTimeoutError, UnsupportedError

    comm = fpgaccl.init()
    r, p = comm.rank, comm.world_size
    rng = np.random.default_rng(100 + r)
    n = 1200
    xi = rng.integers(-1000, 1000, n, dtype=np.int32)
    xf = (rng.standard_normal(n) * 100).astype(np.float32)
    res = {"in_i": xi, "in_f": xf}
    res["allreduce_i"] = comm.allreduce(xi, np.empty_like(xi))
    res["allreduce_f"] = comm.allreduce(xf, np.empty_like(xf))
    res["allreduce_ring_f"] = comm.allreduce(xf, np.empty_like(xf), algo="ring")
    res["reduce_i"] = comm.reduce(xi, np.zeros_like(xi), root=2)
    res["reduce_scatter_i"] = comm.reduce_scatter(xi, np.empty(n // p, np.int32))
    res["reduce_scatter_f"] = comm.reduce_scatter(xf, np.empty(n // p, np.float32))
    res["allgather_i"] = comm.allgather(xi[:300], np.empty(300 * p, np.int32))
    b = xi.copy() if r == 1 else np.zeros_like(xi)
    comm.broadcast(b, root=1)
    res["broadcast_i"] = b
    res["alltoall_i"] = comm.alltoall(xi, np.empty_like(xi))
    res["gather_i"] = comm.gather(xi[:300], np.empty(300 * p, np.int32) if r == 3 else None,
                                  root=3)
    res["scatter_i"] = comm.scatter(xi if r == 0 else None, np.empty(n // p, np.int32), root=0)
    res["avg_f"] = comm.allreduce(xf, np.empty_like(xf), op="avg")
    # send/recv around the ring; on the HDL a send waits for its receiver, so odd ranks
    # receive first
    got = np.empty(500, np.int32)
    if r % 2 == 0:
        comm.send(xi[:500], (r + 1) % p)
        comm.recv(got, (r - 1) % p)
    else:
        comm.recv(got, (r - 1) % p)
        comm.send(xi[:500], (r + 1) % p)
    res["sendrecv_i"] = got
    # MoE-style uneven blocks: rank i sends (i + 2 j) % 5 * 7 elements to rank j
    cnt = [[(i + 2 * j) % 5 * 7 for j in range(p)] for i in range(p)]
    recvcounts = [cnt[i][r] for i in range(p)]
    res["alltoallv_i"] = comm.alltoallv(xi[:sum(cnt[r])], cnt[r],
                                        np.empty(sum(recvcounts), np.int32), recvcounts)
    res["reduce_scatter_avg_i"] = comm.reduce_scatter(xi, np.empty(n // p, np.int32), op="avg")
    for dt in (np.uint16, np.uint32, np.uint64):
        x = rng.integers(0, np.iinfo(dt).max, 40, dtype=dt, endpoint=True)  # sums wrap
        res[f"in_{dt.__name__}"] = x
        for op in ("sum", "prod", "min", "max", "band", "bor", "bxor", "avg"):
            res[f"allreduce_{dt.__name__}_{op}"] = comm.allreduce(x, np.empty_like(x), op=op)
    if comm.backend == "sim":
        try:
            comm.allreduce(xi, np.empty_like(xi), algo="tree")
        except UnsupportedError as e:
            res["tree_error"] = np.array(e.argument)
        res["cycles"] = np.array(comm.impl.total_cycles)
    comm.barrier()
    np.savez(f"{sys.argv[1]}/rank{r}.npz", **{k: v for k, v in res.items() if v is not None})
    print(f"rank {r} done on {comm.backend}", flush=True)
    if comm.backend == "sim":
        # A rank that leaves: the others' next collective fails with a timeout error
        # instead of hanging.
        if r == 3:
            os._exit(0)
        try:
            comm.allreduce(xi, np.empty_like(xi))
            gone = "completed"
        except CollectiveTimeoutError as e:
            gone = str(e)
        with open(f"{sys.argv[1]}/gone{r}.txt", "w") as f:
            f.write(gone)
""")


@pytest.fixture(scope="module")
def cluster():
    from fpgaccl.sim.hdl.cluster import build_standard
    return build_standard()   # the build tests/sim/test_cluster.py shares


def launch(tmp_path, backend, cluster, *options):
    out = tmp_path / (backend + "".join(options))
    out.mkdir()
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    proc = subprocess.run(
        [sys.executable, "-m", "fpgaccl.host.cli", "run", "-n", str(WORLD), "--backend",
         backend, *options, "--timeout", "300", "--", sys.executable, str(script), str(out)],
        capture_output=True, text=True, timeout=400, env={**os.environ, **build_env(*cluster)})
    assert proc.returncode == 0, f"{backend}:\n{proc.stdout}\n{proc.stderr}"
    return [dict(np.load(out / f"rank{r}.npz")) for r in range(WORLD)], proc


@pytest.mark.slow
def test_same_script_on_sim_and_software(cluster, tmp_path):
    t0 = time.monotonic()
    sim, sim_proc = launch(tmp_path, "sim", cluster)
    t1 = time.monotonic()
    soft, _ = launch(tmp_path, "software", cluster)
    print(f"sim run {t1 - t0:.1f} s, software run {time.monotonic() - t1:.1f} s")
    print(sim_proc.stderr)
    p, n = WORLD, 1200
    xi = [sim[r]["in_i"] for r in range(p)]
    total = np.sum(xi, axis=0, dtype=np.int32)
    m = n // p
    for r in range(p):
        s = sim[r]
        assert s["allreduce_i"].tobytes() == total.tobytes()
        assert s["reduce_scatter_i"].tobytes() == total[r * m:(r + 1) * m].tobytes()
        assert s["allgather_i"].tobytes() == np.concatenate([x[:300] for x in xi]).tobytes()
        assert s["broadcast_i"].tobytes() == xi[1].tobytes()
        want = np.concatenate([xi[i][r * m:(r + 1) * m] for i in range(p)])
        assert s["alltoall_i"].tobytes() == want.tobytes()
        if r == 2:
            assert s["reduce_i"].tobytes() == total.tobytes()
        if r == 3:
            assert s["gather_i"].tobytes() == np.concatenate([x[:300] for x in xi]).tobytes()
        else:
            assert "gather_i" not in s
        assert s["scatter_i"].tobytes() == xi[0][r * m:(r + 1) * m].tobytes()
        assert s["sendrecv_i"].tobytes() == xi[(r - 1) % p][:500].tobytes()
        cnt = [[(i + 2 * j) % 5 * 7 for j in range(p)] for i in range(p)]
        want = np.concatenate([xi[i][sum(cnt[i][:r]):sum(cnt[i][:r + 1])] for i in range(p)])
        assert s["alltoallv_i"].tobytes() == want.tobytes()
        want = total[r * m:(r + 1) * m]
        assert s["reduce_scatter_avg_i"].tolist() == [
            v // p if v >= 0 else -(-v // p) for v in want.tolist()]
        for dt in ("uint16", "uint32", "uint64"):
            ins = [sim[i][f"in_{dt}"] for i in range(p)]
            for op, fn in (("sum", np.add), ("prod", np.multiply), ("min", np.minimum),
                           ("max", np.maximum), ("band", np.bitwise_and),
                           ("bor", np.bitwise_or), ("bxor", np.bitwise_xor)):
                acc = ins[0].copy()
                for x in ins[1:]:
                    fn(acc, x, out=acc)   # wraps modulo 2**bits, as the engine does
                assert s[f"allreduce_{dt}_{op}"].tobytes() == acc.tobytes(), (dt, op)
                if op == "sum":
                    assert s[f"allreduce_{dt}_avg"].tolist() == [v // p for v in acc.tolist()]
        assert str(s["tree_error"]) == "algo"
        assert int(s["cycles"]) > 0
        # Bit-identical to the software backend, floats included.
        for key, val in soft[r].items():
            assert s[key].tobytes() == val.tobytes(), f"rank {r}: {key} differs"
        np.testing.assert_allclose(s["allreduce_f"], np.sum([x["in_f"] for x in sim], 0),
                                   rtol=1e-4, atol=1e-2)
        if r < 3:
            gone = (tmp_path / "sim" / f"gone{r}.txt").read_text()
            # Survivors exit after their own failure, so a slower one may also see them
            # gone; rank 3 must always be among the ranks the error names.
            named = re.search(r"rank ([\d, ]+) left the world", gone)
            assert named, gone
            assert 3 in {int(x) for x in named.group(1).split(",")}, gone
    # The server's run summary.
    assert "fpgaccl sim: 4 of 4 nodes" in sim_proc.stderr
    assert "0 errors" in sim_proc.stderr
    # 2% of frames dropped by the simulated switch: retransmitted, same bits.
    lossy, lossy_proc = launch(tmp_path, "sim", cluster, "--sim-loss", "0.02")
    print(lossy_proc.stderr)
    dropped = re.search(r"switch dropped (\d+) frames, (\d+) retransmissions",
                        lossy_proc.stderr)
    assert dropped and int(dropped[1]) > 0 and int(dropped[2]) > 0, lossy_proc.stderr
    for r in range(p):
        for key, val in soft[r].items():
            assert lossy[r][key].tobytes() == val.tobytes(), f"lossy rank {r}: {key} differs"


MISMATCH_SCRIPT = textwrap.dedent("""
    import json
    import sys

    import numpy as np

    import fpgaccl
    from fpgaccl.errors import CollectiveMismatchError

    comm = fpgaccl.init()
    r = comm.rank
    out = {}
    for case, op, dt, n in (("op", "max" if r == 2 else "sum", "int32", 100),
                            ("dtype", "sum", "float32" if r == 1 else "int32", 100),
                            ("count", "sum", "int32", 99 if r == 3 else 100)):
        x = np.arange(n).astype(dt) + r
        y = np.full_like(x, 7)
        xs, ys = x.copy(), y.copy()
        try:
            comm.allreduce(x, y, op=op)
            out[case] = ["returned"]
        except CollectiveMismatchError as e:
            out[case] = [type(e).__name__, e.field, list(e.ranks), list(e.values),
                         bool(np.array_equal(x, xs) and np.array_equal(y, ys))]
    # Per-peer counts: rank i sends (i + j) % 3 + 1 to rank j; rank 3 sends rank 1 one more.
    sc = [(r + j) % 3 + 1 + (r == 3 and j == 1) for j in range(4)]
    rc = [(i + r) % 3 + 1 for i in range(4)]
    x, y = np.arange(16, dtype=np.int32), np.full(16, 7, np.int32)
    try:
        comm.alltoallv(x, sc, y, rc)
        out["counts"] = ["returned"]
    except CollectiveMismatchError as e:
        out["counts"] = [type(e).__name__, e.field, list(e.ranks), list(e.values),
                         bool(np.array_equal(x, np.arange(16)) and (y == 7).all())]
    x = np.arange(100, dtype=np.int32) + r
    out["after"] = comm.allreduce(x, np.empty_like(x)).tolist()
    with open(f"{sys.argv[1]}/rank{r}.json", "w") as f:
        json.dump(out, f)
""")


@pytest.mark.slow
def test_ranks_that_disagree_fail_alike_on_sim(cluster, tmp_path):
    """Issue 28 on the sim backend: op, dtype (of the same size), count and alltoallv
    per-peer count differences raise CollectiveMismatchError on every rank, naming the
    field and both sides, with no buffer written; the world goes on. The simulation
    server compares the ranks' signatures before it rings any node."""
    script = tmp_path / "mismatch.py"
    script.write_text(MISMATCH_SCRIPT)
    proc = subprocess.run(
        [sys.executable, "-m", "fpgaccl.host.cli", "run", "-n", str(WORLD), "--backend",
         "sim", "--timeout", "300", "--", sys.executable, str(script), str(tmp_path)],
        capture_output=True, text=True, timeout=400,
        env={**os.environ, **build_env(*cluster), "FPGACCL_CHECK_CALLS": "1"})
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    want = {"op": ([0, 2], ["sum", "max"]), "dtype": ([0, 1], ["int32", "float32"]),
            "count": ([0, 3], ["100", "99"]),
            "counts": ([3, 1], ["sends 3 to rank 1", "expects 2 from rank 3"])}
    for r in range(WORLD):
        for case, (ranks, values) in want.items():
            name, field, e_ranks, e_values, unchanged = got[r][case]
            assert name.startswith("Collective") and field == case, (r, got[r][case])
            assert e_ranks == ranks and e_values == values and unchanged, (r, got[r][case])
        assert got[r]["after"] == [4 * i + 6 for i in range(100)]


def test_world_larger_than_the_cluster_is_a_typed_error():
    with pytest.raises(UnsupportedError) as e:
        Communicator(0, 5, backend="sim")
    assert e.value.argument == "world_size"
    proc = subprocess.run([sys.executable, "-m", "fpgaccl.host.cli", "run", "-n", "5",
                           "--backend", "sim", "--", "true"], capture_output=True, text=True)
    assert proc.returncode == 2 and "at most 4" in proc.stderr


def test_sim_without_a_server(monkeypatch):
    monkeypatch.delenv(SOCKET_ENV, raising=False)
    with pytest.raises(BackendUnavailableError, match="fpgaccl run"):
        Communicator(0, 2, backend="sim")


SPLIT_SCRIPT = textwrap.dedent("""
    import json
    import sys

    import numpy as np

    import fpgaccl
    from fpgaccl.errors import CollectiveMismatchError

    sys.path.insert(0, sys.argv[3])   # the checkout: its tests' shared workload
    from tests.host.cases import overlapping_round

    comm = fpgaccl.init()
    r, iterations = comm.rank, int(sys.argv[2])
    a = comm.split(0 if r in (0, 1, 2) else None)          # ranks 0, 1, 2
    b = comm.split(0 if r in (1, 2, 3) else None, key=-r)  # ranks 3, 2, 1
    out = [{k: v.hex() for k, v in overlapping_round(comm, a, b, i).items()}
           for i in range(iterations)]
    mismatch = None
    if b is not None:   # a sub-communicator checks its own calls
        x = np.arange(10, dtype=np.int32)
        try:
            b.allreduce(x, op="max" if b.rank == 1 else "sum")
        except CollectiveMismatchError as e:
            mismatch = [e.field, list(e.ranks), list(e.values),
                        x.tolist() == list(range(10))]
    ranks = [None if c is None else [c.rank, c.world_size] for c in (a, b)]
    for c in (a, b):
        if c is not None:
            c.close()
    with open(f"{sys.argv[1]}/rank{r}.json", "w") as f:
        json.dump({"out": out, "ranks": ranks, "mismatch": mismatch}, f)
""")


@pytest.mark.slow
def test_overlapping_sub_communicators_in_opposite_orders_complete_on_sim(cluster, tmp_path):
    """Issue 28 on the sim backend: two overlapping sub-communicators (ranks 0-2 and, in
    reverse order, 3-1), each with an allreduce (and an allgather) issued async in
    opposite orders on different ranks beside a world allreduce, 50 iterations: no hang,
    every result bit-exact. The nodes' queue pairs are the world's, so the server starts
    each collective once its nodes are free; a mismatch inside a sub-communicator fails
    on each of its ranks."""
    iterations = 50
    script = tmp_path / "split.py"
    script.write_text(SPLIT_SCRIPT)
    proc = subprocess.run(
        [sys.executable, "-m", "fpgaccl.host.cli", "run", "-n", str(WORLD), "--backend",
         "sim", "--timeout", "300", "--", sys.executable, str(script), str(tmp_path),
         str(iterations), str(Path(__file__).parents[2])], capture_output=True, text=True,
        timeout=400,
        env={**os.environ, **build_env(*cluster), "FPGACCL_CHECK_CALLS": "1"})
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    assert [g["ranks"] for g in got] == [[[0, 3], None], [[1, 3], [2, 3]],
                                         [[2, 3], [1, 3]], [None, [0, 3]]]
    for i in range(iterations):
        for r in range(WORLD):
            want = {k: v.hex() for k, v in overlapping_want(i, r).items()}
            assert got[r]["out"][i] == want, (i, r)
    # b's rank 1 (world rank 2) asked for max, its ranks 0 and 2 for sum.
    assert got[0]["mismatch"] is None
    for r in (1, 2, 3):
        assert got[r]["mismatch"] == ["op", [0, 1], ["sum", "max"], True], got[r]


ABORT_SCRIPT = textwrap.dedent("""
    import json
    import sys
    import threading
    import time

    import numpy as np

    import fpgaccl
    from fpgaccl.errors import AbortedError

    comm = fpgaccl.init()
    out = {"sum": comm.allreduce(np.ones(4, np.int32)).tolist()}
    if comm.rank == 0:
        # Calls rank 1 never makes: only abort() can end them before the deadline.
        handles = [comm.allreduce(np.ones(100, np.float32), async_op=True)
                   for _ in range(3)]
        t0 = time.monotonic()
        threading.Timer(0.3, comm.abort).start()
        out["errors"] = []
        for h in handles:
            try:
                h.wait()
            except AbortedError as e:
                out["errors"].append(e.operation)
        out["waited_s"] = time.monotonic() - t0
        try:
            comm.allreduce(np.ones(4, np.int32))
        except AbortedError:
            out["later"] = "AbortedError"
    else:
        time.sleep(2.0)
        comm.close()
    with open(f"{sys.argv[1]}/rank{comm.rank}.json", "w") as f:
        json.dump(out, f)
""")


@pytest.mark.slow
def test_abort_fails_pending_calls_at_once_on_sim(cluster, tmp_path):
    script = tmp_path / "abort.py"
    script.write_text(ABORT_SCRIPT)
    proc = subprocess.run(
        [sys.executable, "-m", "fpgaccl.host.cli", "run", "-n", "2", "--backend", "sim",
         "--timeout", "300", "--", sys.executable, str(script), str(tmp_path)],
        capture_output=True, text=True, timeout=400,
        env={**os.environ, **build_env(*cluster), "FPGACCL_DEADLINE_S": "60"})
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    got = json.loads((tmp_path / "rank0.json").read_text())
    assert got["sum"] == [2] * 4
    assert got["errors"] == ["allreduce"] * 3 and got["later"] == "AbortedError"
    assert got["waited_s"] < 5, got       # not the 60 s deadline
