"""Verilator + cocotb run of the RoCEv2 transmit builder, at two data widths."""

import pytest

from fpgaccl.hw.net.builder import RoceBuilder
from fpgaccl.sim.runner import build_and_run


@pytest.mark.slow
@pytest.mark.parametrize("width", [64, 512])
def test_roce_builder_on_verilator(width):
    build_and_run(RoceBuilder(width), f"net_builder_w{width}",
                  "fpgaccl.sim.benches.net_builder", params={"width": width})
