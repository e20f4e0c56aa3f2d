"""nextpnr's ``--report`` JSON (plus yosys's netlist for the LUT/FF split on iCE40)
turned into the table ``fpgaccl build`` prints.

What the numbers are: placed-and-routed utilisation of the whole board top (core, link,
UART bridge, I/O) against the device's totals; Fmax per clock is nextpnr's post-route
static timing estimate for the device's speed grade, against the constraint the board's
clock resource sets; the critical path is nextpnr's worst path of each clock, cell by
cell. They are the open tools' estimates, not measurements on silicon.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

# Report rows: (label, nextpnr BEL type, netlist cell types counted when nextpnr has none)
_ROWS = {
    "ecp5": (
        ("LUT4 (+carry)", "TRELLIS_COMB", ()),
        ("FF", "TRELLIS_FF", ()),
        ("BRAM (DP16KD)", "DP16KD", ()),
        ("DSP (MULT18X18D)", "MULT18X18D", ()),
        ("IO", "TRELLIS_IO", ()),
    ),
    "ice40": (
        ("logic cells", "ICESTORM_LC", ()),
        ("  of which LUT4", "ICESTORM_LC", ("SB_LUT4",)),
        ("  of which FF", "ICESTORM_LC", ("SB_DFF",)),
        ("BRAM (4 kbit)", "ICESTORM_RAM", ()),
        ("DSP (MAC16)", "ICESTORM_DSP", ()),
        ("IO", "SB_IO", ()),
    ),
}
_LOGIC = {"clk-to-q", "source", "logic", "setup"}
# nextpnr reports the fixed clock net of unregistered iCE40 DSPs as a clock of its own.
_PSEUDO_CLOCK = "$PACKER_GND"
# yosys names techmapped cells after the net they drive plus a trail of cell types;
# the design's own name is what comes before the first of those.
_TECHMAP_TAIL = re.compile(r"(_SB_|_TRELLIS|_LUT4|_CCU2|_DFF|_MULT18|_DP16|_ALU54|\$).*")


@dataclass
class Resource:
    name: str
    used: int
    available: int

    @property
    def percent(self) -> float:
        return 100.0 * self.used / self.available if self.available else 0.0


@dataclass
class Clock:
    name: str
    achieved_mhz: float
    target_mhz: float

    @property
    def met(self) -> bool:
        return self.achieved_mhz >= self.target_mhz


@dataclass
class Path_:
    from_clock: str
    to_clock: str
    start: str
    end: str
    total_ns: float
    logic_ns: float
    routing_ns: float
    levels: int                  # logic cells between the launching and capturing FFs
    cells: list[str] = field(default_factory=list)

    @property
    def blocks(self) -> list[str]:
        """The hierarchy (first two name components) the path runs through, in order."""
        out: list[str] = []
        for c in self.cells:
            if c.startswith("$nextpnr"):
                continue        # packer-made cells (carry feed-ins) belong to no block
            b = _TECHMAP_TAIL.sub("", ".".join(c.split(".")[:2])) or c[:40]
            if not out or out[-1] != b:
                out.append(b)
        return out


@dataclass
class Report:
    family: str
    resources: list[Resource]
    clocks: list[Clock]
    critical_paths: list[Path_]

    def as_dict(self) -> dict:
        return {
            "family": self.family,
            "resources": [{"name": r.name, "used": r.used, "available": r.available,
                           "percent": round(r.percent, 1)} for r in self.resources],
            "clocks": [{"name": c.name, "achieved_mhz": round(c.achieved_mhz, 2),
                        "target_mhz": round(c.target_mhz, 2), "met": c.met}
                       for c in self.clocks],
            "critical_paths": [{"from_clock": p.from_clock, "to_clock": p.to_clock,
                                "start": p.start, "end": p.end,
                                "total_ns": round(p.total_ns, 3),
                                "logic_ns": round(p.logic_ns, 3),
                                "routing_ns": round(p.routing_ns, 3), "levels": p.levels,
                                "blocks": p.blocks} for p in self.critical_paths],
        }

    def table(self) -> str:
        lines = [f"{'resource':<18}{'used':>8}{'available':>11}{'util':>8}"]
        for r in self.resources:
            lines.append(f"{r.name:<18}{r.used:>8}{r.available:>11}{r.percent:>7.1f}%")
        lines.append("")
        lines.append(f"{'clock':<28}{'Fmax MHz':>10}{'target':>9}  met")
        for c in self.clocks:
            lines.append(f"{c.name:<28}{c.achieved_mhz:>10.2f}{c.target_mhz:>9.2f}  "
                         f"{'yes' if c.met else 'NO'}")
        # Register-to-register paths set Fmax; I/O paths (<async>) are listed in as_dict.
        for p in self.critical_paths:
            if p.from_clock != p.to_clock:
                continue
            lines.append("")
            lines.append(f"critical path {p.from_clock} -> {p.to_clock}: {p.total_ns:.2f} ns "
                         f"({p.logic_ns:.2f} logic in {p.levels} levels, "
                         f"{p.routing_ns:.2f} routing)")
            lines.append(f"  from {p.start}")
            lines.append(f"  to   {p.end}")
            lines.append(f"  via  {' > '.join(p.blocks)}")
        return "\n".join(lines)


def _netlist_counts(folder: Path) -> Counter:
    counts: Counter = Counter()
    netlist = folder / "top.json"
    if not netlist.exists():
        return counts
    for mod in json.loads(netlist.read_text())["modules"].values():
        for cell in mod.get("cells", {}).values():
            counts[cell["type"]] += 1
    return counts


def _path(entry: dict) -> Path_:
    segs = entry.get("path", [])
    logic = sum(s.get("delay", 0.0) for s in segs if s.get("type") in _LOGIC)
    routing = sum(s.get("delay", 0.0) for s in segs if s.get("type") == "routing")
    start = segs[0]["from"] if segs else {}
    end = segs[-1]["to"] if segs else {}
    cells = [start.get("cell", ""),
             *(s["to"]["cell"] for s in segs if s.get("type") == "logic" and "to" in s),
             end.get("cell", "")]
    return Path_(entry.get("from", "?"), entry.get("to", "?"),
                 f"{start.get('cell', '?')}.{start.get('port', '?')}",
                 f"{end.get('cell', '?')}.{end.get('port', '?')}",
                 logic + routing, logic, routing,
                 sum(1 for s in segs if s.get("type") == "logic"), cells)


def parse_report(folder: Path | str, family: str | None = None) -> Report:
    """Read ``report.json`` (and ``top.json``) from a build folder."""
    folder = Path(folder)
    data = json.loads((folder / "report.json").read_text())
    util = data.get("utilization", {})
    if family is None:
        family = "ice40" if "ICESTORM_LC" in util else "ecp5"
    counts = _netlist_counts(folder) if family == "ice40" else Counter()
    resources = []
    for label, bel, cell_types in _ROWS[family]:
        if bel not in util:
            continue
        used = util[bel]["used"]
        if cell_types:
            used = sum(n for t, n in counts.items() if t.startswith(cell_types))
        resources.append(Resource(label, used, util[bel]["available"]))
    clocks = [Clock(name, v["achieved"], v["constraint"])
              for name, v in sorted(data.get("fmax", {}).items())
              if _PSEUDO_CLOCK not in name]
    paths = [p for p in map(_path, data.get("critical_paths", []))
             if _PSEUDO_CLOCK not in p.from_clock + p.to_clock]
    return Report(family, resources, clocks, paths)


_LOG_UTIL = re.compile(r"^Info:\s+(\w+):\s+(\d+)/\s*(\d+)\s+\d+%", re.M)
_LOG_FMAX = re.compile(r"Max frequency for clock\s+'([^']+)':\s+([\d.]+) MHz \((?:PASS|FAIL) "
                       r"at ([\d.]+) MHz\)")


def parse_log(folder: Path | str, family: str = "ecp5") -> Report:
    """What nextpnr's log already says while it is still routing (or after it gave up):
    utilisation after packing and the latest Fmax estimate -- after placement until
    routing ends. No critical paths: those are only reported at the end."""
    text = (Path(folder) / "top.tim").read_text()
    util = {name: (int(u), int(a)) for name, u, a in _LOG_UTIL.findall(text)}
    resources = [Resource(label, *util[bel]) for label, bel, cells in _ROWS[family]
                 if bel in util and not cells]
    latest: dict[str, Clock] = {}
    for name, achieved, target in _LOG_FMAX.findall(text):
        if _PSEUDO_CLOCK not in name:
            latest[name] = Clock(name, float(achieved), float(target))
    return Report(family, resources, list(latest.values()), [])
