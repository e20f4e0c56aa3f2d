"""A network-attached node as a ``board`` rank: the engine of
:class:`fpgaccl.hw.eth_node.EthNode` reached at an IP address
(``FPGACCL_BOARD=udp:ADDR``), with no DMA engine and no host memory of its own.

What travels how:

* between ranks, every byte of a collective is RoCEv2 from the engine itself: the node
  RDMA-WRITEs into its peers' regions (software ranks' and other nodes') and they into
  its memory, exactly as between software ranks;
* between this host and its node, over the control port (:mod:`fpgaccl.proto.control`):
  the QPs, peers and memory region once (``connect``), then per segment the program and
  context with the doorbell in one CSR_WRITE batch, IN stored into the node's memory
  (MEM_WRITE), completion seen in ``ctrl.completions`` and ``ctrl.status``, OUT read
  back (MEM_READ). The node has no QP that reaches its own host's memory, so these
  copies cannot be RDMA WRITEs (see the README, "On the network").

The node's memory (``2**mem_log2`` bytes, from its HELLO) holds IN, OUT, TMP and TMP2;
each is a quarter of it and a segment is a quarter less the programs' chunk padding, so
a collective larger than that is cut into segments by the Communicator (every rank of
the world cuts the same ones: the smallest region advertised at rendezvous).

The rank joins the software ranks' rendezvous as a simulated rank of a mixed run does,
advertising its node (IP, port 4791, QPN ``0x100 + peer``, PSNs, memory key and
buffers). The node finds its peers' MAC addresses itself, by ARP
(:mod:`fpgaccl.hw.eth.resolver`: its ``qp.peer_mac`` registers are left zero); with
``FPGACCL_BOARD_STATIC_MACS=1`` the rank writes there the MACs this host's kernel
resolves instead (an override, for peers that answer no ARP).
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

import numpy as np

from fpgaccl.errors import (
    BackendUnavailableError,
    CollectiveTimeoutError,
    TransportError,
    UnsupportedError,
)
from fpgaccl.proto.opcodes import ROCEV2_UDP_PORT
from fpgaccl.proto.plans import QPN_BASE, Peer, Writes, connect_writes, doorbell
from fpgaccl.proto.regmap import default_map

from ..neighbors import resolve_mac
from ..rendezvous import exchange, master
from .registers import node_mismatch

STATIC_MACS_ENV = "FPGACCL_BOARD_STATIC_MACS"
PAD_BYTES = 4096
"""Room each buffer keeps for the programs' chunk padding (as the DMA board's)."""
POLL_S = (0.001, 0.05)
"""Completion polls: the first wait, then doubling up to the second (each poll is a
round trip the node must answer; a simulated node answers in its own slow time)."""


def _ip_str(ip: int) -> str:
    return socket.inet_ntoa(ip.to_bytes(4, "big"))


def _ip_int(ip: str) -> int:
    return int.from_bytes(socket.inet_aton(ip), "big")


def region_layout(mem_log2: int, stage_bytes: int) -> tuple[int, int]:
    """(span, stage): each buffer's span in node memory and the segment size, for a node
    memory of ``2**mem_log2`` bytes and a requested ``stage_bytes``."""
    span = (1 << mem_log2) // 4
    span -= span % 4096
    stage = min(stage_bytes, span - PAD_BYTES)
    stage -= stage % 4096
    if stage < 4096:
        raise UnsupportedError("stage_bytes", f"a node memory of {1 << mem_log2} bytes holds "
                               "no 4 KiB segment in each of IN, OUT, TMP and TMP2")
    return span, stage


class NetworkNodePort:
    """The :class:`~fpgaccl.host.backends.registers.NodePort` of a node behind a control
    port (``dev``: a :class:`~fpgaccl.host.board_device.UdpDevice`)."""

    native_barrier = False

    def __init__(self, rank: int, world_size: int, dev: Any, config: dict[str, int], *,
                 stage_bytes: int, master_addr: str | None, master_port: int | None,
                 timeout_s: float) -> None:
        self.rank, self.world_size, self.dev = rank, world_size, dev
        info = dev.info
        self.config = config
        if world_size > config["qps"]:
            raise UnsupportedError("world_size", f"{world_size} ranks; the node at "
                                   f"{dev.name} has {config['qps']} queue pairs (one per rank)")
        self.clock_mhz = 1000 / info.get("clock_ns", 4)
        self.imem_words = config["imem_words"]
        self.rmap = default_map(qps=config["qps"], regions=config["regions"],
                                imem_words=self.imem_words, dma=False)
        self.mem_bytes = 1 << int(info["mem_log2"])
        span, stage = region_layout(int(info["mem_log2"]), stage_bytes)
        self.buffers = [i * span for i in range(4)]
        self.ip = _ip_str(int(info["ip"]))
        self.mac = int(info["mac"])
        rng = np.random.default_rng()
        self.key = int(rng.integers(1, 1 << 32))
        qps = {str(p): {"qpn": QPN_BASE + p, "psn": int(rng.integers(0, 1 << 24)),
                        "va": 0, "rkey": 0}   # no per-peer receive ring (send/recv)
               for p in range(world_size) if p != rank}
        me = {"ip": self.ip, "port": ROCEV2_UDP_PORT, "qps": qps, "backend": "board",
              "mtu": config["mtu"],
              "coll": {"key": self.key, "buffers": self.buffers, "stage_bytes": stage}}
        host, port = master(master_addr, master_port)
        table = exchange(rank, world_size, (socket.gethostbyname(host), port), me, timeout_s)
        mtus = {t["mtu"] for t in table if "mtu" in t}
        if len(mtus) > 1:
            raise BackendUnavailableError(f"the world's nodes were built for different MTUs "
                                          f"({sorted(mtus)}): every engine must carry the "
                                          "same packets")
        static = os.environ.get(STATIC_MACS_ENV, "") not in ("", "0")
        peers = [Peer(self.mac if p == rank else resolve_mac(t["ip"]) if static else 0,
                      _ip_int(t["ip"]), int(t["coll"]["key"]),
                      [int(b) for b in t["coll"]["buffers"]])
                 for p, t in enumerate(table)]
        dev.csr_write(connect_writes(
            self.rmap, rank, peers, psn=lambda a, b: int(table[a]["qps"][str(b)]["psn"]),
            mem_base=0, mem_len=4 * span))
        # Every rank cuts the same segments: from the smallest region of the world.
        self.stage_bytes = min(int(t["coll"]["stage_bytes"]) for t in table)
        at = self.rmap.address
        self._status, self._completions = at("ctrl.status"), at("ctrl.completions")
        self.collectives = 0

    def execute(self, name: str, coll_id: int, writes: Writes, inbuf: bytes,
                out_bytes: int, signature: dict[str, Any], deadline_s: float
                ) -> tuple[bytes, int]:
        dev = self.dev
        if inbuf:
            dev.host_write(self.buffers[0], inbuf)
        n = (self._completions - self._status) // 4 + 1
        before = dev.csr_read_many(self._status, n)[-1]
        dev.csr_write([*writes, doorbell(self.rmap, coll_id & 0xFFFF)])
        end = time.monotonic() + deadline_s
        wait = POLL_S[0]
        while True:
            regs = dev.csr_read_many(self._status, n)
            if regs[-1] != before:
                break
            if time.monotonic() > end:
                raise CollectiveTimeoutError(name, self.rank, deadline_s,
                                             f"the node at {dev.name} has not completed "
                                             f"it; ctrl.status {regs[0]:#x}")
            time.sleep(wait)
            wait = min(2 * wait, POLL_S[1])
        status = self.rmap["ctrl"]["status"].decode(regs[0])
        if (e := node_mismatch(self.rmap, status, dev.csr_read)) is not None:
            raise e
        if status["error"] or status["datapath"]:
            raise TransportError(f"rank {self.rank}: {name}: the node at {dev.name} ended "
                                 f"the program in error ({status})")
        self.collectives += 1
        return (dev.host_read(self.buffers[1], out_bytes) if out_bytes else b""), 0

    def barrier(self, deadline_s: float) -> None:
        raise NotImplementedError("the backend synchronises with an allreduce")

    def drop_counters(self) -> dict[str, int]:
        regs = self.rmap["drops"].registers
        base = self.rmap.address(f"drops.{regs[0].name}")
        values = self.dev.csr_read_many(base, len(regs))
        return {r.name: values[(self.rmap.address(f"drops.{r.name}") - base) // 4]
                for r in regs}

    def stats(self) -> dict[str, int]:
        return {"segments": self.collectives, "control_requests": self.dev.requests,
                "control_resent": self.dev.resent}

    def close(self) -> None:
        self.dev.close()
