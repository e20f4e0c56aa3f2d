"""Verilator + cocotb runs of DmaNode (two back to back, one shared build): a WORK entry
starting a copy program host -> GPU window, an unmapped buffer's error completion, a
GPU-kernel doorbell with the completion flag polled in GPU memory, and a GPU-initiated
2-rank allreduce."""

import pytest

from fpgaccl.sim.runner import build, run
from fpgaccl.sim.tb.dma_node_top import DmaNodePair


@pytest.mark.slow
def test_dma_node_on_verilator():
    sim = build(DmaNodePair(64), "dma_node_pair_w64")
    run(sim, "fpgaccl.sim.benches.dma_node", params={"width": 64, "count": 256})
