"""Collectives on four simulated nodes (the whole HDL node, Verilator) joined by the
hardware switch: bit-exact against the sequencer model (and so numpy), on a clean
switch, with 2% of frames dropped by the switch, and with every link impairment on
(2% loss and reordering, 4% duplication and corruption)."""

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
                "cases": ["ring_allreduce", "rhd_allreduce", "rd_allreduce"],
                "expect_drops": True},
        test_dir=sim.build_dir / "run_lossy")


@pytest.mark.slow
def test_collectives_survive_every_impairment_at_once(cluster):
    """2% loss, 2% reordering, 4% duplication and 4% corruption on every link (the link
    pipes, seeded): every collective still bit-exact; the corrupted frames show as
    BAD_ICRC drops at the receivers, duplicates as PSN_DUPLICATE, and the transport
    retransmitted."""
    sim, params = cluster
    p = 1311  # 2% of frames
    run(sim, "fpgaccl.sim.benches.cluster",
        params={**params, "count": 3000,
                "impair": {"loss": p, "reorder": p, "dup": 2 * p, "corrupt": 2 * p,
                           "latency": 40},
                "seed": 5, "expect_reasons": ["bad_icrc", "psn_duplicate"],
                "expect_link": ["dropped", "duplicated", "reordered", "corrupted"],
                "expect_retransmits": True},
        test_dir=sim.build_dir / "run_impaired")
