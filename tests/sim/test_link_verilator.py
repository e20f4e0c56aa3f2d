"""The link pipe on Verilator (the form the cluster runs it in), traced: the run leaves a
non-empty waveform (FST where the toolchain has lz4, else VCD)."""

import pytest

from fpgaccl.sim.hdl.link import Link
from fpgaccl.sim.runner import build, fst_available, run, waves_file


@pytest.mark.slow
def test_link_on_verilator_with_waves():
    sim = build(Link(64, depth=256), "link_w64", waves=True)
    for old in ("dump.fst", "dump.vcd"):
        (sim.build_dir / "run" / old).unlink(missing_ok=True)
    run(sim, "fpgaccl.sim.benches.link", params={"width": 64})
    wave = waves_file(sim.build_dir / "run")
    assert wave.suffix == (".fst" if fst_available() else ".vcd")
    assert wave.stat().st_size > 1000
