"""Bad arguments raise typed errors naming the argument; a dead peer raises a timeout."""

from __future__ import annotations

import os
import random
import time

import numpy as np
import pytest

from fpgaccl.errors import (
    CollectiveTimeoutError,
    CountMismatchError,
    DtypeMismatchError,
    InvalidArgumentError,
    UnsupportedError,
)
from fpgaccl.host import Communicator
from fpgaccl.host.environment import world_from_env

from ._world import run_world


@pytest.fixture(scope="module")
def comm():
    c = Communicator(0, 1, master_port=31999)
    yield c
    c.close()


def _arg(exc_info) -> str:
    return exc_info.value.argument


def test_mismatched_dtypes(comm) -> None:
    with pytest.raises(DtypeMismatchError) as e:
        comm.allreduce(np.zeros(4, np.float32), np.zeros(4, np.float64))
    assert _arg(e) == "recvbuf"


def test_wrong_counts(comm) -> None:
    with pytest.raises(CountMismatchError) as e:
        comm.allreduce(np.zeros(4, np.int32), np.zeros(5, np.int32))
    assert _arg(e) == "recvbuf"
    with pytest.raises(CountMismatchError) as e:
        comm.allgather(np.zeros(4, np.int32), np.zeros(3, np.int32))
    assert _arg(e) == "recvbuf"
    with pytest.raises(CountMismatchError) as e:
        comm.alltoallv(np.zeros(4, np.int32), [4, 1], np.zeros(4, np.int32), [4])
    assert _arg(e) == "sendcounts"


def test_root_out_of_range(comm) -> None:
    for root in (-1, 1, 7):
        with pytest.raises(InvalidArgumentError) as e:
            comm.broadcast(np.zeros(4), root=root)
        assert _arg(e) == "root"
    with pytest.raises(InvalidArgumentError) as e:
        comm.reduce(np.zeros(4), root=3)
    assert _arg(e) == "root"


def test_gather_and_scatter_name_their_arguments(comm) -> None:
    x = np.arange(4, dtype=np.int32)
    with pytest.raises(InvalidArgumentError) as e:
        comm.gather(x)                       # the root needs a receive buffer
    assert _arg(e) == "recvbuf"
    with pytest.raises(CountMismatchError) as e:
        comm.gather(x, np.zeros(5, np.int32))
    assert _arg(e) == "recvbuf"
    with pytest.raises(DtypeMismatchError) as e:
        comm.gather(x, np.zeros(4, np.int64))
    assert _arg(e) == "recvbuf"
    with pytest.raises(InvalidArgumentError) as e:
        comm.gather(x, np.zeros(4, np.int32), root=1)
    assert _arg(e) == "root"
    with pytest.raises(CountMismatchError) as e:
        comm.scatter(x, np.zeros(3, np.int32))
    assert _arg(e) == "sendbuf"
    with pytest.raises(InvalidArgumentError) as e:
        comm.scatter(None, np.zeros(4, np.int32))   # the root has to send something
    assert _arg(e) == "sendbuf"
    with pytest.raises(InvalidArgumentError) as e:
        comm.scatter(x, None)
    assert _arg(e) == "recvbuf"
    with pytest.raises(InvalidArgumentError) as e:
        comm.scatter(x, np.zeros(4, np.int32), root=-1)
    assert _arg(e) == "root"
    assert comm.gather(x, np.zeros(4, np.int32)).tolist() == [0, 1, 2, 3]
    assert comm.scatter(x, np.zeros(4, np.int32)).tolist() == [0, 1, 2, 3]


def test_non_contiguous_and_non_buffers(comm) -> None:
    with pytest.raises(InvalidArgumentError) as e:
        comm.allreduce(np.zeros(8, np.float32)[::2])
    assert _arg(e) == "sendbuf"
    with pytest.raises(InvalidArgumentError) as e:
        comm.allreduce(np.zeros((4, 4), np.float32).T)
    assert _arg(e) == "sendbuf"
    with pytest.raises(InvalidArgumentError) as e:
        comm.allreduce(np.zeros(4, np.float32), np.zeros(8, np.float32)[::2])
    assert _arg(e) == "recvbuf"
    with pytest.raises(InvalidArgumentError) as e:
        comm.allreduce([1, 2, 3])
    assert _arg(e) == "sendbuf"
    with pytest.raises(InvalidArgumentError) as e:
        comm.allreduce(b"read-only bytes")
    assert _arg(e) == "sendbuf"


def test_ops_dtypes_and_algorithms(comm) -> None:
    with pytest.raises(InvalidArgumentError) as e:
        comm.allreduce(np.zeros(4), op="mean")
    assert _arg(e) == "op" and "avg" in str(e.value)
    with pytest.raises(UnsupportedError) as e:
        comm.allreduce(np.zeros(4, np.float32), op="bxor")
    assert _arg(e) == "op"
    with pytest.raises(UnsupportedError) as e:
        comm.allreduce(np.zeros(4, np.complex64))
    assert _arg(e) == "sendbuf"
    with pytest.raises(UnsupportedError) as e:
        comm.allreduce(np.zeros(4), algo="butterfly")
    assert _arg(e) == "algo"
    with pytest.raises(InvalidArgumentError) as e:
        comm.send(np.zeros(4), 0)
    assert _arg(e) == "dst"


def test_constructor_arguments() -> None:
    with pytest.raises(InvalidArgumentError) as e:
        Communicator(3, 2)
    assert _arg(e) == "rank"
    with pytest.raises(InvalidArgumentError) as e:
        Communicator(0, 1, mtu=1500, master_port=31998)
    assert _arg(e) == "mtu"


def test_world_of_one_accepts_every_buffer_kind(comm) -> None:
    import array

    from fpgaccl.host import DeviceArray
    ba = bytearray(b"\x01\x02\x03")
    assert comm.allreduce(ba) is ba and ba == bytearray(b"\x01\x02\x03")
    arr = array.array("i", [1, 2, 3])
    comm.allreduce(arr, op="max")

    class Iface:
        def __init__(self, a: np.ndarray) -> None:
            self.__array_interface__ = a.__array_interface__

    comm.allreduce(Iface(np.arange(4, dtype=np.int16)))
    class Dl:  # DLPack only (no buffer protocol, no array interface)
        def __init__(self, a: np.ndarray) -> None:
            self._a = a

        def __dlpack__(self, **kw):
            return self._a.__dlpack__(**kw)

        def __dlpack_device__(self):
            return self._a.__dlpack_device__()

    src = np.arange(6, dtype=np.int64)
    out = np.zeros(6, np.int64)
    comm.allreduce(Dl(src), Dl(out))
    assert np.array_equal(out, src)
    dev = DeviceArray(np.arange(5, dtype=np.float32))
    comm.broadcast(dev)
    assert np.array_equal(dev.get(), np.arange(5, dtype=np.float32))


def test_launcher_environments() -> None:
    assert world_from_env({"RANK": "3", "WORLD_SIZE": "8"}) == (3, 8)  # torchrun
    assert world_from_env({"SLURM_PROCID": "1", "SLURM_NTASKS": "4"}) == (1, 4)
    assert world_from_env({"OMPI_COMM_WORLD_RANK": "2",
                           "OMPI_COMM_WORLD_SIZE": "5"}) == (2, 5)
    assert world_from_env({"FPGACCL_RANK": "0", "FPGACCL_WORLD_SIZE": "2",
                           "RANK": "9", "WORLD_SIZE": "16"}) == (0, 2)
    assert world_from_env({}) == (0, 1)
    with pytest.raises(InvalidArgumentError):
        world_from_env({"RANK": "x", "WORLD_SIZE": "2"})


def _dies(comm, victim: int) -> tuple[str, float]:
    comm.barrier()
    if comm.rank == victim:
        os._exit(0)  # a crash: no goodbye, no close
    t0 = time.monotonic()
    try:
        comm.allreduce(np.ones(100_000, np.float32))
    except CollectiveTimeoutError as e:  # a PeerDeadError is one too
        return (type(e).__name__ + f":{e.rank}:{getattr(e, 'peer', None)}",
                time.monotonic() - t0)
    return ("completed", time.monotonic() - t0)


def test_dead_peer_times_out_on_every_survivor() -> None:
    # The peer timeout finds the dead rank long before the deadline.
    deadline = 20.0
    res = run_world(4, _dies, victim=2, comm_kw={"deadline_s": deadline}, timeout=60,
                    _close=False)
    survivors = {r: v for r, (s, v) in res.items() if s == "ok"}
    assert sorted(survivors) == [0, 1, 3], res
    for r, (what, took) in survivors.items():
        assert what == f"PeerDeadError:{r}:2"
        assert took < 4.0, f"rank {r} took {took:.1f} s"


def test_alltoallv_counts_to_self_must_agree_and_be_ints(comm) -> None:
    x = np.arange(4, dtype=np.float32)
    for sc, rc in (([1], [3]), ([3], [2])):
        with pytest.raises(CountMismatchError) as e:
            comm.alltoallv(x, sc, np.zeros(4, np.float32), rc)
        assert _arg(e) == "recvcounts"
    with pytest.raises(InvalidArgumentError) as e:
        comm.alltoallv(x, [1.5], np.zeros(4, np.float32), [1])
    assert _arg(e) == "sendcounts"
    y = np.zeros(4, np.float32)
    comm.alltoallv(x, [np.int64(3)], y, [3])  # still usable, numpy ints are counts
    assert y[:3].tolist() == [0, 1, 2]


def test_a_numpy_scalar_cannot_be_written_in_place(comm) -> None:
    with pytest.raises(InvalidArgumentError) as e:
        comm.allreduce(np.float32(1))
    assert _arg(e) == "sendbuf"
    with pytest.raises(InvalidArgumentError, match="Fortran"):
        comm.allreduce(np.zeros((3, 4), np.float32, order="F"))


@pytest.mark.parametrize("deadline", [float("inf"), float("nan"), 0, -1, "5"])
def test_deadline_must_be_a_finite_positive_number(deadline) -> None:
    with pytest.raises(InvalidArgumentError) as e:
        Communicator(0, 1, deadline_s=deadline)
    assert _arg(e) == "deadline_s"


def test_rank_must_be_an_int() -> None:
    with pytest.raises(InvalidArgumentError, match="must be an int") as e:
        Communicator(np.int64(0), 1)
    assert _arg(e) == "rank"


def test_a_taken_roce_port_names_bind_ip() -> None:
    """Two ranks on one address (e.g. torchrun, two ranks per host): the second cannot
    have UDP 4791 and is told how to give it an address of its own."""
    from fpgaccl.host.engine import Engine
    first = Engine(0, "127.77.9.1")
    try:
        with pytest.raises(InvalidArgumentError, match="FPGACCL_BIND_IP") as e:
            Engine(1, "127.77.9.1")
        assert _arg(e) == "bind_ip"
    finally:
        first.stop()


@pytest.mark.parametrize("placement", [
    {"SLURM_PROCID": "1", "SLURM_NTASKS": "4", "SLURM_NNODES": "2"},
    {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4",
     "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}], ids=["slurm", "openmpi"])
def test_ranks_on_several_hosts_need_master_addr(monkeypatch, placement) -> None:
    from fpgaccl.host import environment
    for var in (*environment._RANK_VARS, *environment._SIZE_VARS, "MASTER_ADDR"):
        monkeypatch.delenv(var, raising=False)
    for var, value in placement.items():
        monkeypatch.setenv(var, value)
    monkeypatch.setattr(environment, "_WORLD", None)
    with pytest.raises(InvalidArgumentError) as e:
        environment.init()
    assert _arg(e) == "MASTER_ADDR"


def test_run_program_checks_the_program_before_anything_runs(comm) -> None:
    # Rank 0 of 1: a program that sends to a rank that does not exist, or with a tag the
    # wire cannot carry, is refused whole instead of failing part-way through a call.
    from fpgaccl.proto.isa import Instr, SeqOp
    for bad in ([Instr(SeqOp.SEND, peer=1), Instr(SeqOp.DONE)],
                [Instr(SeqOp.COPY, buf=1), Instr(SeqOp.SETUP, step=0), Instr(SeqOp.DONE)],
                [Instr(SeqOp.COPY, buf=1)], 42):
        with pytest.raises(InvalidArgumentError) as e:
            comm.run_program(bad, np.arange(8, dtype=np.int32))
        assert _arg(e) == "program"
    from fpgaccl.proto.isa import Buf
    ok = [Instr(SeqOp.COPY, buf=Buf.OUT, src=Buf.IN), Instr(SeqOp.DONE)]
    assert np.array_equal(comm.run_program(ok, np.arange(8, dtype=np.int32)), np.arange(8))
    # A program runs whole, never cut into segments: a vector the region holds in one
    # piece only without its chunks' rounding (4 chunks of the region) is refused.
    four = [Instr(SeqOp.SETUP, step=4), Instr(SeqOp.COPY, buf=Buf.OUT, count=4),
            Instr(SeqOp.DONE)]
    cap = comm.stage_bytes // 4
    with pytest.raises(CountMismatchError) as e:
        comm.run_program(four, np.zeros(cap, np.float32))
    assert _arg(e) == "sendbuf"
    got = comm.run_program(four, np.arange(cap - 3, dtype=np.float32))
    assert np.array_equal(got, np.arange(cap - 3, dtype=np.float32))


def _uneven(comm, counts: list[int], dtypes: list[str], algo: str | None) -> str:
    x = np.ones(counts[comm.rank], dtypes[comm.rank])
    try:
        comm.allreduce(x, algo=algo)
    except (CountMismatchError, CollectiveTimeoutError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


@pytest.mark.parametrize("counts, dtypes, algo", [
    ([1000, 1004], ["float32", "float32"], None),        # small: recursive doubling
    ([300_000, 300_016], ["int32", "int32"], None),      # large: halving-doubling
    ([300_000, 300_016], ["int32", "int32"], "ring"),
    ([1000, 1000], ["float32", "float64"], None),        # another element size
])
def test_ranks_that_disagree_on_the_count_get_an_error_not_a_result(counts, dtypes,
                                                                    algo) -> None:
    # Unchecked calls: the message a peer sends is not the span this rank reduces, so
    # the receiving rank raises CountMismatchError naming the cause; none returns a
    # result. (Checked calls fail before a byte moves: tests/host/test_signature.py.)
    res = run_world(2, _uneven, counts=counts, dtypes=dtypes, algo=algo, timeout=60,
                    comm_kw={"deadline_s": 5, "check_calls": False}, _close=False)
    got = [v for s, v in res.values() if s == "ok"]
    assert len(got) == 2, res
    assert all(g != "no error" for g in got), got
    assert any(g.startswith("CountMismatchError") and "same count and dtype" in g
               for g in got), got


def test_a_world_that_does_not_form_gives_its_address_back() -> None:
    """Rank 1 of 2 whose rank 0 never comes: the rendezvous times out, and the engine's
    sockets are closed then, not whenever the failed object is collected, so the same
    process can try again on the same address."""
    from fpgaccl.errors import CollectiveTimeoutError
    kw = {"bind_ip": "127.77.9.5", "master_port": random.randint(20000, 32767),
          "rendezvous_timeout_s": 0.5}
    with pytest.raises(CollectiveTimeoutError) as e:
        Communicator(1, 2, **kw)
    # e's traceback still holds the failed Communicator and its engine: only a close at
    # the failure frees the address now.
    assert "rendezvous" in str(e.value)
    from fpgaccl.host.engine import Engine
    Engine(1, "127.77.9.5").stop()
