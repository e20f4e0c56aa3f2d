"""The backend boundary: a backend written in one module (``loopback_backend.py``, the
ranks' programs on the sequencer model in pure numpy) runs the public collectives
through the Communicator unchanged, and the Communicator picks backends by name."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from fpgaccl.errors import BackendUnavailableError, UnsupportedError
from fpgaccl.host import Communicator
from fpgaccl.host.backends import BACKENDS, register
from fpgaccl.proto import programs as lib

from .loopback_backend import Fabric, LoopbackBackend

WORLD = 4


@pytest.fixture(autouse=True)
def loopback():
    register("loopback", LoopbackBackend, deadline_s=30.0)
    yield
    del BACKENDS["loopback"]


def _world(body: Callable[[Communicator], Any], world: int = WORLD,
           stage_bytes: int = 1 << 16) -> list[Any]:
    fabric = Fabric(world, stage_bytes)
    out: list[Any] = [None] * world
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            with Communicator(r, world, "loopback", fabric=fabric) as comm:
                out[r] = body(comm)
        except BaseException as e:
            errors.append(e)
            fabric._barrier.abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    return out


def _inputs(r: int, n: int, dtype: Any = np.int32) -> np.ndarray:
    return np.random.default_rng(7 + r).integers(-1000, 1000, n).astype(dtype)


@pytest.mark.parametrize("algo", ["rd", "rhd", "ring"])
def test_allreduce_on_a_backend_of_one_module(algo) -> None:
    n = 3001
    xs = [_inputs(r, n) for r in range(WORLD)]
    got = _world(lambda c: c.allreduce(xs[c.rank], np.empty(n, np.int32), algo=algo))
    for r in range(WORLD):
        np.testing.assert_array_equal(got[r], np.sum(xs, axis=0, dtype=np.int32))


def test_large_vectors_run_in_segments() -> None:
    n = 40_000                                   # 160 KB of int32: several 16 KiB regions
    xs = [_inputs(r, n) for r in range(WORLD)]

    def body(c: Communicator) -> tuple[np.ndarray, int]:
        y = c.allreduce(xs[c.rank], np.empty(n, np.int32), op="max")
        return y, c.stats()["segments"]

    got = _world(body, stage_bytes=1 << 14)
    for y, segments in got:
        np.testing.assert_array_equal(y, np.max(xs, axis=0))
        assert segments > 4


def test_every_library_collective_through_the_communicator() -> None:
    n = 1200
    xs = [_inputs(r, n) for r in range(WORLD)]

    def body(c: Communicator) -> dict[str, Any]:
        x = xs[c.rank]
        res: dict[str, Any] = {}
        res["reduce"] = c.reduce(x, np.zeros_like(x), root=2)
        res["reduce_scatter"] = c.reduce_scatter(x, np.empty(n // WORLD, np.int32))
        res["allgather"] = c.allgather(x[:300], np.empty(300 * WORLD, np.int32))
        b = x.copy() if c.rank == 1 else np.zeros_like(x)
        c.broadcast(b, root=1)
        res["broadcast"] = b
        res["alltoall"] = c.alltoall(x, np.empty_like(x))
        # uneven blocks: the padded alltoallv is library programs, so it runs here too
        cnt = [(c.rank + j) % 3 * 5 for j in range(WORLD)]
        rc = [(i + c.rank) % 3 * 5 for i in range(WORLD)]
        res["alltoallv"] = c.alltoallv(x[:sum(cnt)], cnt, np.empty(sum(rc), np.int32), rc)
        res["gather"] = c.gather(x[:10], np.empty(10 * WORLD, np.int32) if c.rank == 0
                                 else None)
        res["scatter"] = c.scatter(x[:10 * WORLD], np.empty(10, np.int32), root=1)
        h = c.allreduce(x, np.empty_like(x), op="min", async_op=True)
        res["async_min"] = h.wait()
        res["program"] = c.run_program(lib.ring_allreduce(c.rank, WORLD), x)
        c.barrier()
        return res

    got = _world(body)
    total = np.sum(xs, axis=0, dtype=np.int32)
    q = n // WORLD
    for r in range(WORLD):
        np.testing.assert_array_equal(got[2]["reduce"], total)
        np.testing.assert_array_equal(got[r]["reduce_scatter"], total[r * q:(r + 1) * q])
        np.testing.assert_array_equal(got[r]["allgather"],
                                      np.concatenate([x[:300] for x in xs]))
        np.testing.assert_array_equal(got[r]["broadcast"], xs[1])
        np.testing.assert_array_equal(
            got[r]["alltoall"], np.concatenate([xs[j][r * q:(r + 1) * q]
                                                for j in range(WORLD)]))
        np.testing.assert_array_equal(got[r]["async_min"], np.min(xs, axis=0))
        want = np.concatenate([xs[i][sum((i + j) % 3 * 5 for j in range(r)):][:(i + r) % 3 * 5]
                               for i in range(WORLD)])
        np.testing.assert_array_equal(got[r]["alltoallv"], want)
        np.testing.assert_array_equal(got[r]["scatter"], xs[1][r * 10:(r + 1) * 10])
        if r == 0:
            np.testing.assert_array_equal(got[0]["gather"],
                                          np.concatenate([x[:10] for x in xs]))
        np.testing.assert_array_equal(got[r]["program"], total)


def test_what_a_backend_lacks_is_a_typed_error_naming_the_argument() -> None:
    def body(c: Communicator) -> list[str]:
        x = np.ones(8, np.int32)
        names = []
        for call in (lambda: c.allreduce(x, algo="tree"),
                     lambda: c.alltoallv(x, [2] * WORLD, np.empty(8, np.int32), [2] * WORLD,
                                         algo="direct"),
                     lambda: c.send(x, (c.rank + 1) % WORLD),
                     lambda: c.recv(x, (c.rank + 1) % WORLD)):
            with pytest.raises(UnsupportedError) as e:
                call()
            names.append(e.value.argument)
        return names

    assert _world(body) == [["algo", "algo", "dst", "src"]] * WORLD


def test_backends_are_chosen_by_name() -> None:
    assert "__new__" not in vars(Communicator)       # no subclass picked behind the caller
    with pytest.raises(BackendUnavailableError, match="'nic'"):
        Communicator(0, 1, "nic")


def test_a_backend_without_engines_of_its_own_refuses_split_on_every_rank() -> None:
    # The loopback model has neither: every rank gets the same typed error, none hangs.
    def body(comm: Communicator) -> tuple:
        try:
            comm.split(comm.rank % 2)
        except UnsupportedError as e:
            split = (e.argument, "loopback" in str(e))
        try:
            comm.abort()
        except UnsupportedError as e:
            abort = (e.argument, "loopback" in str(e))
        return split, abort, comm.allreduce(np.ones(4, np.int32)).tolist()

    assert _world(body) == [(("color", True), ("backend", True), [WORLD] * 4)] * WORLD
