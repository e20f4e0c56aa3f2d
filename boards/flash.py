"""Programming a board with openFPGALoader (Debian package ``openfpgaloader``; the
``./fpgaccl flash`` wrapper installs it on first use).

By default the bitstream goes to the FPGA's configuration SRAM (gone at power-off);
``write_flash`` writes the board's SPI flash instead, so it loads at every power-up.
The iCE40 on the iCEBreaker has no JTAG: openFPGALoader always writes its flash.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from fpgaccl.errors import (
    BitstreamMissingError,
    CableNotFoundError,
    InvalidArgumentError,
    ToolchainError,
)

TOOL = "openFPGALoader"
DEBIAN_PACKAGE = "openfpgaloader"


@dataclass(frozen=True)
class FlashTarget:
    board: str             # openFPGALoader's --board name (sets the default cable)
    flash_only: bool = False


TARGETS: dict[str, FlashTarget] = {
    "ecpix5-85": FlashTarget("ecpix5"),           # on-board FT2232 ("ecpix5-debug")
    "ulx3s-85f": FlashTarget("ulx3s"),            # on-board FT231X
    "icebreaker": FlashTarget("ice40_generic", flash_only=True),
}
"""Boards a bitstream can be loaded onto here (the Alveo is programmed from Vivado)."""

# What openFPGALoader prints when it cannot reach a cable (seen with 0.10 and no board:
# "unable to open ftdi device: -3 (device not found)", "Failed to claim cable",
# "error : NAME not found" for an unknown --cable).
_NO_CABLE = re.compile(r"device not found|unable to open ftdi|failed to claim cable|"
                       r"jtag init failed|no device found|cable.*not found|"
                       r"error : \S+ not found|libusb", re.IGNORECASE)


def target(board: str) -> FlashTarget:
    try:
        return TARGETS[board]
    except KeyError:
        raise InvalidArgumentError(
            "board", f"{board!r} cannot be flashed here (flashable: "
                     f"{', '.join(sorted(TARGETS))})") from None


def flash_command(board: str, bitstream: Path, *, cable: str | None = None,
                  write_flash: bool = False, tool: str = TOOL) -> list[str]:
    """The openFPGALoader command line that loads ``bitstream`` onto ``board``."""
    t = target(board)
    cmd = [tool, "--board", t.board]
    if cable:
        cmd += ["--cable", cable]
    if write_flash and not t.flash_only:
        cmd.append("--write-flash")
    return [*cmd, str(bitstream)]


def built_bitstream(board: str, config, root: Path) -> Path:
    """The bitstream ``fpgaccl build`` made for ``config`` on ``board`` (its cache
    folder, found by the same key); BitstreamMissingError if that build is not done."""
    from .build import BITSTREAM, cache_key, make_plan, tool_versions
    from .platforms import BOARDS
    b = BOARDS[board]
    key = cache_key(make_plan(b, config), tool_versions(b))
    folder = Path(root) / f"{b.name}-{key}"
    family = "ice40" if "NEXTPNR_ICE40" in b.tools else "ecp5"
    bit = folder / BITSTREAM[family]
    if not (folder / "done.json").exists() or not bit.exists():
        raise BitstreamMissingError(
            "bitstream", f"no finished build of {board} ({config.describe()}) at {folder}: "
                         f"run 'fpgaccl build --board {board}' with the same options "
                         "first, or give --bitstream PATH")
    return bit


def check_bitstream(path: Path) -> Path:
    path = Path(path)
    if not path.is_file():
        raise BitstreamMissingError("bitstream", f"{path} does not exist (build it with "
                                                 "'fpgaccl build --board NAME', or give "
                                                 "--bitstream PATH)")
    if path.stat().st_size == 0:
        raise BitstreamMissingError("bitstream", f"{path} is empty")
    return path


def flash(board: str, bitstream: Path, *, cable: str | None = None,
          write_flash: bool = False, timeout: float = 600.0) -> str:
    """Load ``bitstream`` onto ``board``; returns openFPGALoader's output. Raises
    :class:`BitstreamMissingError`, :class:`CableNotFoundError` (no cable/board),
    :class:`ToolchainError` (openFPGALoader missing or failing otherwise)."""
    check_bitstream(bitstream)
    tool = shutil.which(TOOL)
    if tool is None:
        raise ToolchainError(f"{TOOL} is not installed: './fpgaccl flash ...' installs "
                             f"the Debian package {DEBIAN_PACKAGE} (as root), or run "
                             f"'apt-get install {DEBIAN_PACKAGE}'")
    cmd = flash_command(board, bitstream, cable=cable, write_flash=write_flash, tool=tool)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    out = proc.stdout + proc.stderr
    if proc.returncode != 0:
        if _NO_CABLE.search(out):
            which = f"cable {cable!r}" if cable else f"the {board}'s own USB cable"
            raise CableNotFoundError(cable, f"openFPGALoader found no {which}: is the "
                                            f"board plugged in and powered, and this user "
                                            f"allowed on the USB device? ({out.strip()})")
        raise ToolchainError(f"{' '.join(cmd)} failed ({proc.returncode}): {out.strip()}")
    return out
