"""fpgaccl flash without a board: the openFPGALoader command line, the typed errors for
a missing bitstream, an unknown board, a missing tool, and (with the real tool, when it
is installed) no cable."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from fpgaccl.boards.flash import built_bitstream, flash, flash_command
from fpgaccl.errors import (
    BitstreamMissingError,
    CableNotFoundError,
    InvalidArgumentError,
    ToolchainError,
)
from fpgaccl.host.cli import main

from ._deps import needs_boards


def test_command_lines():
    bit = Path("build/boards/x/top.bit")
    assert flash_command("ecpix5-85", bit) == ["openFPGALoader", "--board", "ecpix5", str(bit)]
    assert flash_command("ecpix5-85", bit, cable="ft2232", write_flash=True) == [
        "openFPGALoader", "--board", "ecpix5", "--cable", "ft2232", "--write-flash", str(bit)]
    assert flash_command("ulx3s-85f", bit) == ["openFPGALoader", "--board", "ulx3s", str(bit)]
    # The iCEBreaker's iCE40 is always loaded from its SPI flash: no --write-flash.
    assert flash_command("icebreaker", Path("top.bin"), write_flash=True) == [
        "openFPGALoader", "--board", "ice40_generic", "top.bin"]


def test_unknown_board_names_the_argument():
    with pytest.raises(InvalidArgumentError) as e:
        flash_command("alveo-u55c", Path("top.bit"))
    assert e.value.argument == "board"


def test_missing_or_empty_bitstream(tmp_path):
    with pytest.raises(BitstreamMissingError) as e:
        flash("ecpix5-85", tmp_path / "nope.bit")
    assert e.value.argument == "bitstream" and "nope.bit" in str(e.value)
    (tmp_path / "empty.bit").write_bytes(b"")
    with pytest.raises(BitstreamMissingError, match="empty"):
        flash("ecpix5-85", tmp_path / "empty.bit")


def test_missing_tool(tmp_path, monkeypatch):
    bit = tmp_path / "top.bit"
    bit.write_bytes(b"\xff" * 64)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ToolchainError, match="apt-get install openfpgaloader"):
        flash("ecpix5-85", bit)


def _ftdi_present() -> bool:
    for vid in Path("/sys/bus/usb/devices").glob("*/idVendor"):
        if vid.read_text().strip() == "0403":
            return True
    return False


def test_no_cable_with_the_real_tool(tmp_path):
    if shutil.which("openFPGALoader") is None:
        pytest.skip("openFPGALoader is not installed (./fpgaccl flash installs it)")
    if _ftdi_present():
        pytest.skip("an FTDI USB device is attached: this test needs none")
    bit = tmp_path / "top.bit"
    bit.write_bytes(b"\xff" * 64)
    with pytest.raises(CableNotFoundError) as e:
        flash("ecpix5-85", bit)
    assert e.value.cable is None and "plugged in" in str(e.value)
    with pytest.raises(CableNotFoundError) as e:
        flash("ecpix5-85", bit, cable="ft2232")
    assert e.value.cable == "ft2232"


def test_cli(tmp_path, capsys):
    assert main(["flash", "--board", "ecpix5-85", "--bitstream",
                 str(tmp_path / "nope.bit")]) == 2
    assert "BitstreamMissingError: bitstream:" in capsys.readouterr().err
    bit = tmp_path / "top.bit"
    bit.write_bytes(b"\xff" * 64)
    assert main(["flash", "--board", "ecpix5-85", "--bitstream", str(bit), "--cable",
                 "ft2232", "--write-flash", "--dry-run"]) == 0
    assert capsys.readouterr().out.split() == [
        "openFPGALoader", "--board", "ecpix5", "--cable", "ft2232", "--write-flash", str(bit)]
    with pytest.raises(SystemExit):
        main(["flash", "--board", "alveo-u55c"])


@needs_boards
def test_default_bitstream_is_the_builds(tmp_path, capsys):
    """Without --bitstream, the build folder of the same board and options: absent here."""
    from fpgaccl.boards.platforms import BOARDS
    with pytest.raises(BitstreamMissingError, match="fpgaccl build --board icebreaker"):
        built_bitstream("icebreaker", BOARDS["icebreaker"].config, tmp_path)
    assert main(["flash", "--board", "icebreaker", "--root", str(tmp_path)]) == 2
    assert "no finished build of icebreaker" in capsys.readouterr().err


def test_build_and_flash_refuse_a_bad_address(capsys):
    """--ip/--mac are checked before anything is elaborated or run."""
    assert main(["build", "--board", "ecpix5-85", "--ip", "300.1.1.1"]) == 2
    assert "fpgaccl build: ip: not an IPv4 address" in capsys.readouterr().err
    assert main(["flash", "--board", "ecpix5-85", "--mac", "02:00"]) == 2
    assert "fpgaccl flash: mac: not a MAC address" in capsys.readouterr().err
