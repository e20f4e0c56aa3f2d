"""Verilator + cocotb run of the RoCEv2 receive parser, at two data widths."""

import pytest

from fpgaccl.hw.net.parser import RoceParser
from fpgaccl.sim.runner import build_and_run


@pytest.mark.slow
@pytest.mark.parametrize("width", [64, 512])
def test_roce_parser_on_verilator(width):
    build_and_run(RoceParser(width), f"net_parser_w{width}",
                  "fpgaccl.sim.benches.net_parser", params={"width": width})
