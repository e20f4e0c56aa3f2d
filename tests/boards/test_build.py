"""One real open-flow build (the small iCE40 configuration on the iCEBreaker), its
bitstream, the report parser checked against nextpnr's own log, the cache and the CLI.

Builds go to build/boards/ (cached by plan digest + tool versions): the first run here
takes minutes (yowasp compiles its WASM once, ~40 s), later ones reuse the bitstream.
"""

from __future__ import annotations

import argparse
import re

import pytest

from ._deps import needs_ice40_flow

pytestmark = [needs_ice40_flow, pytest.mark.slow]

UP5K_BIN_BYTES = 104090  # an uncompressed UP5K image is always this size


@pytest.fixture(scope="module")
def ice40():
    from fpgaccl.boards.build import build
    return build("icebreaker", timeout=1500)


def test_bitstream_is_a_real_up5k_image(ice40):
    assert ice40.ran and ice40.bitstream.name == "top.bin"
    image = ice40.bitstream.read_bytes()
    assert abs(len(image) - UP5K_BIN_BYTES) < 1024, len(image)
    assert b"\x7e\xaa\x99\x7e" in image[:64], "iCE40 sync word"
    assert image.count(0) < 0.98 * len(image), "configuration bits set"


def test_report_parser_agrees_with_nextpnr_log(ice40):
    rep = ice40.report
    log = (ice40.folder / "top.tim").read_text()
    res = {r.name: r for r in rep.resources}
    lc = res["logic cells"]
    m = re.search(r"ICESTORM_LC:\s+(\d+)/\s*(\d+)", log)
    assert (lc.used, lc.available) == (int(m[1]), int(m[2]))
    assert 0 < res["  of which FF"].used <= lc.used
    assert 0 < res["  of which LUT4"].used <= lc.used
    assert res["BRAM (4 kbit)"].used >= 2   # program memory + local buffer
    # Fmax: nextpnr logs the same figure it writes to the report.
    fmax = {c: float(f) for c, f in re.findall(
        r"Max frequency for clock\s+'([^']+)':\s+([\d.]+) MHz", log)}
    assert rep.clocks and all(abs(fmax[c.name] - c.achieved_mhz) < 0.01 for c in rep.clocks)
    assert rep.clocks[0].target_mhz == pytest.approx(12.0, abs=0.01)
    assert rep.critical_paths and rep.critical_paths[0].levels >= 1
    assert rep.critical_paths[0].total_ns > 0
    table = rep.table()
    assert "Fmax MHz" in table and "logic cells" in table and "critical path" in table


def test_second_build_is_cached(ice40):
    from fpgaccl.boards.build import build
    again = build("icebreaker")
    assert again.cached and again.key == ice40.key and again.bitstream == ice40.bitstream


def test_cli_prints_the_table(ice40, capsys):
    from fpgaccl.host.build_cli import add_build_subcommand
    parser = argparse.ArgumentParser()
    add_build_subcommand(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["build", "--board", "icebreaker"])
    assert args.build_handler(args) == 0
    out = capsys.readouterr().out
    assert "cached" in out and "Fmax MHz" in out and str(ice40.bitstream) in out
