"""Verilator + cocotb runs of the reliable transport (one 64-bit build shared by the
benches): two HDL nodes through a lossy link, and an HDL node against the software
transport of the runtime."""

import pytest

from fpgaccl.sim.runner import build, run
from fpgaccl.sim.tb.transport_harness import Nodes

PARAMS = {"width": 64, "nqp": 4, "nmr": 4, "mtu": 256}


@pytest.fixture(scope="module")
def sim64():
    return build(Nodes(2, 64, nqp=4, nmr=4, mtu=256, window=16, ackreq_every=4, ack_every=8,
                       timeout=3000, max_retries=7), "transport_pair_w64")


@pytest.mark.slow
def test_transport_two_nodes_lossy_link(sim64):
    run(sim64, "fpgaccl.sim.benches.transport_pair", params=PARAMS)


@pytest.mark.slow
def test_transport_hdl_against_software_transport(sim64):
    run(sim64, "fpgaccl.sim.benches.transport_interop", params=PARAMS)
