"""One :class:`~fpgaccl.hw.eth_node.EthNode` bridged to a Linux TAP (``fpgaccl node``,
:mod:`fpgaccl.sim.tap`): frames the kernel sends on the TAP go into the node's ``rx``,
frames from its ``tx`` go back to the TAP.

The clock runs only while frames are in flight: from a frame arriving until
:data:`QUIET` cycles after the last one either way (the control port answers a full
request within ~3000 cycles: it handles one byte per cycle). Otherwise the loop sleeps
in ``select`` on the TAP and no simulated time passes, so an idle node costs nothing.
"""

from __future__ import annotations

import ipaddress
from collections import Counter

import cocotb
from cocotb.clock import Clock
from cocotb.triggers import ClockCycles, RisingEdge

from fpgaccl.sim.tap import Tap
from fpgaccl.sim.tb.cluster_tb import CLOCK_NS, ExternalPort

from .loop import Client

BATCH = 256
"""Clock cycles between two looks at the TAP while frames are in flight."""
QUIET = 8192
MIN_FRAME = 60
"""What a MAC delivers at least (64 bytes on the wire less the FCS); the kernel writes
shorter frames (ARP: 42) to a TAP."""


class TapNodeServer:
    name = "tap node"

    def __init__(self, dut, p: dict) -> None:
        self.dut, self.p = dut, p
        self.port = ExternalPort(dut, 0, p["width"])
        self.tap: Tap | None = None
        self.stop = False
        self.quiet = 0
        self.receiving = False
        self.cycles = 0
        self.frames: Counter[str] = Counter()
        Clock(dut.clk, CLOCK_NS, unit="ns", impl="gpi").start()

    async def start(self) -> None:
        d = self.dut
        d.mac.value, d.ip.value = self.p["mac"], self.p["ip"]
        d.rst.value = 1
        await ClockCycles(d.clk, 4)
        d.rst.value = 0
        await ClockCycles(d.clk, 4)
        self.tap = Tap(self.p["tap"])
        cocotb.start_soon(self._drain())

    async def _drain(self) -> None:
        while True:
            if not self.port.pending():
                await RisingEdge(self.dut.xtx0__valid)
            self.receiving = True
            frame = await self.port.recv()
            self.receiving = False
            self.tap.write(frame)
            self.frames["to_tap"] += 1
            self.quiet = QUIET

    async def handle(self, client: Client, h: dict, payload: bytes) -> None:
        op = h.get("op")
        if op == "info":
            return client.ok({"mac": self.p["mac"],
                              "ip": str(ipaddress.IPv4Address(self.p["ip"])),
                              "width": self.p["width"], "tap": self.p["tap"]})
        if op == "stats":
            return client.ok({"cycles": self.cycles, "frames": dict(self.frames)})
        if op == "shutdown":
            self.stop = True
            return None
        return client.error("op", f"unknown request {op!r}")

    def left(self, client: Client) -> None:
        pass

    def busy(self) -> bool:
        return self.quiet > 0 or self.receiving

    async def step(self) -> None:
        frames = self.tap.read()
        for f in frames:
            await self.port.send(f.ljust(MIN_FRAME, b"\0"))
            self.frames["from_tap"] += 1
        if frames:
            self.quiet = QUIET
        if self.busy():
            await ClockCycles(self.dut.clk, BATCH)
            self.cycles += BATCH
            self.quiet -= BATCH

    def sockets(self) -> list:
        return [self.tap] if self.tap is not None else []

    def finished(self) -> bool:
        return False   # a node runs until it is stopped

    async def summary(self) -> dict:
        return {"cycles": self.cycles, "frames": dict(self.frames)}

    def close(self) -> None:
        if self.tap is not None:
            self.tap.close()
