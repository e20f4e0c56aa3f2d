"""fpgaccl as a torch.distributed backend (fpgaccl.torch / fpgaccl.host.torch_backend):
ranks are processes started with env:// variables on loopback addresses; each runs
tests/torch/worker.py and saves what it got, checked here against references computed
from the same inputs."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from fpgaccl.errors import InvalidArgumentError, UnsupportedError  # noqa: E402
from fpgaccl.host import torch_backend  # noqa: E402
from tests.torch.worker import BIG, DTYPES, OPS, N, make_input  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(argv: list[str], p: int, timeout_s: float = 150,
              env: dict[str, str] | None = None) -> list[str]:
    """Start ``p`` ranks of ``argv`` with env:// variables; their outputs, once all passed."""
    port = free_port()
    procs = []
    for r in range(p):
        e = dict(os.environ, RANK=str(r), WORLD_SIZE=str(p), LOCAL_RANK=str(r),
                 MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **(env or {}))
        procs.append(subprocess.Popen(argv, cwd=ROOT, env=e, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    logs = []
    try:
        for proc in procs:
            logs.append(proc.communicate(timeout=timeout_s)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    failed = [r for r, proc in enumerate(procs) if proc.returncode != 0]
    tails = "\n".join(f"--- rank {r}\n{logs[r][-3000:]}" for r in failed)
    assert not failed, f"ranks {failed} failed:\n{tails}"
    return logs


def run_worker(scenario: str, p: int, outdir: Path) -> list[dict[str, Any]]:
    run_ranks([sys.executable, "-m", "tests.torch.worker", scenario, str(outdir)], p)
    return [torch.load(outdir / f"rank{r}.pt", weights_only=False) for r in range(p)]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.reshape(-1).contiguous().view(torch.uint8), b.reshape(-1).contiguous().view(torch.uint8))


@pytest.fixture(scope="module", params=[3, 4], ids=lambda p: f"{p}ranks")
def world(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    p = request.param
    return p, run_worker("collectives", p, tmp_path_factory.mktemp(f"coll{p}"))


def inputs(p: int, key: str, dtype: torch.dtype = torch.float32, n: int = N) -> torch.Tensor:
    return torch.stack([make_input(r, key, dtype, n) for r in range(p)])


def reference(x: torch.Tensor, op: str) -> torch.Tensor:
    """``op`` over dim 0: integers exactly (as int64, cast back), floats in float64."""
    wide = x.to(torch.float64 if x.dtype.is_floating_point else torch.int64)
    if op == "sum":
        r = wide.sum(0)
    elif op == "product":
        r = wide.prod(0)
    elif op == "min":
        r = wide.min(0).values
    elif op == "max":
        r = wide.max(0).values
    elif x.dtype.is_floating_point:  # avg
        r = wide.sum(0).to(x.dtype).to(torch.float64) / x.shape[0]
    else:
        r = torch.div(wide.sum(0), x.shape[0], rounding_mode="trunc")
    return r.to(x.dtype)


TOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 1e-6, torch.float64: 1e-12}


def test_registration() -> None:
    import fpgaccl.torch  # noqa: F401

    assert "fpgaccl" in dist.Backend.backend_list
    assert "FPGACCL" in dist.Backend._plugins


def test_init_process_group(world) -> None:
    p, res = world
    assert [r["backend"] for r in res] == ["fpgaccl"] * p


def test_allreduce_every_dtype_and_op(world) -> None:
    p, res = world
    checked = 0
    for dt in DTYPES:
        for op in OPS:
            key = f"allreduce/{op}/{dt}"
            if key not in res[0]:
                continue
            want = reference(inputs(p, f"ar-{op}-{dt}", dt), op)
            got = res[0][key]
            for r in range(1, p):
                assert same_bits(res[r][key], got), f"{key}: rank {r} differs from rank 0"
            if dt.is_floating_point and op in ("sum", "avg", "product"):
                torch.testing.assert_close(got, want, rtol=TOL[dt], atol=0, msg=key)
            else:
                assert same_bits(got, want), f"{key}: {got} != {want}"
            checked += 1
    assert checked == len(DTYPES) * len(OPS) - 3  # float products but float64's are skipped
    assert all(r["allreduce_done"] for r in res)
    assert torch.equal(res[0]["allreduce_big"], reference(inputs(p, "ar-big", torch.int32, BIG),
                                                          "sum"))


def test_async_work_and_futures(world) -> None:
    """Posting returns at once, the work completes when the late rank joins, and a
    future's callback sees the result."""
    p, res = world
    for r in range(p):
        assert res[r]["post_s"] < 0.25, res[r]["post_s"]
        assert res[r]["chained"] == 4.0 * p
        assert res[r]["polled"] and res[r]["waited_alone"], res[r]
    for r in range(p - 1):  # the last rank posted 1 s late
        assert not res[r]["done_at_post"]
        assert res[r]["wait_s"] > 0.5  # ~1 s less the ranks' skew on a loaded machine
        assert res[r]["wait_timeout"][0] == "CollectiveTimeoutError", res[r]["wait_timeout"]


def test_broadcast(world) -> None:
    p, res = world
    for r in range(p):
        assert same_bits(res[r]["broadcast"], make_input(p - 1, "bcast"))


def test_allgather(world) -> None:
    p, res = world
    want = inputs(p, "ag", torch.int32)
    for r in range(p):
        assert torch.equal(res[r]["all_gather_into_tensor"], want.reshape(-1))
        assert all(torch.equal(a, b) for a, b in zip(res[r]["all_gather"], want, strict=True))


def test_reduce_scatter(world) -> None:
    p, res = world
    total = reference(inputs(p, "rs", torch.int64, p * N), "sum")
    avg = reference(inputs(p, "rs-avg", torch.float64, p * N), "avg")
    for r in range(p):
        mine = slice(r * N, (r + 1) * N)
        assert torch.equal(res[r]["reduce_scatter_tensor"], total[mine])
        assert torch.equal(res[r]["reduce_scatter"], total[mine])
        torch.testing.assert_close(res[r]["reduce_scatter_tensor_avg"], avg[mine],
                                   rtol=1e-12, atol=0)


def test_coalesced(world) -> None:
    p, res = world
    for k, n in enumerate((5, 1, 2 * N)):
        total = reference(inputs(p, f"arc{k}", torch.int32, n), "sum")
        gathered = inputs(p, f"agc{k}", torch.float32, n).reshape(-1)
        avg = reference(inputs(p, f"rsc{k}", torch.float64, p * n), "avg")
        for r in range(p):
            assert torch.equal(res[r]["allreduce_coalesced"][k], total), (k, r)
            assert same_bits(res[r]["all_gather_coalesced"][k], gathered), (k, r)
            torch.testing.assert_close(res[r]["reduce_scatter_coalesced_avg"][k],
                                       avg[r * n:(r + 1) * n], rtol=1e-12, atol=0)


def test_all_to_all(world) -> None:
    p, res = world
    blocks = [make_input(j, "a2a", torch.int32, p * N).chunk(p) for j in range(p)]
    for r in range(p):
        assert torch.equal(res[r]["all_to_all_single"], torch.cat([b[r] for b in blocks]))
        # rank j sent j + r + 1 rows of 3 to rank r
        rows = []
        for j in range(p):
            sends = [k + j + 1 for k in range(p)]
            mat = make_input(j, "a2av", torch.float32, sum(sends) * 3).view(-1, 3)
            rows.append(mat.split(sends)[r])
        assert torch.equal(res[r]["all_to_all_single_splits"], torch.cat(rows))
        got = res[r]["all_to_all"]
        for j in range(p):
            sends = [k + j + 1 for k in range(p)]
            assert torch.equal(got[j], make_input(j, "a2al", torch.int16, sum(sends))
                               .split(sends)[r])


def test_gather_scatter_reduce(world) -> None:
    p, res = world
    assert [torch.equal(a, make_input(j, "gather")) for j, a in enumerate(res[1]["gather"])] \
        == [True] * p
    assert all(res[r]["gather"] is None for r in range(p) if r != 1)
    for r in range(p):
        assert torch.equal(res[r]["scatter"], make_input(r, "scatter"))
    assert torch.equal(res[p - 1]["reduce"], reference(inputs(p, "reduce", torch.int32), "max"))


def test_send_recv(world) -> None:
    p, res = world
    for r in range(p):
        assert torch.equal(res[r]["send_recv"], make_input((r - 1) % p, "p2p"))


def test_non_contiguous(world) -> None:
    p, res = world
    want = inputs(p, "nc", torch.float64, 12).view(p, 3, 4).sum(0).t()
    strided = make_input(0, "nc2", torch.int64, 2 * N)
    strided[::2] = inputs(p, "nc2", torch.int64, 2 * N)[:, ::2].sum(0)
    for r in range(p):
        got = res[r]["noncontig_t"]
        assert not got.is_contiguous()
        torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
        base = res[r]["noncontig_strided"]
        assert torch.equal(base[::2], strided[::2])  # reduced in place
        assert torch.equal(base[1::2], make_input(r, "nc2", torch.int64, 2 * N)[1::2])  # intact


def test_idle_group_costs_no_cpu(world) -> None:
    _, res = world
    assert all(r["barrier"] for r in res)
    # the completion thread blocks in its queue, the engine in poll
    assert max(r["idle_cpu_per_s"] for r in res) < 0.05


def test_groups_and_typed_errors(world) -> None:
    p, res = world
    for r in range(p):
        assert torch.equal(res[r]["new_group_world"], torch.full((3,), float(sum(range(p)))))
        assert res[r]["tag"] == ("UnsupportedError", "tag")
        assert res[r]["bool"] == ("UnsupportedError", "tensors")
        assert res[r]["float8"] == ("UnsupportedError", "tensors")
        assert res[r]["coalesced"] == ("UnsupportedError", "input_tensor_list")
    for r in range(p):
        sub = res[r]["subgroups"]
        if r in (0, 1):  # new_group([0, 1]): an allreduce of (rank + 1 + i)
            assert [t.tolist() for t in sub["a"]] == [[3.0 + 2 * i] * 5 for i in range(5)]
        if r >= 1:  # new_group([1..p-1]): a broadcast from global rank p - 1
            assert [t.tolist() for t in sub["b"]] == [[(p - 1) * 10.0 + i] * 3
                                                      for i in range(5)]
    assert res[p - 1]["subgroups"]["one"].tolist() == [7.0, 7.0]
    assert res[p - 1]["subgroups"]["rev"] == (1, p - 1.0)  # torch sorted the ranks
    assert res[p - 2]["subgroups"]["rev"] == (0, p - 1.0)


# ---------------------------------------------------------------- in this process
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_tensors_are_passed_without_a_copy(dtype: torch.dtype) -> None:
    t = make_input(0, "zc", dtype, 64).view(8, 8)
    arr = torch_backend.as_array(t, "t")
    assert arr.ctypes.data == t.data_ptr() and arr.nbytes == t.numel() * t.element_size()
    assert arr.dtype.itemsize == t.element_size()
    arr[3] = arr[5]  # writes land in the tensor
    assert same_bits(t.reshape(-1)[3], t.reshape(-1)[5])
    if dtype == torch.bfloat16:
        assert str(arr.dtype) == "bfloat16"
        assert np.array_equal(arr.astype(np.float32), t.reshape(-1).float().numpy())


def test_tensor_errors_name_the_argument() -> None:
    with pytest.raises(UnsupportedError) as e:
        torch_backend.as_array(torch.empty(3, device="meta"), "tensor")
    assert e.value.argument == "tensor" and "meta" in str(e.value)
    with pytest.raises(UnsupportedError, match="dtype"):
        torch_backend.as_array(torch.ones(3, dtype=torch.complex64), "output")
    with pytest.raises(UnsupportedError, match="sparse"):
        torch_backend.as_array(torch.eye(3).to_sparse(), "input")
    with pytest.raises(InvalidArgumentError, match="contiguous"):
        torch_backend.as_array(torch.ones(4, 4).t(), "input")


def test_cuda_tensor_raises() -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device here: the CPU wheel is installed and no GPU is present")
    with pytest.raises(UnsupportedError, match="cuda") as e:
        torch_backend.as_array(torch.ones(3, device="cuda"), "tensor")
    assert e.value.argument == "tensor"


def test_ddp_parameters_bit_identical(tmp_path: Path) -> None:
    """Different initial weights and data per rank: only DDP's broadcast and bucketed
    allreduce make the ranks agree, bit for bit, after every step. (4 ranks: the
    examples' test, through ``fpgaccl run``.)"""
    p = 2
    res = run_worker("ddp", p, tmp_path)
    steps = [r["params"] for r in res]
    assert len(steps[0]) == 3
    for s in range(3):
        for r in range(1, p):
            assert same_bits(steps[r][s], steps[0][s]), f"step {s}: rank {r} differs"
    assert not torch.equal(steps[0][0], steps[0][2])  # training moved them


def test_world_of_one_in_process_and_again() -> None:
    """No TCPStore (a HashStore) and no MASTER_ADDR; destroy_process_group closes the
    communicator, so the process can join a new world."""
    import fpgaccl.torch  # noqa: F401

    for _ in range(2):
        dist.init_process_group("fpgaccl", store=dist.HashStore(), rank=0, world_size=1)
        try:
            t = torch.arange(5, dtype=torch.int32)
            dist.all_reduce(t, op=dist.ReduceOp.AVG)
            assert torch.equal(t, torch.arange(5, dtype=torch.int32))
            assert torch_backend._Shared.comm is not None
        finally:
            dist.destroy_process_group()
        assert torch_backend._Shared.comm is None
