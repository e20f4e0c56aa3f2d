"""The logic-depth estimate (fpgaccl.boards.depth) on small hand-written ECP5 netlists in
yosys' JSON form: path delays, LUT levels, carry chains, blocks, and loop detection."""

from __future__ import annotations

import json

import pytest

from fpgaccl.boards.depth import (
    CLOCK_TO_OUT,
    NET_NS,
    SETUP_NS,
    _design_names,
    analyse,
    block_of,
    table,
)

FF_PORTS = {"CLK": "input", "LSR": "input", "CE": "input", "DI": "input", "Q": "output"}
LUT_PORTS = {"A": "input", "B": "input", "C": "input", "D": "input", "Z": "output"}
CCU_PORTS = {"CIN": "input", "A0": "input", "B0": "input", "A1": "input", "B1": "input",
             "C0": "input", "D0": "input", "C1": "input", "D1": "input",
             "S0": "output", "S1": "output", "COUT": "output"}


def ff(d, q, clk=1):
    return {"type": "TRELLIS_FF", "port_directions": FF_PORTS,
            "connections": {"CLK": [clk], "LSR": ["0"], "CE": ["1"], "DI": [d], "Q": [q]}}


def lut(a, z, b="0"):
    return {"type": "LUT4", "port_directions": LUT_PORTS,
            "connections": {"A": [a], "B": [b], "C": ["0"], "D": ["0"], "Z": [z]}}


def ccu(cin, a, s, cout):
    conns = {p: ["0"] for p in CCU_PORTS}
    conns.update({"CIN": [cin], "A0": [a], "S0": [s], "COUT": [cout]})
    return {"type": "CCU2C", "port_directions": CCU_PORTS, "connections": conns}


def write(tmp_path, cells, netnames):
    path = tmp_path / "top.json"
    path.write_text(json.dumps({"modules": {"top": {
        "cells": cells,
        "netnames": {n: {"bits": b} for n, b in netnames.items()}}}}))
    return path


def test_register_to_register_paths_per_block(tmp_path):
    cells = {
        # core.deep: FF -> LUT -> LUT -> FF
        "core.deep.src_TRELLIS_FF_Q": ff(10, 2),
        "core.deep.l1": lut(2, 3),
        "core.deep.l2": lut(3, 4),
        "core.deep.dst_TRELLIS_FF_Q": ff(4, 5),
        # core.flat.q: one LUT between registers (its FF keeps its own output)
        "core.flat.q_TRELLIS_FF_Q": ff(6, 7),
        "core.flat.l": lut(7, 6),
    }
    top = write(tmp_path, cells, {"clk": [1], "core.deep.src": [2], "core.deep.mid": [3],
                                  "core.deep.dst$next": [4], "core.flat.q": [7],
                                  "d": [10]})
    paths = analyse(top)
    assert [p.block for p in paths] == ["core.deep", "core.flat"]
    deep, flat = paths
    ff_q = CLOCK_TO_OUT["TRELLIS_FF"]
    assert deep.ns == pytest.approx(ff_q + 3 * NET_NS + 2 * 0.35 + SETUP_NS)
    assert flat.ns == pytest.approx(ff_q + 2 * NET_NS + 0.35 + SETUP_NS)
    assert (deep.levels, flat.levels) == (2, 1)
    assert deep.start == "core.deep.src" and deep.via == ["core.deep.src", "core.deep.mid"]
    assert _design_names(["a.crc_TRELLIS_FF_Q_4_DI_PFUMX_C0_Z", "a.crc_TRELLIS_FF_Q_1_DI",
                          "$abc$1", "a.flen", "a.x_LUT4_Z"]) == ["a.crc", "a.flen", "a.x"]
    assert deep.endpoint == "core.deep.dst_TRELLIS_FF_Q.DI"
    assert deep.mhz == pytest.approx(1000 / deep.ns)
    assert "core.deep" in table(paths).splitlines()[1]


def test_carry_chain_has_no_routed_hop(tmp_path):
    # FF -> CCU2C -> COUT -> CCU2C -> COUT -> CCU2C -> S0 -> FF: two carry hops.
    cells = {
        "add.a_TRELLIS_FF_Q": ff(9, 2),
        "add.c0": ccu("0", 2, 20, 3),
        "add.c1": ccu(3, "0", 21, 4),
        "add.c2": ccu(4, "0", 5, 22),
        "add.s_TRELLIS_FF_Q": ff(5, 6),
    }
    top = write(tmp_path, cells, {"add.a": [2], "add.s": [6], "x": [9]})
    (path,) = [p for p in analyse(top, block_depth=1) if p.endpoint.startswith("add.s")]
    ff_q = CLOCK_TO_OUT["TRELLIS_FF"]
    assert path.ns == pytest.approx(ff_q + NET_NS + 0.45 + 0.07 + 0.45 + NET_NS + SETUP_NS)
    assert path.levels == 0


def test_combinational_loop_is_reported(tmp_path):
    cells = {"a": lut(3, 2), "b": lut(2, 3), "r_TRELLIS_FF_Q": ff(3, 4)}
    top = write(tmp_path, cells, {"x": [2], "y": [3]})
    with pytest.raises(ValueError, match="top_json: combinational loop"):
        analyse(top)


def test_block_names():
    assert block_of("core.transport.requester.active7_TRELLIS_FF_Q") == \
        "core.transport.requester"
    assert block_of("core.bank.x_TRELLIS_FF_Q", 1) == "core"
    assert block_of("led_TRELLIS_FF_Q") == "led"


def test_pll_feedback_is_no_loop(tmp_path):
    """An EHXPLLL's CLKOP feeds its own CLKFB: a clock loop, not logic; a register fed
    from an IDDRX1F's output through a LUT is a path that starts in the I/O cell."""
    pll_ports = {"CLKI": "input", "CLKFB": "input", "CLKOP": "output", "LOCK": "output"}
    iddr_ports = {"D": "input", "SCLK": "input", "RST": "input", "Q0": "output",
                  "Q1": "output"}
    cells = {
        "pll": {"type": "EHXPLLL", "port_directions": pll_ports,
                "connections": {"CLKI": [2], "CLKFB": [3], "CLKOP": [3], "LOCK": [4]}},
        "in.iddr": {"type": "IDDRX1F", "port_directions": iddr_ports,
                    "connections": {"D": [5], "SCLK": [3], "RST": ["0"], "Q0": [6],
                                    "Q1": [7]}},
        "in.lut": lut(6, 8, b=4),
        "in.r_FF": ff(8, 9, clk=3),
    }
    paths = analyse(write(tmp_path, cells, {"in.r": [9]}))
    assert [p.block for p in paths] == ["in"]
    assert paths[0].ns == pytest.approx(CLOCK_TO_OUT["IDDRX1F"] + 2 * NET_NS + 0.35
                                        + SETUP_NS)
