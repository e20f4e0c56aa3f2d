"""Per-cycle agents for running the DMA blocks on Amaranth's simulator (unit tests).

One testbench coroutine drives every agent: each cycle all agents set their outputs,
then sample the DUT (settled), then the clock ticks and they commit what was handshaken.
A single loop keeps the order of events deterministic, which a bench of several
independent coroutines would not.
"""

from __future__ import annotations

import random
from collections import deque

from amaranth.lib import data

from fpgaccl.sim.models.host_memory import AxiMemory
from fpgaccl.sim.models.stream import pack, unpack


def _layout(port) -> data.StructLayout:
    return port.payload.shape()


class Source:
    """Feeds dicts into a stream the DUT consumes; ``idle`` inserts gaps."""

    def __init__(self, port, items=(), *, idle: float = 0.0, seed: int = 0) -> None:
        self.port, self.layout = port, _layout(port)
        self.q: deque[dict] = deque(items)
        self.idle, self.rng = idle, random.Random(seed)
        self.valid = False
        self.sent = 0

    def drive(self, ctx) -> None:
        if not self.valid and self.q and not (self.idle and self.rng.random() < self.idle):
            self.valid = True
            ctx.set(self.port.payload.as_value(), pack(self.layout, self.q[0]))
        ctx.set(self.port.valid, self.valid)

    def sample(self, ctx) -> None:
        self.fire = self.valid and ctx.get(self.port.ready)

    def commit(self) -> None:
        if self.fire:
            self.q.popleft()
            self.valid = False
            self.sent += 1


class Sink:
    """Collects dicts from a stream the DUT produces; ``stall`` drops ready at random."""

    def __init__(self, port, *, stall: float = 0.0, seed: int = 1) -> None:
        self.port, self.layout = port, _layout(port)
        self.stall, self.rng = stall, random.Random(seed)
        self.items: list[dict] = []

    def drive(self, ctx) -> None:
        self.ready = not (self.stall and self.rng.random() < self.stall)
        ctx.set(self.port.ready, self.ready)

    def sample(self, ctx) -> None:
        self.got = None
        if self.ready and ctx.get(self.port.valid):
            self.got = unpack(self.layout, ctx.get(self.port.payload.as_value()))

    def commit(self) -> None:
        if self.got is not None:
            self.items.append(self.got)


class AxiAgent:
    """Connects an :class:`AxiMemory` to a DUT's AXI manager port (read, write or both)."""

    def __init__(self, bus, model: AxiMemory) -> None:
        self.bus, self.model = bus, model
        self.has_r = hasattr(bus, "ar")
        self.has_w = hasattr(bus, "aw")

    def drive(self, ctx) -> None:
        o = self.o = self.model.outputs()
        bus = self.bus
        if self.has_r:
            ctx.set(bus.ar.ready, o["ar_ready"])
            ctx.set(bus.r.valid, o["r_valid"])
            if o["r"]:
                ctx.set(bus.r.payload.as_value(), pack(_layout(bus.r), o["r"]))
        if self.has_w:
            ctx.set(bus.aw.ready, o["aw_ready"])
            ctx.set(bus.w.ready, o["w_ready"])
            ctx.set(bus.b.valid, o["b_valid"])
            if o["b"]:
                ctx.set(bus.b.payload.as_value(), pack(_layout(bus.b), o["b"]))

    def sample(self, ctx) -> None:
        o, bus, hs = self.o, self.bus, {}
        if self.has_r:
            if o["ar_ready"] and ctx.get(bus.ar.valid):
                hs["ar"] = unpack(_layout(bus.ar), ctx.get(bus.ar.payload.as_value()))
            hs["r"] = bool(o["r_valid"] and ctx.get(bus.r.ready))
        if self.has_w:
            if o["aw_ready"] and ctx.get(bus.aw.valid):
                hs["aw"] = unpack(_layout(bus.aw), ctx.get(bus.aw.payload.as_value()))
            if o["w_ready"] and ctx.get(bus.w.valid):
                hs["w"] = unpack(_layout(bus.w), ctx.get(bus.w.payload.as_value()))
            hs["b"] = bool(o["b_valid"] and ctx.get(bus.b.ready))
        self.hs = hs

    def commit(self) -> None:
        self.model.commit(**self.hs)


async def run_agents(ctx, agents, done, max_cycles: int = 100_000) -> int:
    """Step every agent until ``done()``; returns the cycles taken."""
    for cycle in range(max_cycles):
        if done():
            return cycle
        for a in agents:
            a.drive(ctx)
        for a in agents:
            a.sample(ctx)
        await ctx.tick()
        for a in agents:
            a.commit()
    raise AssertionError(f"not done after {max_cycles} cycles")
