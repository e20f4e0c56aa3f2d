"""Collectives on four simulated nodes (the whole HDL node, Verilator) joined by the
hardware switch: bit-exact against the sequencer model (and so numpy), on a clean
switch and with 2% of frames dropped."""

import pytest

from fpgaccl.sim.hdl.cluster import build_standard
from fpgaccl.sim.runner import run


@pytest.fixture(scope="module")
def cluster():
    return build_standard()


@pytest.mark.slow
def test_collectives_on_four_nodes(cluster):
    sim, params = cluster
    run(sim, "fpgaccl.sim.benches.cluster", params={**params, "count": 1000})


@pytest.mark.slow
def test_collectives_survive_frame_loss(cluster):
    sim, params = cluster
    run(sim, "fpgaccl.sim.benches.cluster",
        params={**params, "count": 3000, "loss": 1311,   # 2% of frames
                "cases": ["ring_allreduce", "rhd_allreduce"], "expect_drops": True},
        test_dir=sim.build_dir / "run_lossy")
