"""Verilator + cocotb run of the reduction unit at two data widths."""

import pytest

from fpgaccl.sim.runner import run
from fpgaccl.sim.tb.reduce_build import build_reduce_unit


@pytest.mark.slow
@pytest.mark.parametrize("width", [64, 512])
def test_reduce_unit_on_verilator(width):
    run(build_reduce_unit(width), "fpgaccl.sim.benches.reduce_unit", params={"width": width})
