"""The HDL sequencer runs every library program on up to 8 ranks (Verilator), with a
Python datapath, and matches the executable model bit for bit."""

import pytest

from fpgaccl.sim.runner import FAST_BUILD_ARGS, build, run
from fpgaccl.sim.tb.sequencer_array_top import SequencerArray


@pytest.mark.slow
def test_sequencer_array_runs_the_library():
    sim = build(SequencerArray(8), "sequencer_array8", build_args=FAST_BUILD_ARGS)
    run(sim, "fpgaccl.sim.benches.sequencer_array", params={"worlds": [1, 2, 3, 4, 5, 8]})
