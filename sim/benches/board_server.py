"""cocotb "test" that turns the DmaNode pair into the ``board`` backend's device.

Two :class:`fpgaccl.hw.dma_node.DmaNode` engines, back to back, each with its host- and
GPU-memory models (:class:`~.dma_node.TB`). Each rank of the ``board`` backend connects
over a Unix socket (``params["socket"]``), claims node ``rank`` and then does exactly
what a driver does with a PCIe board (:class:`fpgaccl.host.board_device.SimDevice` is
the client): posted register writes and register reads through the BAR, loads and
stores in its pinned host memory, GPU memory and page pinning for the GPU-peer window.
Everything else -- fetching work entries, DMA, the collective, completions -- is the
hardware's.

The clock runs free in batches of :data:`BATCH` cycles while any rank is connected (a
board does not stop while its host thinks); requests are served between batches. Like a
card, the board outlives the processes that use it: ranks may come and go (the engines
keep their state, the driver re-attaches), and it ends on a ``shutdown`` request or after
``idle_timeout_s`` without any rank.
Messages: the ``>II`` + JSON header + payload frames of :mod:`fpgaccl.host.sim_backend`.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import socket
import time

import cocotb
from cocotb.triggers import ClockCycles, Event

from fpgaccl.proto.framing import FrameReader, encode
from fpgaccl.proto.regmap import ENGINE_ID
from fpgaccl.sim import bench_params
from fpgaccl.sim.hdl.switch import node_ip, node_mac
from fpgaccl.sim.models.gpu import VA_BASE

from .dma_harness import _CsrOp
from .dma_node import TB
from .dma_node_top import PARAMS

BATCH = 32
"""Clock cycles between two looks at the socket."""


class Client:
    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.reader, self.node = sock, FrameReader(), None

    def reply(self, header: dict, payload: bytes = b"") -> None:
        self.sock.setblocking(True)
        try:
            self.sock.sendall(encode({"ok": True, **header}, payload))
        except OSError:
            pass
        finally:
            self.sock.setblocking(False)

    def error(self, err: str, detail: str) -> None:
        self.sock.setblocking(True)
        try:
            self.sock.sendall(encode({"error": err, "detail": detail}))
        except OSError:
            pass
        finally:
            self.sock.setblocking(False)


class Server:
    def __init__(self, dut, p: dict) -> None:
        self.tb = TB(dut, seed=p.get("seed", 0))
        self.clients: dict[int, Client] = {}
        self.stop = False
        self.csr_ops = 0

    async def _csr(self, node: int, addr: int, value: int | None) -> int:
        op = _CsrOp(addr, value, "host", Event())
        self.tb.csr_q.append((node, op))
        await op.done.wait()
        self.csr_ops += 1
        return op.result

    async def handle(self, client: Client, h: dict, payload: bytes) -> None:
        op, tb = h.get("op"), self.tb
        if op == "hello":
            node = h.get("node")
            if not isinstance(node, int) or not 0 <= node < len(tb.hosts):
                return client.error("rank", f"node {node!r}: the device has "
                                    f"{len(tb.hosts)} engines")
            if node in self.clients:
                return client.error("rank", f"node {node} is already claimed")
            client.node = node
            self.clients[node] = client
            # A card's MAC comes from its EEPROM and its IP from the admin; these stand in.
            return client.reply({"nodes": len(tb.hosts), "width": tb.width,
                                 "mac": node_mac(node), "ip": node_ip(node),
                                 "gpu_va_base": VA_BASE, "clock_ns": 4, **PARAMS})
        node = client.node
        if node is None:
            return client.error("hello", f"{op!r} before hello")
        if op == "csr_write":
            for addr, value in h["writes"]:
                await self._csr(node, int(addr), int(value))
            return client.reply({"cycle": tb.cycle})
        if op == "csr_read":
            return client.reply({"value": await self._csr(node, int(h["addr"]), None)})
        if op == "host_write":
            tb.hosts[node].mem.write(int(h["addr"]), payload)
            return client.reply({})
        if op == "host_read":
            return client.reply({}, tb.hosts[node].mem.read(int(h["addr"]), int(h["n"])))
        if op == "gpu_alloc":
            return client.reply({"va": tb.gpus[node].alloc(int(h["nbytes"]))})
        if op == "gpu_write":
            tb.gpus[node].write_va(int(h["va"]), payload)
            return client.reply({})
        if op == "gpu_read":
            return client.reply({}, tb.gpus[node].read_va(int(h["va"]), int(h["n"])))
        if op == "gpu_pin":
            ptes = tb.gpus[node].register(int(h["va"]), int(h["nbytes"]), write=h["write"])
            return client.reply({"pages": [[e.index, e.bus, e.read, e.write] for e in ptes]})
        if op == "pause":
            await ClockCycles(tb.dut.clk, int(h.get("cycles", BATCH)))
            return client.reply({"cycle": tb.cycle})
        if op == "stats":
            return client.reply({"cycle": tb.cycle, "csr_ops": self.csr_ops})
        if op == "shutdown":
            self.stop = True
            return None
        return client.error("op", f"unknown request {op!r}")

    def left(self, client: Client) -> None:
        if client.node is not None and self.clients.get(client.node) is client:
            del self.clients[client.node]


@cocotb.test()
async def serve(dut) -> None:
    p = bench_params()
    srv = Server(dut, p)
    await srv.tb.reset()
    rmap = srv.tb.rmap
    for k in range(len(srv.tb.hosts)):
        assert await srv._csr(k, rmap.address("ctrl.id"), None) == ENGINE_ID
    path = p["socket"]
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    lsock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    lsock.bind(path + ".tmp")
    lsock.listen(8)
    lsock.setblocking(False)
    os.replace(path + ".tmp", path)  # the socket appears only once it accepts
    sel = selectors.DefaultSelector()
    sel.register(lsock, selectors.EVENT_READ)
    idle_since = time.monotonic()
    idle_limit = p.get("idle_timeout_s", 600)
    try:
        while not srv.stop:
            events = sel.select(timeout=0 if srv.clients else 0.05)
            work = []
            for key, _ in events:
                if key.fileobj is lsock:
                    conn, _ = lsock.accept()
                    conn.setblocking(False)
                    sel.register(conn, selectors.EVENT_READ, Client(conn))
                    continue
                client = key.data
                try:
                    data = client.sock.recv(1 << 20)
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    data = b""
                if not data:
                    sel.unregister(client.sock)
                    client.sock.close()
                    srv.left(client)
                    continue
                work += [(client, h, pl) for h, pl in client.reader.feed(data)]
            for client, h, pl in work:
                await srv.handle(client, h, pl)
            if srv.clients:
                await ClockCycles(dut.clk, BATCH)
            if events or srv.clients:
                idle_since = time.monotonic()
            if time.monotonic() - idle_since > idle_limit:
                dut._log.warning("board server: idle for %s s, stopping", idle_limit)
                break
    finally:
        if p.get("summary"):
            with open(p["summary"], "w") as f:
                json.dump({"cycles": srv.tb.cycle, "csr_ops": srv.csr_ops}, f)
        sel.close()
        lsock.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
