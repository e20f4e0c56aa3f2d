"""The cluster bench's bus driver, shared by the cluster bench (sim/benches/cluster.py)
and the sim backend's server (sim/servers/cluster.py): reset, CSR reads/writes over
the shared bus and memory backdoor accesses, both steered to one node by ``sel``, the
links' impairment registers, waiting for programs to end without Python per cycle, the
per-run summary (:meth:`TB.summary`), and the IN|OUT|TMP|TMP2 buffer layout of a node's
memory; and the driver of the switch's external ports (:class:`ExternalPort`).

The cluster's inputs are registered once (fpgaccl.sim.hdl.registered), so everything
written here reaches the design a cycle after it is set; reads wait for that.
"""

from __future__ import annotations

import contextlib

from cocotb.clock import Clock
from cocotb.triggers import ClockCycles, RisingEdge, SimTimeoutError, ValueChange, with_timeout

from fpgaccl.hw.stream.beat import beat_layout
from fpgaccl.proto.plans import Peer
from fpgaccl.proto.regmap import default_map
from fpgaccl.sim.hdl.link import LINK_COUNTERS, LINK_REGS
from fpgaccl.sim.hdl.switch import node_ip, node_mac
from fpgaccl.sim.models.stream import beats_to_frame, frame_to_beats, pack, unpack

CLOCK_NS = 4
"""The bench clock: 4 ns, i.e. 250 MHz (the clock sim-backend times are stated at)."""



class TB:
    def __init__(self, dut, p):
        self.dut, self.p = dut, p
        self.nodes, self.width = p["nodes"], p["width"]
        self.nb = self.width // 8
        self.rmap = default_map(qps=p["qps"], imem_words=p["imem_words"])
        # The clock toggles in C (cocotb's GPI clock): a Python clock costs a coroutine
        # wake-up per edge, more than a cycle of the whole cluster once it is fast.
        Clock(dut.clk, CLOCK_NS, unit="ns", impl="gpi").start()

    async def reset(self):
        d = self.dut
        for s in (d.csr__w_stb, d.csr__r_stb, d.bd_we, d.loss, d.link__w_stb):
            s.value = 0
        d.rst.value = 1
        await ClockCycles(d.clk, 4)
        d.rst.value = 0
        await ClockCycles(d.clk, 3)
        await self._calibrate()

    async def _calibrate(self):
        """Measure the backdoor's read lag (rising edges from setting an address to its
        word on ``bd_rdata``: the input register, the RAM's read register, and when
        cocotb samples) on node 0's first words, so pipelined reads need no guess."""
        d = self.dut
        words = [0x1111 * (j + 1) for j in range(4)]
        await self.mem_write(0, 0, b"".join(w.to_bytes(self.nb, "little") for w in words))
        seen = []
        for i in range(10):
            d.bd_addr.value = min(i, 3)
            await RisingEdge(d.clk)
            seen.append(int(d.bd_rdata.value))
        for lag in range(1, 7):
            if seen[lag - 1:lag + 3] == words:
                self.read_lag = lag
                break
        else:
            raise AssertionError(f"backdoor reads never showed the probe: {seen}")
        await self.mem_write(0, 0, bytes(4 * self.nb))

    async def csr_write(self, node, writes):
        d = self.dut
        d.sel.value = node
        for addr, value in writes:
            d.csr__addr.value, d.csr__w_data.value, d.csr__w_stb.value = addr, value, 1
            await RisingEdge(d.clk)
        d.csr__w_stb.value = 0

    async def csr_read(self, node, addr):
        d = self.dut
        d.sel.value, d.csr__addr.value, d.csr__r_stb.value = node, addr, 1
        await RisingEdge(d.clk)
        d.csr__r_stb.value = 0
        await ClockCycles(d.clk, 2)
        return int(d.csr__r_data.value)

    async def mem_write(self, node, addr, raw: bytes):
        assert addr % self.nb == 0
        raw = raw + bytes(-len(raw) % self.nb)
        d = self.dut
        d.sel.value = node
        for i in range(0, len(raw), self.nb):
            d.bd_addr.value = (addr + i) // self.nb
            d.bd_wdata.value = int.from_bytes(raw[i:i + self.nb], "little")
            d.bd_we.value = 1
            await RisingEdge(d.clk)
        d.bd_we.value = 0

    async def mem_read(self, node, addr, length) -> bytes:
        """Pipelined: a new address every cycle, its word ``read_lag`` edges later."""
        d = self.dut
        d.sel.value = node
        first = addr // self.nb
        words = -(-(addr % self.nb + length) // self.nb)
        out = bytearray()
        lag = self.read_lag
        for i in range(words + lag - 1):
            if i < words:
                d.bd_addr.value = first + i
            await RisingEdge(d.clk)
            if i >= lag - 1:
                out += int(d.bd_rdata.value).to_bytes(self.nb, "little")
        skip = addr % self.nb
        return bytes(out[skip:skip + length])

    async def link_write(self, node, **regs):
        """Set impairment registers of the link from ``node`` into the switch
        (names of :data:`fpgaccl.sim.hdl.link.LINK_REGS`)."""
        d = self.dut
        d.sel.value = node
        for name, value in regs.items():
            if name not in LINK_REGS:
                raise KeyError(f"no link register {name!r}")
            d.link__addr.value, d.link__w_data.value = LINK_REGS[name], int(value)
            d.link__w_stb.value = 1
            await RisingEdge(d.clk)
        d.link__w_stb.value = 0

    async def link_read(self, node, name) -> int:
        d = self.dut
        d.sel.value = node
        d.link__addr.value = {**LINK_REGS, **LINK_COUNTERS}[name]
        await ClockCycles(d.clk, 2)
        return int(d.link__r_data.value)

    async def impair(self, seed=1, **regs):
        """The same impairments on every link, each link seeded differently (so runs
        with the same seed are the same run)."""
        for k in range(self.nodes):
            await self.link_write(k, **regs, seed=seed * 131 + k)

    async def wait_idle(self, mask, start, limit, settle=16):
        """Wait until no node in ``mask`` is busy, sleeping on ``busy``'s changes (no
        Python per cycle); ``start`` is the cycle the doorbells rang. Returns the cycle
        count since ``start``; raises AssertionError past ``limit`` cycles."""
        d = self.dut
        await ClockCycles(d.clk, settle)   # busy rises a few cycles after the doorbell
        while int(d.busy.value) & mask:
            left = limit - (int(d.cycles.value) - start)
            assert left > 0, f"no completion in {limit} cycles (busy {int(d.busy.value):b})"
            with contextlib.suppress(SimTimeoutError):
                await with_timeout(ValueChange(d.busy), left * CLOCK_NS, "ns")
        return int(d.cycles.value) - start

    async def summary(self, world=None) -> dict:
        """The run so far, from the hardware: cycles; per node the frames its link
        carried into the switch, retransmissions (sum of its QPs' ``retries``), drops by
        reason (``drops`` CSR block, non-zero ones) and what its link did to its frames;
        and the totals. Reads registers only (the drop counters clear on write, not on
        read), so it can be called at any point of a run."""
        world = self.nodes if world is None else world
        per_node, drops, link_tot = [], {}, dict.fromkeys(LINK_COUNTERS, 0)
        for k in range(world):
            node = {}
            for reg in self.rmap["drops"].registers:
                v = await self.csr_read(k, self.rmap.address(f"drops.{reg.name}"))
                if v:
                    node[reg.name] = v
                    drops[reg.name] = drops.get(reg.name, 0) + v
            retries = 0
            for q in range(world):
                if q != k:
                    retries += await self.csr_read(k, self.rmap.address("qp.retries", q))
            link = {name: await self.link_read(k, name) for name in LINK_COUNTERS}
            for name, v in link.items():
                link_tot[name] += v
            per_node.append({"node": k, "packets": link["frames"], "retransmits": retries,
                             "drops": node, "link": link})
        return {"nodes": self.nodes, "world": world, "cycles": int(self.dut.cycles.value),
                "clock_ns": CLOCK_NS, "packets": link_tot["frames"],
                "retransmits": sum(n["retransmits"] for n in per_node),
                "drops": drops, "switch_dropped": int(self.dut.dropped.value),
                "link": link_tot, "per_node": per_node}

    def layout(self, nbytes):
        # IN, OUT, TMP, TMP2 one after the other, each rounded up to 4 KiB, scratch with
        # room for the chunk padding of the programs' geometry.
        span = -(-(nbytes + 4096) // 4096) * 4096
        return [i * span for i in range(4)]

    def peers(self, world, bufs):
        """Every node's addresses and buffers (the rendezvous table of a real run)."""
        return [Peer(node_mac(k), node_ip(k), 0x1000 + k, bufs) for k in range(world)]


def format_summary(s: dict) -> str:
    """The summary as a few lines for a log or a terminal."""
    lines = [f"run summary: {s['cycles']} cycles ({s['cycles'] * s['clock_ns'] / 1e3:.1f} us "
             f"at {1e3 / s['clock_ns']:.0f} MHz), {s['packets']} packets, "
             f"{s['retransmits']} retransmits, switch dropped {s['switch_dropped']}",
             "  drops by reason: " + (", ".join(f"{k} {v}" for k, v in s["drops"].items())
                                      or "none"),
             "  links: " + ", ".join(f"{k} {v}" for k, v in s["link"].items())]
    for n in s["per_node"]:
        lines.append(f"  node {n['node']}: {n['packets']} packets, {n['retransmits']} "
                     f"retransmits, drops {n['drops'] or 'none'}")
    return "\n".join(lines)


class ExternalPort:
    """Switch port ``p``'s external streams (``xrx{p}`` into the switch, ``xtx{p}`` out),
    a frame at a time.

    Measured with the GPI clock the bench uses: a value read after ``RisingEdge`` is
    this cycle's (what the flops took at that edge), but a value written then reaches
    the design one edge late: it is first sampled at the edge after next. So ``ready``
    is written a cycle ahead of the beats it should take, and each beat is driven once
    the design showed ``ready`` for the one before. ``valid`` and ``ready`` of these
    streams never depend on the other side's signal (FIFOs of the registered top).
    """

    def __init__(self, dut, p, width):
        self.clk, self.width = dut.clk, width
        self.layout = beat_layout(width)
        self.i_payload, self.i_valid, self.i_ready = (
            getattr(dut, f"xrx{p}__{n}") for n in ("payload", "valid", "ready"))
        self.o_payload, self.o_valid, self.o_ready = (
            getattr(dut, f"xtx{p}__{n}") for n in ("payload", "valid", "ready"))
        self.i_valid.value = 0
        self.o_ready.value = 0

    def pending(self):
        return bool(int(self.o_valid.value))

    async def recv(self):
        beats = []
        applies = 0          # the `ready` the design samples at the coming edge
        self.o_ready.value = written = 1
        while True:
            v = int(self.o_valid.value)
            beat = unpack(self.layout, int(self.o_payload.value)) if v else None
            moves = v and applies
            if moves and beat["last"]:
                self.o_ready.value = written = 0   # from the edge after this one
            await RisingEdge(self.clk)
            applies = written
            if moves:
                beats.append(beat)
                if beat["last"]:
                    return beats_to_frame(beats, self.width)

    async def send(self, frame):
        beats = frame_to_beats(frame, self.width)
        self.i_payload.value, self.i_valid.value = pack(self.layout, beats[0]), 1
        await RisingEdge(self.clk)
        # From here on the design sees beat k; it takes it at the coming edge if ready.
        k = 0
        while k < len(beats):
            if int(self.i_ready.value):
                k += 1
                if k < len(beats):
                    self.i_payload.value = pack(self.layout, beats[k])
                else:
                    self.i_valid.value = 0
            await RisingEdge(self.clk)
