"""The whole node's Verilog export at 64 and 512 bits (and the node with its DMA engine
at 64 bits) is clean under Verilator's
``--lint-only -Wall`` with the project's waivers (hw/lint/verilator.vlt, each one
explained there). A new warning class, or one outside the generator idioms the waivers
name, fails this test."""

from __future__ import annotations

import subprocess

import pytest

from fpgaccl.hw.node import LINT_WAIVERS, export_verilog, lint_command

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("width", [64, 512])
def test_node_export_is_lint_clean(width, tmp_path):
    from fpgaccl.hw.toolchain import verilator_env
    path = tmp_path / "fpgaccl_node.v"
    path.write_text(export_verilog(width))
    proc = subprocess.run(lint_command(path), env=verilator_env(), capture_output=True,
                          text=True, timeout=600)
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("%")]
    assert proc.returncode == 0 and not warnings, "\n".join(warnings[:40])


def test_dma_node_export_is_lint_clean(tmp_path):
    from fpgaccl.hw.dma_node import export_verilog as export_dma
    from fpgaccl.hw.toolchain import verilator_env
    path = tmp_path / "fpgaccl_dma_node.v"
    path.write_text(export_dma(64))
    proc = subprocess.run(lint_command(path, top="fpgaccl_dma_node"), env=verilator_env(),
                          capture_output=True, text=True, timeout=600)
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("%")]
    assert proc.returncode == 0 and not warnings, "\n".join(warnings[:40])


def test_every_waiver_is_explained():
    lines = LINT_WAIVERS.read_text().splitlines()
    assert lines[0] == "`verilator_config"
    waivers = [i for i, line in enumerate(lines) if line.startswith("lint_off")]
    assert waivers
    for i in waivers:
        # Each waiver is scoped to the export's file and sits under a comment block.
        assert '-file "*fpgaccl_' in lines[i] and 'node*.v"' in lines[i], lines[i]
        j = i - 1
        while lines[j].startswith("lint_off"):
            j -= 1
        assert lines[j].startswith("//"), f"waiver on line {i + 1} has no explanation"
