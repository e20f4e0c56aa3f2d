"""The report parsers on real nextpnr output, kept small in tests/boards/data/:
``ecp5_full_placed`` is nextpnr-ecp5 0.11.1's log and ``--report`` JSON of the full
64-bit node on the ECPIX-5 85F, placed and not routed (``--no-route``), the state
``bench/boards_fmax.py --partial`` records. (The iCE40 test in test_build.py parses a
routed report with critical paths from a build it runs.)"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from fpgaccl.boards.report import parse_log, parse_report

DATA = Path(__file__).parent / "data" / "ecp5_full_placed"


def test_log_parser_reads_utilisation_and_post_placement_fmax():
    rep = parse_log(DATA)
    log = (DATA / "top.tim").read_text()
    res = {r.name: r for r in rep.resources}
    for label, bel in (("LUT4 (+carry)", "TRELLIS_COMB"), ("FF", "TRELLIS_FF"),
                       ("BRAM (DP16KD)", "DP16KD"), ("DSP (MULT18X18D)", "MULT18X18D"),
                       ("IO", "TRELLIS_IO")):
        used, avail = map(int, re.search(rf"{bel}:\s+(\d+)/\s*(\d+)", log).groups())
        assert (res[label].used, res[label].available) == (used, avail)
    assert res["LUT4 (+carry)"].available == 83640          # LFE5UM5G-85F
    (clock,) = rep.clocks
    assert clock.name == "$glbnet$cd_sync.clk"
    assert clock.achieved_mhz == pytest.approx(38.60) and clock.target_mhz == 100.0
    assert not clock.met and rep.critical_paths == []
    assert "38.60" in rep.table() and "NO" in rep.table()


def test_report_parser_agrees_with_the_log():
    # Placed only: nextpnr writes utilisation but no Fmax and no paths yet.
    rep = parse_report(DATA)
    assert rep.family == "ecp5" and rep.clocks == [] and rep.critical_paths == []
    from_log = {r.name: (r.used, r.available) for r in parse_log(DATA).resources}
    assert {r.name: (r.used, r.available) for r in rep.resources} == from_log
    assert rep.as_dict()["resources"][0] == {"name": "LUT4 (+carry)", "used": 37100,
                                             "available": 83640, "percent": 44.4}
