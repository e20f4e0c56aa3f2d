"""A mixed world: ``fpgaccl run -n 4 --sim-ranks 2,3`` puts ranks 0 and 1 on the software
backend (real UDP sockets) and ranks 2 and 3 on simulated HDL nodes of the standard
cluster, joined by the bridge (:mod:`fpgaccl.sim.bridge`). One script: allreduce
(int32, float32), allgather and broadcast bit-exact against numpy (integers) and
bit-identical to the all-software run, with 2% of the bridged frames lost; the merged
capture decodes as RoCEv2 in tshark, frames from the simulated nodes included; then a
software rank dies in the middle of an allreduce and the others' allreduce raises
CollectiveTimeoutError instead of hanging."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from fpgaccl.host.tshark import decode
from fpgaccl.sim.server import build_env

WORLD = 4
N = 1000

SCRIPT = textwrap.dedent("""
    import os
    import sys
    import time

    import numpy as np

    import fpgaccl
    from fpgaccl.errors import CollectiveTimeoutError

    comm = fpgaccl.init()
    r, p = comm.rank, comm.world_size
    rng = np.random.default_rng(300 + r)
    n = int(sys.argv[2])
    xi = rng.integers(-1000, 1000, n, dtype=np.int32)
    xf = (rng.standard_normal(n) * 100).astype(np.float32)
    res = {"in_i": xi, "in_f": xf}
    res["allreduce_i"] = comm.allreduce(xi, np.empty_like(xi))
    res["allreduce_f"] = comm.allreduce(xf, np.empty_like(xf))
    res["allgather_i"] = comm.allgather(xi[:250], np.empty(250 * p, np.int32))
    b = xi.copy() if r == 2 else np.zeros_like(xi)
    comm.broadcast(b, root=2)
    res["broadcast_i"] = b
    np.savez(f"{sys.argv[1]}/rank{r}.npz", **res)
    print(f"rank {r} done on {comm.backend}", flush=True)
    if len(sys.argv) > 3:
        # Rank 1 (software) dies in the middle of an allreduce: it has started it and sent
        # its first frames, then the process is gone. The others' allreduce must end in a
        # timeout error, not hang.
        # Halving-doubling: every rank's result needs rank 1 in a later step. (With
        # recursive doubling, rank 1's first step would already complete ranks 0 and 2.)
        big = np.tile(xi, 8)
        comm.deadline_s = 8.0
        if r == 1:
            comm.allreduce(big, np.empty_like(big), algo="rhd", async_op=True)
            time.sleep(0.05)
            os._exit(0)
        t0 = time.monotonic()
        try:
            comm.allreduce(big, np.empty_like(big), algo="rhd")
            gone = "completed"
        except CollectiveTimeoutError as e:
            gone = f"{type(e).__name__} after {time.monotonic() - t0:.1f} s: {e}"
        with open(f"{sys.argv[1]}/gone{r}.txt", "w") as f:
            f.write(gone)
        os._exit(0)
""")


@pytest.fixture(scope="module")
def cluster():
    from fpgaccl.sim.hdl.cluster import build_standard
    return build_standard()   # the build tests/sim/test_cluster.py shares


def launch(tmp_path, name, cluster, *options, script_args=()):
    out = tmp_path / name
    out.mkdir()
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    proc = subprocess.run(
        [sys.executable, "-m", "fpgaccl.host.cli", "run", "-n", str(WORLD), *options,
         "--deadline", "120", "--timeout", "400", "--", sys.executable, str(script), str(out),
         str(N), *script_args],
        capture_output=True, text=True, timeout=500, env={**os.environ, **build_env(*cluster)})
    assert proc.returncode == 0, f"{name}:\n{proc.stdout}\n{proc.stderr}"
    return [dict(np.load(out / f"rank{r}.npz")) for r in range(WORLD)], proc


@pytest.mark.slow
def test_two_software_and_two_simulated_ranks(cluster, tmp_path):
    t0 = time.monotonic()
    pcap = tmp_path / "mixed.pcap"
    mixed, proc = launch(tmp_path, "mixed", cluster, "--sim-ranks", "2,3", "--bridge-loss",
                         "0.02", "--pcap", str(pcap), script_args=("kill",))
    t1 = time.monotonic()
    soft, _ = launch(tmp_path, "software", cluster)
    print(f"mixed run {t1 - t0:.1f} s, software run {time.monotonic() - t1:.1f} s")
    print(proc.stderr)
    for r in range(WORLD):
        assert f"rank {r} done on {'sim' if r >= 2 else 'software'}" in proc.stdout
    xi = [mixed[r]["in_i"] for r in range(WORLD)]
    total = np.sum(xi, axis=0, dtype=np.int32)
    for r in range(WORLD):
        m = mixed[r]
        assert m["allreduce_i"].tobytes() == total.tobytes()
        assert m["allgather_i"].tobytes() == np.concatenate([x[:250] for x in xi]).tobytes()
        assert m["broadcast_i"].tobytes() == xi[2].tobytes()
        np.testing.assert_allclose(m["allreduce_f"], np.sum([x["in_f"] for x in mixed], 0),
                                   rtol=1e-4, atol=1e-2)
        # Bit-identical to the all-software run, floats included.
        for key, val in soft[r].items():
            assert m[key].tobytes() == val.tobytes(), f"rank {r}: {key} differs"

    # Lossy bridge: frames were dropped, and recovered (the results above).
    bridge = next(line for line in proc.stderr.splitlines() if "bridge:" in line)
    stats = dict(kv.split("=") for kv in bridge.split("bridge: ")[1].split(", "))
    assert int(stats["lost"]) > 0 and int(stats["to_sockets"]) > 0, bridge
    assert int(stats["from_sockets"]) > 0, bridge

    # One capture: software ranks' frames and the simulated nodes' frames to them.
    rows = decode(pcap)
    assert rows and all(row.is_rocev2 and not row.malformed for row in rows)
    srcs = subprocess.run(["tshark", "-r", str(pcap), "-T", "fields", "-e", "ip.src"],
                          capture_output=True, text=True, check=True).stdout.split()
    hosts = {s.rsplit(".", 1)[1] for s in srcs}
    assert hosts == {"1", "2", "3", "4"}, hosts   # ranks 0..3 are .1 .. .4

    # Rank 1 died mid-allreduce: every survivor's allreduce timed out (8 s deadline) and
    # returned, no hang.
    for r in (0, 2, 3):
        gone = (tmp_path / "mixed" / f"gone{r}.txt").read_text()
        assert gone.startswith(("CollectiveTimeoutError", "RanksTimeoutError", "PeerDeadError")), \
            (r, gone)
        assert float(gone.split(" after ")[1].split(" s")[0]) < 60, (r, gone)


MISMATCH_SCRIPT = textwrap.dedent("""
    import json
    import sys
    import time

    import numpy as np

    import fpgaccl
    from fpgaccl.errors import CollectiveMismatchError

    comm = fpgaccl.init()
    r = comm.rank
    comm.deadline_s = 60.0
    n = 200
    out = {}
    # Rank 0 (software) and rank 1 (a simulated node) disagree: op, then a dtype of the
    # same size. Every rank must raise, in time, with both buffers as they were.
    for case, dtype, op in (("op", ("int32", "int32"), ("sum", "max")),
                            ("dtype", ("int32", "float32"), ("sum", "sum"))):
        x = (np.arange(n) % 13 + r).astype(dtype[r])
        y = np.full_like(x, 7)
        xs, ys = x.copy(), y.copy()
        t0 = time.monotonic()
        try:
            comm.allreduce(x, y, op=op[r])
            got = "completed"
        except CollectiveMismatchError as e:
            got = f"{type(e).__name__}: {e.field} {e.ranks} {e.values}"
        out[case] = {"error": got, "s": time.monotonic() - t0,
                     "unchanged": bool(x.tobytes() == xs.tobytes()
                                       and y.tobytes() == ys.tobytes())}
    # The same world agrees again: bit-exact.
    x = (np.arange(n) * 3 - 100 * r).astype(np.int32)
    out["agree"] = comm.allreduce(x, np.empty_like(x)).tolist()
    with open(f"{sys.argv[1]}/mm{r}.json", "w") as f:
        json.dump(out, f)
    print(f"rank {r} done on {comm.backend}", flush=True)
""")


@pytest.mark.slow
def test_a_software_rank_and_a_node_that_disagree_both_raise(cluster, tmp_path):
    """One software rank and one simulated node with check_calls: the node's GRANT
    carries its call's digest and the software rank's carries its own; each side
    compares and stops before a byte of data moves, so both raise
    CollectiveMismatchError (field "digest": the node sends no full record) naming
    ranks 0 and 1 with the same values, no buffer changes, and the next, agreeing
    allreduce is bit-exact."""
    script = tmp_path / "mismatch.py"
    script.write_text(MISMATCH_SCRIPT)
    proc = subprocess.run(
        [sys.executable, "-m", "fpgaccl.host.cli", "run", "-n", "2", "--sim-ranks", "1",
         "--deadline", "120", "--timeout", "400", "--", sys.executable, str(script),
         str(tmp_path)],
        capture_output=True, text=True, timeout=500,
        env={**os.environ, **build_env(*cluster), "FPGACCL_CHECK_CALLS": "1"})
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    import json
    got = [json.loads((tmp_path / f"mm{r}.json").read_text()) for r in range(2)]
    for case in ("op", "dtype"):
        errors = {g[case]["error"] for g in got}
        assert len(errors) == 1, (case, errors)   # the same error on both ranks
        assert errors.pop().startswith("CollectiveMismatchError: digest (0, 1)"), (case, got)
        for g in got:
            assert g[case]["unchanged"], (case, g)
            assert g[case]["s"] < 60, (case, g)
    want = sum((np.arange(200) * 3 - 100 * r).astype(np.int32) for r in range(2))
    for g in got:
        assert g["agree"] == want.tolist()
