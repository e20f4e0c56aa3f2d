"""The board backend against the simulated board (two DmaNodes in Verilator): the
runtime posts WORK entries to the submission queue, rings the doorbell and reaps the
completion queue; buffers in pinned host memory and in the GPU-peer window. Results
bit-exact against numpy and bit-identical between the two memories; a program that
cannot fit and a missing board raise typed errors."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

from fpgaccl.errors import BackendUnavailableError, InvalidArgumentError
from fpgaccl.host import Communicator
from fpgaccl.host.board_device import SimDevice
from fpgaccl.host.buffers import DeviceArray

WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def board():
    from fpgaccl.sim.board import BoardProcess
    proc = BoardProcess(idle_timeout_s=300)
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


def _world(path: str, body, **kw) -> list:
    """Run ``body(comm)`` on both ranks (threads: each rank has its own device socket)."""
    port = _free_port()
    out: list = [None] * WORLD
    errors: list = []

    def rank(r: int) -> None:
        try:
            with Communicator(r, WORLD, "board", device=SimDevice(path, r), master_port=port,
                              deadline_s=120, **kw) as comm:
                out[r] = body(comm)
        except BaseException as e:  # reported below, with the rank
            errors.append((r, e))

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(WORLD)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0][1]
    return out


def _inputs(r: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(40 + r)
    return {"i": rng.integers(-1 << 20, 1 << 20, 1000, dtype=np.int32),
            "f": (rng.standard_normal(600) * 100).astype(np.float32)}


@pytest.mark.slow
@pytest.mark.parametrize("memory", ["host", "gpu"])
def test_collectives_through_the_queues(board, memory):
    def body(comm):
        x = _inputs(comm.rank)
        res = {"ar_i": comm.allreduce(x["i"], np.empty_like(x["i"])),
               "ar_max": comm.allreduce(x["i"], np.empty_like(x["i"]), op="max"),
               "ar_f": comm.allreduce(x["f"], np.empty_like(x["f"]))}
        b = x["i"].copy() if comm.rank == 1 else np.zeros_like(x["i"])
        comm.broadcast(b, root=1)
        res["bcast"] = b
        res["ag"] = comm.allgather(x["i"][:200], np.empty(400, np.int32))
        dev = DeviceArray(x["f"])
        comm.allreduce(dev)                       # a GPU buffer, in place
        res["gpu_f"] = dev.get()
        res["cycles"] = comm.impl.last_cycles
        if memory == "host":  # the rest of the API, once
            r = comm.rank
            u = (np.arange(300, dtype=np.uint64) * 2654435761 + r * 977).astype(np.uint32)
            res["u32"] = u
            res["ar_u32"] = comm.allreduce(u, np.empty_like(u))     # wraps modulo 2**32
            res["avg_i"] = comm.allreduce(x["i"], np.empty_like(x["i"]), op="avg")
            res["gather"] = comm.gather(x["i"][:100], np.empty(200, np.int32) if r == 0
                                        else None)
            res["scatter"] = comm.scatter(x["i"][:200] if r == 1 else None,
                                          np.empty(100, np.int32), root=1)
            cnt = [[3, 5], [7, 2]]
            rc = [cnt[0][r], cnt[1][r]]
            res["a2av"] = comm.alltoallv(x["i"][:sum(cnt[r])], cnt[r],
                                         np.empty(sum(rc), np.int32), rc)
            comm.barrier()
            got = np.zeros(50, np.int32)
            if r == 0:
                comm.send(x["i"][:50], 1)
            else:
                comm.recv(got, 0)
            res["p2p"] = got
        return res

    got = _world(board, body, memory=memory)
    xs = [_inputs(r) for r in range(WORLD)]
    ints = (xs[0]["i"].astype(np.int64) + xs[1]["i"]).astype(np.int32)
    floats = xs[0]["f"] + xs[1]["f"]          # two operands: one rounding, any order
    for r in range(WORLD):
        assert np.array_equal(got[r]["ar_i"], ints)
        assert np.array_equal(got[r]["ar_max"], np.maximum(xs[0]["i"], xs[1]["i"]))
        assert got[r]["ar_f"].tobytes() == floats.tobytes()
        assert got[r]["gpu_f"].tobytes() == floats.tobytes()
        assert np.array_equal(got[r]["bcast"], xs[1]["i"])
        assert np.array_equal(got[r]["ag"], np.concatenate([x["i"][:200] for x in xs]))
        assert got[r]["cycles"] > 0
        if memory == "host":
            u = [got[k]["u32"] for k in range(WORLD)]
            assert got[r]["ar_u32"].tobytes() == (u[0] + u[1]).tobytes()
            assert got[r]["avg_i"].tolist() == [v // 2 if v >= 0 else -(-v // 2)
                                                for v in ints.tolist()]
            assert np.array_equal(got[r]["scatter"], xs[1]["i"][r * 100:(r + 1) * 100])
            want = {0: np.concatenate([xs[0]["i"][:3], xs[1]["i"][:7]]),
                    1: np.concatenate([xs[0]["i"][3:8], xs[1]["i"][7:9]])}[r]
            assert np.array_equal(got[r]["a2av"], want)
    if memory == "host":
        assert np.array_equal(got[0]["gather"], np.concatenate([x["i"][:100] for x in xs]))
        assert got[1]["gather"] is None
        assert np.array_equal(got[1]["p2p"], xs[0]["i"][:50])


SCRIPT = textwrap.dedent("""
    import numpy as np
    import fpgaccl
    comm = fpgaccl.init(memory="gpu")
    x = np.arange(3000, dtype=np.int32) * (comm.rank + 1)
    comm.allreduce(x)
    assert np.array_equal(x, np.arange(3000, dtype=np.int32) * 3), x[:8]
    print(f"rank {comm.rank} ok {comm.backend} {comm.impl.last_cycles}")
    comm.close()
""")


@pytest.mark.slow
def test_fpgaccl_run_backend_board(board, tmp_path):
    """The launcher hands each rank FPGACCL_BACKEND=board and the board's address; the
    unchanged ``fpgaccl.init()`` script then runs on the board's engines."""
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    proc = subprocess.run(
        [sys.executable, "-m", "fpgaccl.host.cli", "run", "-n", "2", "--backend", "board",
         "--", sys.executable, str(script)],
        env={**os.environ, "FPGACCL_BOARD": f"sim:{board}"}, capture_output=True, text=True,
        timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for r in range(2):
        assert f"rank {r} ok board" in proc.stdout


def test_bad_arguments_name_themselves():
    with pytest.raises(InvalidArgumentError, match="memory"):
        Communicator(0, 1, "board", memory="flash")
    with pytest.raises(InvalidArgumentError, match="stage_bytes"):
        Communicator(0, 1, "board", stage_bytes=1000)


def test_probe_reads_the_build_from_the_engine(board):
    # ctrl.config as the Verilator-built DmaNode drives it: the build's parameters,
    # its MTU among them, agree with what the simulated board advertises.
    from fpgaccl.host.backends.board import probe
    from fpgaccl.sim.tb.dma_node_top import PARAMS
    dev = SimDevice(board, 0)
    try:
        got = probe(dev)
    finally:
        dev.close()
    assert got == {"qps": PARAMS["qps"], "regions": PARAMS["regions"],
                   "imem_words": PARAMS["imem_words"], "width": dev.info["width"],
                   "mtu": PARAMS["mtu"]}


def test_engines_built_for_different_mtus_are_refused_on_every_rank(board, monkeypatch):
    # Rank 1's engine reads as a 4096-byte build: each rank sees the other's MTU at
    # rendezvous and refuses the world, instead of timing out on drops.oversize later.
    from fpgaccl.host.backends import board as board_backend
    real = board_backend.probe

    def probe(dev):
        got = real(dev)
        return {**got, "mtu": 4096} if dev.node == 1 else got

    monkeypatch.setattr(board_backend, "probe", probe)
    port = _free_port()
    errors: list = [None] * WORLD

    def rank(r: int) -> None:
        dev = SimDevice(board, r)
        try:
            Communicator(r, WORLD, "board", device=dev, master_port=port, deadline_s=60)
        except BaseException as e:
            errors[r] = e
        finally:
            dev.close()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(WORLD)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in range(WORLD):
        assert isinstance(errors[r], BackendUnavailableError), (r, errors[r])
        assert "different MTUs ([1024, 4096]" in str(errors[r])


class _Registers:
    """A device that is nothing but a register file (the probe reads ctrl only)."""

    def __init__(self, info: dict, **regs: int) -> None:
        from fpgaccl.proto.reduce import DType, ReduceOp
        from fpgaccl.proto.regmap import (
            ENGINE_ID,
            REGMAP_VERSION,
            config_word,
            default_map,
            features_word,
        )
        self.node, self.info, at = 0, info, default_map().address
        self.regs = {at("ctrl.id"): ENGINE_ID, at("ctrl.version"): REGMAP_VERSION,
                     at("ctrl.features"): features_word(dma=True, dtypes=[DType.INT32],
                                                        ops=[ReduceOp.SUM]),
                     at("ctrl.config"): config_word(qps=2, regions=2, imem_words=64,
                                                    width=64, mtu=1024)}
        self.regs.update({at(f"ctrl.{k}"): v for k, v in regs.items()})

    def csr_read(self, addr: int) -> int:
        return self.regs[addr]


def test_probe_refuses_another_engine_map_or_build():
    from fpgaccl.host.backends.board import probe
    from fpgaccl.proto.regmap import REGMAP_VERSION, config_word
    info = {"qps": 2, "regions": 2, "imem_words": 64, "mtu": 1024, "width": 64}
    assert probe(_Registers(info))["mtu"] == 1024
    with pytest.raises(BackendUnavailableError, match=r"ctrl\.id reads 0xdeadbeef"):
        probe(_Registers(info, id=0xDEADBEEF))
    with pytest.raises(BackendUnavailableError,
                       match=f"version {REGMAP_VERSION - 1}, this runtime drives"):
        probe(_Registers(info, version=REGMAP_VERSION - 1))
    with pytest.raises(BackendUnavailableError, match=r"ctrl\.features\.dma reads 0"):
        probe(_Registers(info, features=0))
    other = config_word(qps=2, regions=2, imem_words=64, width=64, mtu=4096)
    with pytest.raises(BackendUnavailableError, match="mtu=4096; the device advertises mtu=1024"):
        probe(_Registers(info, config=other))


def test_no_board_is_a_typed_error(monkeypatch):
    monkeypatch.delenv("FPGACCL_BOARD", raising=False)
    with pytest.raises(BackendUnavailableError, match="FPGACCL_BOARD"):
        Communicator(0, 1, "board")


@pytest.mark.slow
def test_driver_unmapped_copy_is_an_error_completion_and_moves_nothing(board):
    from fpgaccl.errors import TransportError
    from fpgaccl.host.driver import check_completion
    from fpgaccl.proto.queues import Opcode, Space, Status

    with Communicator(0, 1, "board", device=SimDevice(board, 0), master_port=_free_port(),
                      deadline_s=60) as comm:
        port = comm.impl.port
        drv, dev = port.driver, port.dev
        src, dst = port.local[2], port.local[3]            # TMP, TMP2: inside the window
        dev.host_write(src, bytes(range(256)))
        dev.host_write(dst, bytes(256))
        outside = 0x7000_0000                              # no host window maps it
        bad = drv.post(Opcode.COPY, src_space=Space.HOST, dst_space=Space.HOST,
                       src_addr=outside, dst_addr=dst, len=256)
        drv.doorbell()
        (cqe,) = drv.reap(1, timeout_s=60, name="copy", rank=0)
        assert cqe["wr_id"] == bad and Status(cqe["status"]) is Status.UNMAPPED
        with pytest.raises(TransportError, match="UNMAPPED"):
            check_completion(cqe, wr_id=bad, name="copy", rank=0)
        assert dev.host_read(dst, 256) == bytes(256)
        # The queue goes on after an error completion.
        good = drv.post(Opcode.COPY, src_space=Space.HOST, dst_space=Space.HOST,
                        src_addr=src, dst_addr=dst, len=256)
        drv.doorbell()
        (cqe,) = drv.reap(1, timeout_s=60, name="copy", rank=0)
        check_completion(cqe, wr_id=good, name="copy", rank=0)
        assert dev.host_read(dst, 256) == bytes(range(256))
