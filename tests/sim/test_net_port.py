"""Verilator + cocotb runs of the RoCEv2 parser and builder at two data widths.

Both benches run on one build per width (:class:`~fpgaccl.hw.net.port.NetPort`), so the
test pass compiles two designs, not four; one test per width keeps pytest-xdist workers
from building the same folder at once."""

import pytest

from fpgaccl.hw.net.port import NetPort
from fpgaccl.sim.runner import FAST_BUILD_ARGS, build, run

RX = {"i": "rx", "hdr": "rx_hdr", "o": "rx_payload"}
TX = {"hdr": "tx_hdr", "i": "tx_payload", "o": "tx"}


@pytest.mark.slow
@pytest.mark.parametrize("width", [64, 512])
def test_net_port_on_verilator(width):
    # The benches touch only top-level ports: top-only public signals build much faster.
    sim = build(NetPort(width), f"net_port_w{width}", build_args=FAST_BUILD_ARGS)
    run(sim, "fpgaccl.sim.benches.net_parser", params={"width": width, "ports": RX},
        test_dir=sim.build_dir / "run_parser")
    run(sim, "fpgaccl.sim.benches.net_builder", params={"width": width, "ports": TX},
        test_dir=sim.build_dir / "run_builder")
