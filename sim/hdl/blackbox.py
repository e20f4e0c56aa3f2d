"""Instantiate an Amaranth component as a separately exported Verilog module.

Amaranth elaborates every instance of a component anew, so N nodes become N copies of
every module in the Verilog, and Verilator compiles each copy. Exporting the component
once and instantiating that module N times lets Verilator (with ``-fno-inline``)
compile it once: the multi-node build costs about what one node costs.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from amaranth.back import verilog
from amaranth.hdl import ClockSignal, Instance, ResetSignal
from amaranth.lib import wiring
from amaranth.lib.wiring import Flow

from fpgaccl.sim.runner import BUILD_ROOT


class BlackBox:
    """One exported module; :meth:`instance` makes an interface object shaped like the
    component's and an :class:`Instance` of the module wired to it."""

    def __init__(self, component: wiring.Component, module: str) -> None:
        self.signature = component.signature
        self.module = module
        text = verilog.convert(component, name=module, emit_src=False)
        digest = hashlib.sha256(text.encode()).hexdigest()[:16]
        self.path = BUILD_ROOT / "_sources" / f"{module}-{digest}.v"
        if not self.path.exists():
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(text)
            tmp.replace(self.path)

    def instance(self, name: str):
        iface = self.signature.create(path=(name,))
        ports = {"i_clk": ClockSignal(), "i_rst": ResetSignal()}
        for path, member, value in self.signature.flatten(iface):
            port = "__".join(str(p) for p in path)
            ports[("i_" if member.flow == Flow.In else "o_") + port] = value
        return iface, Instance(self.module, **ports)

    @property
    def source(self) -> Path:
        return self.path
