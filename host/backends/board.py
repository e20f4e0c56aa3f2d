"""The ``board`` backend: each rank drives its own DMA-capable engine the way a driver
drives a PCIe card -- registers through the BAR, work through the submission queue,
completions from the completion queue, data in pinned host memory or in GPU memory
behind the GPU-peer window.

``Communicator(rank, world, backend="board")`` finds its device (:mod:`..board_device`:
on this machine the simulated board of :mod:`fpgaccl.sim.board`, named by
``FPGACCL_BOARD=sim:PATH``), exchanges addresses, PSNs and keys with the other ranks at
rendezvous (MASTER_ADDR/MASTER_PORT, as the software backend), connects its queue pairs
and sets up the queues. A collective then is, per segment: IN stored into the engine's
buffer, the program and context written
(:func:`fpgaccl.proto.plans.collective_writes`), one
``WORK`` entry posted, the doorbell, the completion reaped and checked, OUT read back.
The engine itself fetches the entry, runs the program and writes the completion.

``memory="gpu"`` puts the engine's IN/OUT/TMP/TMP2 in GPU memory: the runtime pins
the pages and installs them in the window's page table, and every byte the engine moves
goes through its GPU port. (The simulated board's GPU memory is a model inside the
simulator, so the user's buffer is copied into it; on a GPU machine the pinned user
buffer itself is the target.)

The board is the register-driven backend (:mod:`.registers`) over a :class:`BoardPort`,
as the simulated cluster is over its own port, so results are bit-identical to the
software and sim backends; its limits apply (library programs only, the program must
fit the engine's instruction memory; the simulated board has two engines).
"""

from __future__ import annotations

import socket
from typing import Any

import numpy as np

from fpgaccl.errors import BackendUnavailableError, InvalidArgumentError, UnsupportedError
from fpgaccl.proto.plans import Peer, Writes, connect_writes
from fpgaccl.proto.queues import Opcode, Space, Status, node_addr, work_imm
from fpgaccl.proto.regmap import ENGINE_ID, REGMAP_VERSION, config_fields, default_map

from ..board_device import SimDevice
from ..driver import Device, QueueDriver, check_completion
from ..rendezvous import exchange, master
from .network import NetworkNodePort
from .registers import RegisterBackend, node_mismatch

RING_BASE = 0x0800_0000
"""Pinned host memory of the SQ and CQ (a DMA window of their own)."""
DATA_BASE = 0x1000_0000
"""Pinned host memory of IN, OUT, TMP, TMP2 (``memory="host"``)."""
BOARD_STAGE_BYTES = 64 * 1024
"""Each of the four buffers; the segment size."""


def has_dma(dev: Any) -> bool:
    """Whether the engine behind ``dev`` says it has the DMA engine (queues, windows):
    a network-attached node (:class:`~fpgaccl.hw.eth_node.EthNode`) has not."""
    at = default_map().address
    return bool(default_map()["ctrl"]["features"].decode(
        dev.csr_read(at("ctrl.features")))["dma"])


def probe(dev: Any, *, dma: bool = True) -> dict[str, int]:
    """What the engine says it is, read from its registers as a driver does before it
    trusts any other address: ``ctrl.id``, ``ctrl.version`` and the build parameters in
    ``ctrl.config`` (qps, regions, imem_words, width in bits, mtu), and ``ctrl.features``.
    An engine of another register-map version, one without the DMA engine this backend
    drives (``dma``), or one that is not the build the device advertises (its ``info``),
    is refused here rather than programmed through the wrong map."""
    rmap = default_map()   # the ctrl block's addresses are the same in every build
    at = rmap.address
    node = getattr(dev, "node", "?")
    ident = dev.csr_read(at("ctrl.id"))
    if ident != ENGINE_ID:
        raise BackendUnavailableError(f"engine {node}: ctrl.id reads {ident:#010x}, not "
                                      f"{ENGINE_ID:#010x} ('FCCL'): no fpgaccl engine there")
    version = dev.csr_read(at("ctrl.version"))
    if version != REGMAP_VERSION:
        raise BackendUnavailableError(
            f"engine {node}: its register map is version {version}, this runtime drives "
            f"version {REGMAP_VERSION}: build the bitstream from this fpgaccl")
    if dma and not has_dma(dev):
        raise BackendUnavailableError(f"engine {node}: ctrl.features.dma reads 0: a build "
                                      "without the DMA engine has no queues to drive")
    got = config_fields(dev.csr_read(at("ctrl.config")))
    info = getattr(dev, "info", {})
    wrong = {k: (v, info[k]) for k, v in got.items() if k in info and int(info[k]) != v}
    if wrong:
        raise BackendUnavailableError(
            f"engine {node}: ctrl.config says " + ", ".join(
                f"{k}={v}" for k, (v, _) in wrong.items()) + "; the device advertises " +
            ", ".join(f"{k}={i}" for k, (_, i) in wrong.items()))
    return got


class BoardPort:
    """An engine behind a :class:`~fpgaccl.host.driver.Device`: registers through its
    BAR, work through the submission queue, data in pinned host or GPU memory."""

    native_barrier = False

    def __init__(self, rank: int, world_size: int, dev: Device, *, memory: str,
                 stage_bytes: int, master_addr: str | None, master_port: int | None,
                 timeout_s: float) -> None:
        self.rank, self.dev, self.memory = rank, dev, memory
        info = dev.info
        self.nodes = int(info["nodes"])
        if world_size > self.nodes:
            raise UnsupportedError("world_size", f"{world_size} ranks; the board has "
                                   f"{self.nodes} engines")
        self.clock_mhz = 1000 / info.get("clock_ns", 4)
        self.config = probe(dev)
        self.imem_words = self.config["imem_words"]
        self.rmap = default_map(qps=self.config["qps"], regions=self.config["regions"],
                                imem_words=self.imem_words, gpu_pages=int(info["gpu_pages"]))
        self.stage_bytes = stage_bytes
        span = stage_bytes + 4096        # room for the programs' chunk padding
        if memory == "gpu":
            base = dev.gpu_alloc(4 * span)
            self.space = Space.GPU
        else:
            base = DATA_BASE
            self.space = Space.HOST
        self.local = [base + i * span for i in range(4)]
        """The engine's IN, OUT, TMP, TMP2 in this host's (or GPU's) address space."""
        self.buffers = [node_addr(self.space, a) for a in self.local]
        self.driver = QueueDriver(dev, self.rmap, ring_base=RING_BASE)
        self.driver.setup(host_windows=[(RING_BASE, 0x2_0000, True, True)] + (
            [(DATA_BASE, 4 * span, True, True)] if memory == "host" else []))
        if memory == "gpu":
            self.driver.register_gpu(base, 4 * span)

        rng = np.random.default_rng()
        key = int(rng.integers(1, 1 << 32))
        psns = {str(p): int(rng.integers(0, 1 << 24)) for p in range(world_size)}
        me = {"mac": int(info["mac"]), "ip": int(info["ip"]), "key": key,
              "buffers": self.buffers, "psn": psns, "mtu": self.config["mtu"]}
        host, port = master(master_addr, master_port)
        table = exchange(rank, world_size, (socket.gethostbyname(host), port), me, timeout_s)
        peers = [Peer(t["mac"], t["ip"], t["key"], t["buffers"]) for t in table]
        # An engine drops a packet longer than its own MTU (drops.oversize): a world of
        # mixed builds would only ever time out, so it is refused at the start instead.
        mtus = [t.get("mtu") for t in table]
        if len(set(mtus)) > 1:
            raise BackendUnavailableError(f"the ranks' engines were built for different "
                                          f"MTUs ({mtus}, by rank; None: a runtime that "
                                          "does not tell it): every engine of a world "
                                          "must carry the same packets")
        dev.csr_write(connect_writes(
            self.rmap, rank, peers, psn=lambda a, b: table[a]["psn"][str(b)],
            mem_base=self.buffers[0], mem_len=4 * span))

    def execute(self, name: str, coll_id: int, writes: Writes, inbuf: bytes,
                out_bytes: int, signature: dict[str, Any], deadline_s: float
                ) -> tuple[bytes, int]:
        dev, drv = self.dev, self.driver
        self._store(self.local[0], inbuf)
        dev.csr_write(writes)
        start = dev.cycle()
        wr_id = drv.post(Opcode.WORK, imm=work_imm(0, coll_id))
        drv.doorbell()
        cqe = drv.reap(1, timeout_s=deadline_s, name=name, rank=self.rank)[0]
        if cqe["status"] == Status.PROGRAM_ERROR:
            status = self.rmap["ctrl"]["status"].decode(
                dev.csr_read(self.rmap.address("ctrl.status")))
            if (e := node_mismatch(self.rmap, status, dev.csr_read)) is not None:
                raise e
        check_completion(cqe, wr_id=wr_id, name=name, rank=self.rank)
        cycles = dev.cycle() - start
        return self._load(self.local[1], out_bytes), cycles

    def _store(self, addr: int, data: bytes) -> None:
        if self.space == Space.GPU:
            self.dev.gpu_write(addr, data)
        else:
            self.dev.host_write(addr, data)

    def _load(self, addr: int, n: int) -> bytes:
        if self.space == Space.GPU:
            return self.dev.gpu_read(addr, n)
        return self.dev.host_read(addr, n)

    def barrier(self, deadline_s: float) -> None:
        raise NotImplementedError("the backend synchronises with an allreduce")

    def drop_counters(self) -> dict[str, int]:
        return {reg.name: self.dev.csr_read(self.rmap.address(f"drops.{reg.name}"))
                for reg in self.rmap["drops"].registers}

    def stats(self) -> dict[str, int]:
        return {"cycles": self.dev.cycle(), "completed": self.driver.next_id - 1}

    def close(self) -> None:
        self.dev.close()


def open_board(rank: int, world_size: int, *, device: Device | None = None,
               memory: str = "host", stage_bytes: int = BOARD_STAGE_BYTES,
               master_addr: str | None = None, master_port: int | None = None,
               rendezvous_timeout_s: float = 600.0, pcap: Any = None, impair: Any = None,
               **_software_only: Any) -> RegisterBackend:
    """The ``board`` backend for ``rank``: ``device``, else the one ``FPGACCL_BOARD``
    names (options the software engine alone has are accepted and have no effect)."""
    if memory not in ("host", "gpu"):
        raise InvalidArgumentError("memory", f"{memory!r} is not 'host' or 'gpu'")
    if pcap or impair:
        raise UnsupportedError("pcap" if pcap else "impair",
                               "the board's wire is its own; capture it on the link")
    if stage_bytes < 4096 or stage_bytes % 4096:
        raise InvalidArgumentError("stage_bytes", f"{stage_bytes} is not a positive "
                                   "multiple of 4096")
    dev = device if device is not None else SimDevice.from_env(rank)
    try:
        if has_dma(dev):
            port = BoardPort(rank, world_size, dev, memory=memory, stage_bytes=stage_bytes,
                             master_addr=master_addr, master_port=master_port,
                             timeout_s=rendezvous_timeout_s)
        else:
            if memory != "host":
                raise UnsupportedError("memory", "a network-attached node has no "
                                       "GPU-peer window")
            port = NetworkNodePort(rank, world_size, dev, probe(dev, dma=False),
                                   stage_bytes=stage_bytes, master_addr=master_addr,
                                   master_port=master_port, timeout_s=rendezvous_timeout_s)
    except BaseException:
        if device is None:
            dev.close()   # ours; the caller's stays theirs until close() takes it
        raise
    # A network node's world may hold software ranks, whose barrier has no program: a
    # closing barrier would wait for them forever (as in the sim backend's mixed runs).
    return RegisterBackend("board", rank, world_size, port,
                           barrier_at_close=isinstance(port, BoardPort))
