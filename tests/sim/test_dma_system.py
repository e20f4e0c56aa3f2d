"""Verilator + cocotb runs of the DMA subsystem (rings, movers, translation, GPU window)
at 64 bits, and at 512 bits (the bench's build)."""

import pytest

from fpgaccl.hw.dma.subsystem import DmaSubsystem
from fpgaccl.sim.runner import build_and_run


@pytest.mark.slow
@pytest.mark.parametrize("width", [64, 512])
def test_dma_subsystem_on_verilator(width):
    build_and_run(DmaSubsystem(width), f"dma_subsystem_w{width}",
                  "fpgaccl.sim.benches.dma_system", params={"width": width})
