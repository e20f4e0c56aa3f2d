"""Verilator build of the reduction unit, shared by its test and its benchmark."""

from __future__ import annotations

import hashlib
import os

from fpgaccl.hw.reduce.unit import ReduceUnit
from fpgaccl.sim.runner import BUILD_ROOT, DEFAULT_BUILD_ARGS, SimBuild, build, to_verilog

# cocotb asks Verilator for --public-flat-rw, which keeps every one of the unit's ~10^5
# intermediate nets alive as a VPI-visible variable: a 64-bit build then takes ~10 min of
# C++ compilation instead of ~30 s. The benches only touch top-level ports, so make just
# the top module's signals public.
BUILD_ARGS = (*DEFAULT_BUILD_ARGS, "--no-public-flat-rw", "--public-depth", "1")


def build_reduce_unit(width: int, *, separate_lanes: bool | None = None) -> SimBuild:
    """Build the unit; by default wide units export each lane kind as one module of its
    own that Verilator compiles once (``-fno-inline`` keeps it from pasting the copies
    back in), while narrow ones stay flat as they would be synthesised."""
    if separate_lanes is None:
        separate_lanes = width > 64
    unit = ReduceUnit(width, separate_lanes=separate_lanes)
    args = BUILD_ARGS
    if separate_lanes:
        sources = []
        for module, make in sorted(unit.path.lane_modules.items()):
            text = to_verilog(make(), module)
            digest = hashlib.sha256(text.encode()).hexdigest()[:16]
            path = BUILD_ROOT / "reduce_lanes" / f"{module}-{digest}.v"
            if not path.exists():
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_suffix(f".{os.getpid()}.tmp")
                tmp.write_text(text)
                tmp.replace(path)
            sources.append(str(path))
        args = (*args, "-fno-inline", *sources)
    suffix = "_sep" if separate_lanes else ""
    return build(unit, f"reduce_unit_w{width}{suffix}", build_args=args)
