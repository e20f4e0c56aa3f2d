"""cocotb "test" that turns the standard cluster into the ``sim`` backend's server.

It listens on a Unix socket (``params["socket"]``); each rank process of
``fpgaccl run --backend sim`` connects, claims node ``rank`` (``hello``) and then sends
collectives: the CSR writes of its program and context (built on the rank by
:func:`fpgaccl.host.csr_plan.collective_writes`) plus its IN bytes. A collective starts
when every rank of the world has submitted it: the server writes each node's IN through
the memory backdoor, loads its program, rings all doorbells, then runs the clock in
batches of :data:`BATCH` cycles until each node's ``busy`` drops, and answers each rank
with its OUT bytes and the cycle count. Requests are polled between clock batches
(non-blocking socket); while nothing runs the server sleeps in ``select`` -- no simulated
time passes then, so ``cycles`` counts engine and bus work only.

Frame format and message fields: :mod:`fpgaccl.host.sim_backend`. At exit it writes the
run summary (cycles, frames, drops by reason, retransmissions) to ``params["summary"]``.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import selectors
import socket
import time

import cocotb
from cocotb.triggers import ClockCycles

from fpgaccl.host.csr_plan import connect_writes, doorbell
from fpgaccl.host.sim_backend import FrameReader, encode
from fpgaccl.proto.regmap import ENGINE_ID
from fpgaccl.sim import bench_params

from .cluster_tb import TB

BATCH = 64
"""Clock cycles between two polls of the socket and of the nodes' ``busy``."""


class Client:
    def __init__(self, sock):
        self.sock, self.reader, self.node = sock, FrameReader(), None

    def reply(self, header, payload=b""):
        self.sock.setblocking(True)
        try:
            self.sock.sendall(encode(header, payload))
        except OSError:
            pass
        finally:
            self.sock.setblocking(False)


class Server:
    def __init__(self, dut, p):
        self.dut, self.p = dut, p
        self.tb = TB(dut, p)
        self.rmap = self.tb.rmap
        self.world = None
        self.hellos = {}          # node -> Client, until the world is complete
        self.clients = {}         # node -> Client
        self.pending = {}         # ("coll"|"barrier", seq) -> {node: (client, header, payload)}
        self.running = {}         # node -> (client, header, start_cycle)
        self.stage_bytes = p["stage_bytes"]
        self.bufs = self.tb.layout(self.stage_bytes)
        self.stats = {"collectives": 0, "node_cycles": 0, "errors": 0}
        self.ever = False
        self.gone = set()         # nodes whose rank left: collectives needing them fail
        self.drops_total = [{} for _ in range(self.tb.nodes)]
        self.stop = False

    # ---------------------------------------------------------------- requests
    async def handle(self, client, h, payload):
        kind = h.get("op")
        if kind == "hello":
            await self.hello(client, h)
        elif kind in ("collective", "barrier"):
            if client.node is None:
                client.reply({"error": "protocol", "detail": "hello first"})
                return
            if self.gone:
                gone = ", ".join(map(str, sorted(self.gone)))
                client.reply({"error": "peer", "detail": f"rank {gone} left the world before "
                              f"calling {h.get('name', kind)}"})
                return
            key = (kind, h["seq"])
            group = self.pending.setdefault(key, {})
            group[client.node] = (client, h, payload)
            if len(group) == self.world:
                del self.pending[key]
                await self.start(kind, group)
        elif kind == "stats":
            client.reply({"ok": True, **(await self.summary())})
        elif kind == "shutdown":
            self.stop = True
        else:
            client.reply({"error": "protocol", "detail": f"unknown op {kind!r}"})

    async def hello(self, client, h):
        node, world = int(h["node"]), int(h["world"])
        if world > self.tb.nodes or (self.world is not None and world != self.world):
            client.reply({"error": "world_size", "detail":
                          f"{world} ranks; this cluster has {self.tb.nodes} nodes"
                          + (f" and a world of {self.world}" if self.world else "")})
            return
        if node in self.hellos or node in self.clients or not 0 <= node < world:
            client.reply({"error": "rank", "detail": f"node {node} is taken or out of range"})
            return
        self.world = world
        client.node = node
        self.hellos[node] = client
        self.ever = True
        if len(self.hellos) < world:
            return
        # The whole world is here: connect every node (the rendezvous of a real run).
        rng = random.Random(self.p.get("seed", 1))
        psns = {(a, b): rng.randrange(1 << 24) for a in range(world) for b in range(world)}
        peers = self.tb.peers(world, self.bufs)
        for k in range(world):
            await self.tb.csr_write(k, connect_writes(
                self.rmap, k, peers, psn=lambda a, b: psns[(a, b)], mem_base=0,
                mem_len=4 * self.bufs[1], mtu_log2=self.p.get("mtu_log2", 10)))
        self.clients, self.hellos = self.hellos, {}
        for c in self.clients.values():
            c.reply({"ok": True, "nodes": self.tb.nodes, "stage_bytes": self.stage_bytes,
                     "buffers": self.bufs, "qps": self.p["qps"],
                     "imem_words": self.p["imem_words"], "clock_ns": self.p.get("clock_ns", 4)})

    async def start(self, kind, group):
        if kind == "barrier":
            for client, _, _ in group.values():
                client.reply({"ok": True})
            return
        heads = {k: h for k, (_, h, _) in group.items()}
        ref = heads[0]
        for k, h in heads.items():
            for f in ("count", "dtype", "name"):
                if h[f] != ref[f]:
                    for client, _, _ in group.values():
                        client.reply({"error": "mismatch", "detail":
                                      f"rank {k} called {h['name']} {f}={h[f]!r}, rank 0 "
                                      f"{ref['name']} {f}={ref[f]!r}"})
                    return
        for k, (_, h, payload) in sorted(group.items()):
            await self.tb.mem_write(k, self.bufs[0], payload)
            await self.tb.csr_write(k, [tuple(w) for w in h["writes"]])
        start = int(self.dut.cycles.value)
        for k, (_, h, _) in sorted(group.items()):
            await self.tb.csr_write(k, [doorbell(self.rmap, h["coll_id"])])
        # `busy` rises within a few cycles of the doorbell; look at it from BATCH on.
        for k, (client, h, _) in group.items():
            self.running[k] = (client, h, start)
        self.stats["collectives"] += 1

    def left(self, node):
        """Rank ``node`` disconnected: whoever waits for it in a collective never gets it.
        (A collective already rung runs to completion: the engine needs no host.)"""
        self.clients.pop(node, None)
        self.hellos.pop(node, None)
        self.running.pop(node, None)
        if self.world is None or node >= self.world:
            return
        self.gone.add(node)
        for key in list(self.pending):
            group = self.pending[key]
            if node in group:
                continue
            del self.pending[key]
            for client, h, _ in group.values():
                client.reply({"error": "peer", "detail": f"rank {node} left the world before "
                              f"calling {h.get('name', key[0])}"})

    async def poll_running(self):
        busy = int(self.dut.busy.value)
        now = int(self.dut.cycles.value)
        limit = self.p.get("max_cycles", 50_000_000)
        status = self.rmap.address("ctrl.status")
        for k in sorted(self.running):
            client, h, start = self.running[k]
            if now - start < BATCH:
                continue
            if busy >> k & 1:
                if now - start > limit:
                    del self.running[k]
                    self.stats["errors"] += 1
                    client.reply({"error": "timeout", "detail": f"node {k}: no completion in "
                                  f"{limit} cycles", "cycles": now - start})
                continue
            del self.running[k]
            cycles = now - start
            self.stats["node_cycles"] += cycles
            st = self.rmap["ctrl"]["status"].decode(await self.tb.csr_read(k, status))
            if st["error"]:
                self.stats["errors"] += 1
                client.reply({"error": "engine", "detail": f"node {k} ended "
                              f"{h['name']} (coll_id {h['coll_id']}) in error",
                              "cycles": cycles})
                continue
            out = await self.tb.mem_read(k, self.bufs[1], int(h["out_bytes"]))
            client.reply({"ok": True, "cycles": cycles}, out)

    async def summary(self):
        world = self.world or 0
        drops = {}
        per_node = []
        for k in range(world):
            node = {}
            for reg in self.rmap["drops"].registers:
                v = await self.tb.csr_read(k, self.rmap.address(f"drops.{reg.name}"))
                self.drops_total[k][reg.name] = self.drops_total[k].get(reg.name, 0) + v
                node[reg.name] = self.drops_total[k][reg.name]
                drops[reg.name] = drops.get(reg.name, 0) + node[reg.name]
            retries = 0
            for p in range(world):
                if p != k:
                    retries += await self.tb.csr_read(k, self.rmap.address("qp.retries", p))
            per_node.append({"node": k, "retransmits": retries,
                             "drops": {n: v for n, v in node.items() if v}})
        return {"nodes": self.tb.nodes, "world": world,
                "cycles": int(self.dut.cycles.value),
                "clock_ns": self.p.get("clock_ns", 4),
                "switch_dropped": int(self.dut.dropped.value),
                "retransmits": sum(n["retransmits"] for n in per_node),
                "drops": {n: v for n, v in drops.items() if v}, "per_node": per_node,
                **self.stats}


@cocotb.test()
async def serve(dut):
    p = bench_params()
    srv = Server(dut, p)
    tb = srv.tb
    await tb.reset()
    assert await tb.csr_read(0, tb.rmap.address("ctrl.id")) == ENGINE_ID
    dut.loss.value = p.get("loss", 0)
    path = p["socket"]
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    lsock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    lsock.bind(path + ".tmp")
    lsock.listen(16)
    lsock.setblocking(False)
    os.replace(path + ".tmp", path)  # the socket appears only once it accepts
    sel = selectors.DefaultSelector()
    sel.register(lsock, selectors.EVENT_READ)
    idle_since = time.monotonic()
    idle_limit = p.get("idle_timeout_s", 600)
    try:
        while not srv.stop:
            busy = bool(srv.running)
            events = sel.select(timeout=0 if busy else 0.05)
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
                    if client.node is not None:
                        srv.left(client.node)
                    continue
                for h, payload in client.reader.feed(data):
                    work.append((client, h, payload))
            for client, h, payload in work:
                await srv.handle(client, h, payload)
            if srv.running:
                await ClockCycles(dut.clk, BATCH)
                await srv.poll_running()
            if events or srv.running:
                idle_since = time.monotonic()
            # Every rank came and went: the run is over.
            if srv.ever and not srv.clients and not srv.hellos:
                break
            if time.monotonic() - idle_since > idle_limit:
                dut._log.warning("sim server: idle for %s s, stopping", idle_limit)
                break
    finally:
        summary = await srv.summary()
        if p.get("summary"):
            with open(p["summary"], "w") as f:
                json.dump(summary, f)
        sel.close()
        lsock.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
