"""The standard cluster as the ``sim`` backend's server.

The server loop (:mod:`fpgaccl.sim.servers.loop`) listens on a Unix socket; each rank
process of ``fpgaccl run --backend sim`` connects, claims node ``rank`` (``hello``) and then sends
collectives: the CSR writes of its program and context (built on the rank by
:func:`fpgaccl.proto.plans.collective_writes`) plus its IN bytes. A sub-communicator's
member connects again and sends ``join`` as its node in it. A collective starts when every
rank of its communicator has submitted it and each of their nodes is free (a node runs
one program at a time; collectives of different communicators start in whatever order
they become ready): the server writes each node's IN through
the memory backdoor, loads its program, rings all doorbells, then runs the clock in
batches of :data:`BATCH` cycles until each node's ``busy`` drops, and answers each rank
with its OUT bytes and the cycle count. While nothing runs no simulated time passes, so
``cycles`` counts engine and bus work only.

Frame format: :mod:`fpgaccl.proto.framing`; message fields: the client,
:mod:`fpgaccl.host.backends.sim`. The run summary (cycles, frames, drops by reason,
retransmissions) is :meth:`ClusterServer.summary`.

Mixed runs (``fpgaccl run --sim-ranks``): only some ranks of the world are simulated
nodes; the others are software-backend engines on real UDP sockets. A simulated rank's
``hello`` then names the world's ``sim_ranks`` and the node's IP; the server binds that
IP's port 4791 in the :class:`fpgaccl.sim.bridge.UdpBridge`, answers with the node's
buffers and key, and the rank joins the software ranks' TCP rendezvous. With the table
(``connect {table}``) the server programs the node's QPs and peers with the real
addresses, PSNs, buffers and keys, and hands the software ranks' switch ports to the
bridge (the cluster's ``external`` register). A collective starts when every simulated
rank has submitted it. While ranks are connected the server moves frames between the
switch's external ports and the bridge between clock batches, and keeps the clock
running for :data:`TAIL` cycles after the last bridged frame (retransmission timers
and coalesced ACKs need simulated time). Bridge options: ``params["bridge"]`` (``loss``,
``seed``, ``pcap``, ``pcap_inbound``, ``tap``; :data:`fpgaccl.sim.server.BRIDGE_ENV`).
"""

from __future__ import annotations

import random

from cocotb.triggers import ClockCycles

from fpgaccl.proto.plans import Peer, connect_writes, doorbell
from fpgaccl.proto.regmap import ENGINE_ID
from fpgaccl.proto.signature import Signature
from fpgaccl.sim.bridge import UdpBridge, ip_int
from fpgaccl.sim.hdl.switch import node_mac
from fpgaccl.sim.tb.cluster_tb import TB, ExternalPort

BATCH = 64
"""Clock cycles between two polls of the socket and of the nodes' ``busy``."""
TAIL = 3 * 4096
"""Mixed runs: cycles the clock keeps running after the last bridged frame, so that a
node's retransmission timer (4096 cycles) can fire and its ACKs go out."""
PUMP_FRAMES = 16
"""Mixed runs: frames taken from each external port per pass of the server's loop."""
KEY_BASE = 0x1000
"""Memory key of node ``k``: ``KEY_BASE + k`` (as :meth:`TB.peers` advertises it)."""


class ClusterServer:
    """The standard cluster as the ``sim`` backend's server (driven by
    :func:`fpgaccl.sim.servers.loop.serve`)."""

    name = "sim server"

    def __init__(self, dut, p):
        self.dut, self.p = dut, p
        self.tb = TB(dut, p)
        self.rmap = self.tb.rmap
        self.world = None
        self.hellos = {}          # node -> Client, until the world is complete
        self.clients = {}         # node -> Client
        self.pending = {}         # (comm, op, seq) -> {node: (client, header, payload)}
        self.running = {}         # node -> (client, header, start_cycle)
        self.ready = []           # checked collectives waiting for their nodes to be free
        self.subs = {}            # client -> (comm, nodes): a sub-communicator's member
        self.stage_bytes = p["stage_bytes"]
        self.bufs = self.tb.layout(self.stage_bytes)
        self.stats = {"collectives": 0, "node_cycles": 0, "errors": 0}
        self.ever = False
        self.gone = set()         # nodes whose rank left: collectives needing them fail
        self.drops_total = [{} for _ in range(self.tb.nodes)]
        self.stop = False
        # Mixed runs: the simulated ranks, the bridge and the switch ports it serves.
        self.sim_ranks = None
        self.bridge = None
        self.ports = {}           # external switch port -> ExternalPort
        self.tail = 0             # cycles to keep clocking for the bridge

    async def start(self):
        await self.tb.reset()
        assert await self.tb.csr_read(0, self.rmap.address("ctrl.id")) == ENGINE_ID
        self.dut.loss.value = self.p.get("loss", 0)
        self.dut.external.value = 0

    def busy(self):
        return bool(self.running) or self.tail > 0

    async def step(self):
        if self.ports:
            await self.pump_bridge()
        if self.busy():
            await ClockCycles(self.dut.clk, BATCH)
            self.tail = max(0, self.tail - BATCH)
            await self.poll_running()
            await self.launch()
        if self.ports:
            await self.pump_bridge()

    def sockets(self):
        return self.bridge.sockets() if self.ports else []

    def finished(self):
        # Every rank came and went. (Mixed runs end on the launcher's shutdown: the
        # software ranks may still need the nodes' answers.)
        return (self.ever and not self.clients and not self.hellos and not self.subs
                and self.sim_ranks is None)

    def close(self):
        if self.bridge is not None:
            self.bridge.close()

    # ---------------------------------------------------------------- requests
    async def handle(self, client, h, payload):
        kind = h.get("op")
        if kind == "hello":
            await self.hello(client, h)
        elif kind == "join":
            self.join(client, h)
        elif kind in ("collective", "barrier"):
            if client.node is None:
                client.reply({"error": "protocol", "detail": "hello first"})
                return
            comm, nodes = self.subs.get(client, (None, None))
            if gone := sorted(self.gone if nodes is None else self.gone & set(nodes)):
                client.reply({"error": "peer", "detail": f"rank {', '.join(map(str, gone))} "
                              f"left the world before calling {h.get('name', kind)}"})
                return
            if h.get("group") is not None:
                # send/recv: only the two ends run a program, and the grant makes the
                # sender wait for the receiver, so each node starts when its rank asks.
                await self.start_collective(kind, {client.node: (client, h, payload)})
                return
            key = (comm, kind, h["seq"])
            group = self.pending.setdefault(key, {})
            group[client.node] = (client, h, payload)
            if nodes is not None:
                members = len(nodes)
            else:
                members = self.world if self.sim_ranks is None else len(self.sim_ranks)
            if len(group) == members:
                del self.pending[key]
                await self.start_collective(kind, group)
        elif kind == "connect":
            await self.connect(client, h)
        elif kind == "stats":
            client.reply({"ok": True, **(await self.summary())})
        elif kind == "shutdown":
            self.stop = True
        else:
            client.reply({"error": "protocol", "detail": f"unknown op {kind!r}"})

    async def hello(self, client, h):
        node, world = int(h["node"]), int(h["world"])
        if h.get("sim_ranks") is not None:
            await self.hello_mixed(client, h, node, world)
            return
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
                mem_len=4 * self.bufs[1]))
        self.clients, self.hellos = self.hellos, {}
        for c in self.clients.values():
            c.reply({"ok": True, "nodes": self.tb.nodes, "stage_bytes": self.stage_bytes,
                     "buffers": self.bufs, "qps": self.p["qps"],
                     "imem_words": self.p["imem_words"], "clock_ns": self.p.get("clock_ns", 4)})

    def join(self, client, h):
        """A sub-communicator's member: node ``node`` again, on a connection of its own;
        its collectives start once every node of ``nodes`` has made them."""
        node, nodes, comm = int(h["node"]), [int(k) for k in h["nodes"]], str(h["comm"])
        if self.world is None or self.hellos or self.sim_ranks is not None:
            client.reply({"error": "protocol", "detail": "join needs a world of simulated "
                          "nodes that has formed"})
            return
        taken = any(c == comm and other.node == node for other, (c, _) in self.subs.items())
        if taken or node not in nodes or len(set(nodes)) != len(nodes) or \
                not all(0 <= k < self.world for k in nodes):
            client.reply({"error": "rank", "detail": f"node {node} of {nodes} is taken or "
                          f"out of range in sub-communicator {comm}"})
            return
        client.node = node
        self.subs[client] = (comm, nodes)
        client.reply({"ok": True, "nodes": self.tb.nodes, "stage_bytes": self.stage_bytes,
                      "buffers": self.bufs, "qps": self.p["qps"],
                      "imem_words": self.p["imem_words"], "clock_ns": self.p.get("clock_ns", 4)})

    # ---------------------------------------------------------------- mixed runs
    async def hello_mixed(self, client, h, node, world):
        sim_ranks = sorted(int(r) for r in h["sim_ranks"])
        if world > self.tb.nodes or (self.world is not None and world != self.world) or (
                self.sim_ranks is not None and sim_ranks != self.sim_ranks):
            client.reply({"error": "world_size", "detail":
                          f"{world} ranks (simulated: {sim_ranks}); this cluster has "
                          f"{self.tb.nodes} nodes" + (f" and a world of {self.world} "
                                                      f"(simulated: {self.sim_ranks})"
                                                      if self.world else "")})
            return
        if node in self.clients or node not in sim_ranks:
            client.reply({"error": "rank", "detail": f"node {node} is taken or not one of "
                          f"the simulated ranks {sim_ranks}"})
            return
        if self.bridge is None:
            opts = self.p.get("bridge") or {}
            self.bridge = UdpBridge(loss=float(opts.get("loss", 0.0)),
                                    seed=int(opts.get("seed", 1)), pcap=opts.get("pcap"),
                                    pcap_inbound=bool(opts.get("pcap_inbound", True)),
                                    tap=opts.get("tap"))
        try:
            self.bridge.host(node, h["ip"])
        except OSError as e:
            client.reply({"error": "bridge", "detail": f"node {node}: cannot bind "
                          f"{h['ip']}:4791 for the bridge: {e}"})
            return
        self.world, self.sim_ranks = world, sim_ranks
        client.node = node
        self.clients[node] = client
        self.ever = True
        client.reply({"ok": True, "nodes": self.tb.nodes, "stage_bytes": self.stage_bytes,
                      "buffers": self.bufs, "qps": self.p["qps"], "key": KEY_BASE + node,
                      "imem_words": self.p["imem_words"], "clock_ns": self.p.get("clock_ns", 4)})

    async def connect(self, client, h):
        """Program node ``client.node`` from the world's rendezvous table."""
        k, table = client.node, h["table"]
        if k is None or self.sim_ranks is None:
            client.reply({"error": "protocol", "detail": "connect before a mixed hello"})
            return
        peers = [Peer(node_mac(p), ip_int(t["ip"]), int(t["coll"]["key"]),
                      [int(b) for b in t["coll"]["buffers"]]) for p, t in enumerate(table)]
        await self.tb.csr_write(k, connect_writes(
            self.rmap, k, peers, psn=lambda a, b: int(table[a]["qps"][str(b)]["psn"]),
            mem_base=0, mem_len=4 * self.bufs[1]))
        external = 0
        for p, t in enumerate(table):
            if p in self.sim_ranks:
                continue
            external |= 1 << p
            self.bridge.route(p, t["ip"])
            if p not in self.ports:
                self.ports[p] = ExternalPort(self.dut, p, self.tb.width)
        self.dut.external.value = external
        client.reply({"ok": True})

    async def pump_bridge(self):
        """Frames out of the external ports to the bridge, the bridge's into the switch:
        True if any moved."""
        moved = False
        for port in self.ports.values():
            # A bounded number: a node retransmitting to a departed rank sends without
            # end, and the server must get back to its sockets (shutdown, deadlines).
            for _ in range(PUMP_FRAMES):
                if not port.pending():
                    break
                self.bridge.from_sim(await port.recv())
                moved = True
        for p, frame in self.bridge.poll():
            await self.ports[p].send(frame)
            moved = True
        if moved:
            self.tail = TAIL
        return moved

    async def start_collective(self, kind, group):
        def reply_all(msg: dict) -> None:
            for client, _, _ in group.values():
                client.reply(msg)

        if kind == "barrier":
            reply_all({"ok": True})
            return
        heads = {k: h for k, (_, h, _) in group.items()}
        ref = heads[min(heads)]
        if differ := _differing_signatures(heads):
            reply_all({"error": "signature", "records": differ})
            return
        for k, h in heads.items():
            for f in ("count", "dtype", "name"):
                if h[f] != ref[f]:
                    reply_all({"error": "mismatch", "detail":
                               f"rank {k} called {h['name']} {f}={h[f]!r}, rank "
                               f"{min(heads)} {ref['name']} {f}={ref[f]!r}"})
                    return
        self.ready.append(group)
        await self.launch()

    async def launch(self):
        """Ring every checked collective whose nodes are all free, oldest first. A node
        runs one program at a time, and the collectives of different communicators may
        be ready in any order: each starts as soon as its own nodes are free."""
        for group in list(self.ready):
            if any(k in self.running for k in group):
                continue
            self.ready.remove(group)
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

    def left(self, client):
        """A rank disconnected: whoever waits for it in a collective never gets it.
        (A collective already rung runs to completion: the engine needs no host.)"""
        node = client.node
        if node is None:
            return
        if client in self.subs:
            self.left_sub(client)
            return
        self.clients.pop(node, None)
        self.hellos.pop(node, None)
        self.running.pop(node, None)
        if self.world is None or node >= self.world:
            return
        self.gone.add(node)
        comms = {None} | {c for c, nodes in self.subs.values() if node in nodes}
        self.fail_waiting_for(node, comms, f"rank {node} left the world")

    def left_sub(self, client):
        """A sub-communicator's member left: its communicator's collectives waiting for
        it fail; the world and the other communicators go on."""
        comm, _ = self.subs.pop(client)
        self.fail_waiting_for(client.node, {comm},
                              f"node {client.node} left sub-communicator {comm}")

    def fail_waiting_for(self, node, comms, why):
        """Fail the collectives of communicators ``comms`` still waiting for ``node``."""
        for key in [k for k in self.pending if k[0] in comms]:
            group = self.pending[key]
            if node in group:
                continue
            del self.pending[key]
            for other, h, _ in group.values():
                other.reply({"error": "peer",
                             "detail": f"{why} before calling {h.get('name', key[1])}"})

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
                # The registers a signature mismatch latched (the rank maps them).
                regs = {r: await self.tb.csr_read(k, self.rmap.address(f"coll.{r}"))
                        for r in ("mismatch_peer", "peer_sig_lo", "peer_sig_hi")}
                client.reply({"error": "engine", "detail": f"node {k} ended "
                              f"{h['name']} (coll_id {h['coll_id']}) in error",
                              "cycles": cycles, "status": st, "registers": regs})
                continue
            out = await self.tb.mem_read(k, self.bufs[1], int(h["out_bytes"]))
            client.reply({"ok": True, "cycles": cycles}, out)

    async def summary(self):
        world = self.world or 0
        drops = {}
        per_node = []
        for k in range(world) if self.sim_ranks is None else self.sim_ranks:
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
        bridge = dict(self.bridge.stats) if self.bridge is not None else {}
        return {"nodes": self.tb.nodes, "world": world, "sim_ranks": self.sim_ranks,
                "bridge": bridge,
                "cycles": int(self.dut.cycles.value),
                "clock_ns": self.p.get("clock_ns", 4),
                "switch_dropped": int(self.dut.dropped.value),
                "retransmits": sum(n["retransmits"] for n in per_node),
                "drops": {n: v for n, v in drops.items() if v}, "per_node": per_node,
                **self.stats}


def _differing_signatures(heads: dict[int, dict]) -> list[str] | None:
    """The call signatures (hex records) of the lowest rank and the first rank whose
    digest differs from it, where every rank sent one (``check_calls``); else None.
    The server sees every rank's call before any node is rung: it compares them as the
    software ranks compare theirs (proto/signature.py), so a mismatch fails the call on
    every rank with the same error and nothing is written."""
    if any("signature" not in h for h in heads.values()):
        return None
    # By the records' ranks, not by node: a sub-communicator's rank 0 may be any node.
    recs = sorted(((Signature.unpack(bytes.fromhex(h["signature"])), h["signature"])
                   for h in heads.values()), key=lambda r: r[0].rank)
    for sig, record in recs:
        if sig.digest != recs[0][0].digest:
            return [recs[0][1], record]
    return None

