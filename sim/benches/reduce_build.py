"""Verilator build of the reduction unit, shared by its test and its benchmark."""

from __future__ import annotations

from fpgaccl.hw.reduce.unit import ReduceUnit
from fpgaccl.sim.runner import DEFAULT_BUILD_ARGS, SimBuild, build

# cocotb asks Verilator for --public-flat-rw, which keeps every one of the unit's ~10^5
# intermediate nets alive as a VPI-visible variable: a 64-bit build then takes ~10 min of
# C++ compilation instead of ~30 s. The benches only touch top-level ports, so make just
# the top module's signals public.
BUILD_ARGS = (*DEFAULT_BUILD_ARGS, "--no-public-flat-rw", "--public-depth", "1")


def build_reduce_unit(width: int) -> SimBuild:
    return build(ReduceUnit(width), f"reduce_unit_w{width}", build_args=BUILD_ARGS)
