"""The CSR bus: 32-bit word reads and writes at byte addresses, one access per cycle,
read data valid the cycle after the read strobe. Small enough to bridge from AXI-Lite,
PCIe BAR writes or a simulation socket."""

from __future__ import annotations

from amaranth.lib import wiring
from amaranth.lib.wiring import In, Out


class CSRBusSignature(wiring.Signature):
    def __init__(self, addr_width: int) -> None:
        self.addr_width = addr_width
        super().__init__({
            "addr": Out(addr_width),
            "r_stb": Out(1),
            "r_data": In(32),
            "w_stb": Out(1),
            "w_data": Out(32),
        })
