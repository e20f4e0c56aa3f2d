"""Verilator + cocotb run of the beat FIFO, at two data widths."""

import pytest

from fpgaccl.hw.stream.fifo import BeatFIFO
from fpgaccl.sim.runner import build_and_run


@pytest.mark.slow
@pytest.mark.parametrize("width", [64, 512])
def test_beat_fifo_on_verilator(width):
    build_and_run(BeatFIFO(width, depth=16), f"beat_fifo_w{width}",
                  "fpgaccl.sim.benches.stream_fifo", params={"width": width})
