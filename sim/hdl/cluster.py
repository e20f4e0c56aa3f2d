"""N nodes, their memories and a switch in one design: the multi-node simulation that
runs at Verilator speed. The testbench reaches node ``k`` through one shared CSR bus
and one memory backdoor, both steered by a select input; everything else (frames,
memory traffic, reductions) stays in hardware.

Any switch port can be handed to the outside at run time: bit ``k`` of ``external``
connects switch port ``k`` to the top-level streams ``xrx{k}`` (frames into the switch)
and ``xtx{k}`` (frames out of it) instead of node ``k``, which then sees no traffic. That
is how :mod:`fpgaccl.sim.bridge` joins ranks outside the simulation to the simulated
wire without a second build of the cluster."""

from __future__ import annotations

from amaranth.hdl import Module, Mux, Signal
from amaranth.lib import wiring
from amaranth.lib.wiring import In, Out

from fpgaccl.hw.csr.bus import CSRBusSignature
from fpgaccl.hw.datapath.memport import channel_names
from fpgaccl.hw.node import READ_CHANNELS, WRITE_CHANNELS, Node
from fpgaccl.hw.stream.beat import beat_stream

from .blackbox import BlackBox
from .link import LINK_CFG, Link
from .memory import RAM_VERILOG, SimMemory
from .registered import RegisteredInputs
from .switch import Switch


class Cluster(wiring.Component):
    def __init__(self, nodes: int, width: int = 64, *, mem_bytes: int = 1 << 20,
                 qps: int | None = None, imem_words: int = 512, mtu: int = 1024,
                 mem_latency: int = 16, timeout: int = 1 << 14, seed: int = 1,
                 split_memory: bool = True, blackbox_nodes: bool = False) -> None:
        self.nodes, self.width, self.mem_bytes = nodes, width, mem_bytes
        self.qps = qps or max(2, nodes)
        self.imem_words, self.mtu, self.mem_latency = imem_words, mtu, mem_latency
        # ``timeout``: the transport's retransmit timer, the node's default. At 1 << 12 it
        # fired before ACKs queued behind a busy memory port came back: a clean 1 MiB
        # ring allreduce made 384 spurious retransmissions and took 22% more cycles.
        self.timeout, self.seed = timeout, seed
        # Each node's datapath masters on their own memory channels (hw/node.py): with
        # one shared port a ring step's 3 reads per link beat cap the link at a third.
        self.split_memory = split_memory
        self.blackbox = BlackBox(self.node(), "fpgaccl_node") if blackbox_nodes else None
        words = mem_bytes // (width // 8)
        external = {"external": In(nodes)}
        for k in range(nodes):
            external[f"xrx{k}"] = In(beat_stream(width))
            external[f"xtx{k}"] = Out(beat_stream(width))
        super().__init__({
            **external,
            "sel": In(range(max(2, nodes))),
            "csr": In(CSRBusSignature(16)),
            "bd_addr": In(range(words)),
            "bd_wdata": In(width),
            "bd_we": In(1),
            "bd_rdata": Out(width),
            "loss": In(16),
            # impairment registers of link `sel` (node `sel` -> switch): sim/hdl/link.py
            "link": In(LINK_CFG),
            "done": Out(nodes),
            "busy": Out(nodes),
            "dropped": Out(32),
            "cycles": Out(48),
        })

    def node(self) -> Node:
        return Node(self.width, qps=self.qps, imem_words=self.imem_words, mtu=self.mtu,
                    seg_bytes=min(self.mtu, 4096), timeout=self.timeout,
                    split_memory=self.split_memory)

    def elaborate(self, platform) -> Module:
        m = Module()
        if self.blackbox is None:
            # Amaranth's own simulation or a small build: elaborate every node inline.
            nodes = [self.node() for _ in range(self.nodes)]
            for k, node in enumerate(nodes):
                m.submodules[f"node{k}"] = node
        else:
            nodes = []
            for k in range(self.nodes):
                iface, inst = self.blackbox.instance(f"node{k}")
                m.submodules[f"node{k}"] = inst
                nodes.append(iface)
        m.submodules.switch = sw = Switch(self.width, self.nodes, seed=self.seed)
        m.d.comb += [sw.loss.eq(self.loss), self.dropped.eq(sw.dropped)]
        cycles = Signal(48)
        m.d.sync += cycles.eq(cycles + 1)
        m.d.comb += self.cycles.eq(cycles)
        for k, node in enumerate(nodes):
            nr, nw = ((len(READ_CHANNELS), len(WRITE_CHANNELS)) if self.split_memory
                      else (1, 1))
            mem = SimMemory(self.width, self.mem_bytes, latency=self.mem_latency,
                            verilog_ram=True, reads=nr, writes=nw)
            m.submodules[f"mem{k}"] = mem
            for req, resp in zip(channel_names("rd_req", nr), channel_names("rd_resp", nr),
                                 strict=True):
                wiring.connect(m, getattr(node, req), getattr(mem, req))
                wiring.connect(m, getattr(mem, resp), getattr(node, resp))
            for wr in channel_names("wr", nw):
                wiring.connect(m, getattr(node, wr), getattr(mem, wr))
            # Frames into the switch pass an impairment pipe (off until configured).
            m.submodules[f"link{k}"] = link = Link(self.width, seed=self.seed + k)
            wiring.connect(m, link.o, getattr(sw, f"i{k}"))
            swi, swo = link.i, getattr(sw, f"o{k}")
            xrx, xtx, ext = getattr(self, f"xrx{k}"), getattr(self, f"xtx{k}"), self.external[k]
            m.d.comb += [
                swi.payload.eq(Mux(ext, xrx.payload.as_value(), node.tx.payload.as_value())),
                swi.valid.eq(Mux(ext, xrx.valid, node.tx.valid)),
                xrx.ready.eq(ext & swi.ready), node.tx.ready.eq(~ext & swi.ready),
                node.rx.payload.eq(swo.payload), xtx.payload.eq(swo.payload),
                node.rx.valid.eq(~ext & swo.valid), xtx.valid.eq(ext & swo.valid),
                swo.ready.eq(Mux(ext, xtx.ready, node.rx.ready)),
            ]
            here = self.sel == k
            m.d.comb += [
                node.csr.addr.eq(self.csr.addr), node.csr.w_data.eq(self.csr.w_data),
                node.csr.w_stb.eq(self.csr.w_stb & here),
                node.csr.r_stb.eq(self.csr.r_stb & here),
                mem.bd_addr.eq(self.bd_addr), mem.bd_wdata.eq(self.bd_wdata),
                mem.bd_we.eq(self.bd_we & here),
                link.cfg.addr.eq(self.link.addr), link.cfg.w_data.eq(self.link.w_data),
                link.cfg.w_stb.eq(self.link.w_stb & here),
                self.done[k].eq(node.done), self.busy[k].eq(node.busy),
            ]
            with m.If(here):
                m.d.comb += [self.csr.r_data.eq(node.csr.r_data),
                             self.bd_rdata.eq(mem.bd_rdata),
                             self.link.r_data.eq(link.cfg.r_data)]
        return m


# One configuration serves the tests and the benches, so CI compiles it once: four
# 64-bit nodes with room for 1 MiB collectives (IN, OUT and two scratch buffers), each
# on a memory with a channel per datapath master.
STANDARD = {"nodes": 4, "width": 64, "mem_bytes": 8 << 20, "imem_words": 256, "mtu": 4096,
            "split_memory": True}


def build_standard(*, waves: bool | None = None, **overrides):
    """Verilator build of the standard cluster (cached): returns ``(SimBuild, params)``
    with the parameters the cluster bench needs. ``waves`` (default: the
    ``FPGACCL_WAVES`` environment variable) makes a separate build that can trace (FST
    where the toolchain allows, else VCD); a run traces when given ``waves=True``."""
    from fpgaccl.sim.runner import CLUSTER_BUILD_ARGS, CLUSTER_CXX_OPT, build, waves_requested

    cfg = {**STANDARD, **overrides}
    cluster = Cluster(cfg["nodes"], cfg["width"], mem_bytes=cfg["mem_bytes"],
                      imem_words=cfg["imem_words"], mtu=cfg["mtu"],
                      split_memory=cfg["split_memory"], blackbox_nodes=True)
    name = f"cluster{cfg['nodes']}_w{cfg['width']}" + ("" if cfg["split_memory"] else "_shared")
    sim = build(RegisteredInputs(cluster), name, build_args=CLUSTER_BUILD_ARGS,
                cxx_opt=CLUSTER_CXX_OPT, extra_sources=[RAM_VERILOG, cluster.blackbox.source],
                waves=waves_requested() if waves is None else waves)
    return sim, {**cfg, "qps": cluster.qps}
