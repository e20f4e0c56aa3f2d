"""Logic depth of a synthesised ECP5 netlist (yosys' ``top.json``), per block: the
longest register-to-register path in each part of the node, with a rough delay model.

nextpnr only names the critical path after routing, which on the full node takes the
better part of an hour here; this reads the netlist yosys wrote minutes into the build
and says which blocks are too deep for a clock, so pipelining can start before the
route ends. The delays are an estimate (one routed hop per net, typical -8 cell
delays), not timing sign-off: nextpnr's report is the number of record.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

NET_NS = 0.75        # an average routed net between slices
SETUP_NS = 0.1
# Cell output delays from a register/RAM clock edge.
# A PLL's outputs are clocks (its CLKFB loop is no logic path); an IDDRX1F's are
# registers in the I/O cell.
CLOCK_TO_OUT = {"TRELLIS_FF": 0.45, "DP16KD": 4.0, "TRELLIS_IO": 0.45, "EHXPLLL": 0.0,
                "IDDRX1F": 0.45}
# Cells that feed their neighbour inside a slice, without a routed net.
_IN_SLICE = {("LUT4", "PFUMX"), ("PFUMX", "L6MUX21")}


def _comb_ns(cell_type: str, in_port: str, out_port: str) -> float | None:
    """Delay from ``in_port`` to ``out_port`` of a combinational cell (None: no arc)."""
    if cell_type == "LUT4":
        return 0.35
    if cell_type in ("PFUMX", "L6MUX21"):
        return 0.25
    if cell_type == "CCU2C":
        return 0.07 if (in_port == "CIN" and out_port == "COUT") else 0.45
    if cell_type == "MULT18X18D":
        return 4.2      # unregistered multiplier
    if cell_type == "TRELLIS_DPR16X4":
        return 0.6 if in_port.startswith("RAD") else None
    return None


@dataclass
class Path_:
    ns: float
    levels: int
    block: str
    endpoint: str
    start: str
    via: list[str]

    @property
    def mhz(self) -> float:
        return 1000.0 / self.ns


# yosys names a techmapped net after the design signal it came from plus a trail of the
# cells and ports it went through (``crc_TRELLIS_FF_Q_4_DI_PFUMX_C0_Z...``).
_TECHMAP_TAIL = re.compile(r"_(TRELLIS_|LUT4_|CCU2C_|PFUMX_|L6MUX21_|MULT18X18D_|DP16KD_).*")


def _design_names(chain: list[str]) -> list[str]:
    """The design signals a path runs through, in order, each once."""
    out: list[str] = []
    for n in chain:
        if "$" in n:
            continue
        n = _TECHMAP_TAIL.sub("", n)
        if not out or out[-1] != n:
            out.append(n)
    return out


def block_of(name: str, depth: int = 3) -> str:
    """``core.transport.requester.active7_TRELLIS_FF_Q`` -> ``core.transport.requester``."""
    parts = name.split("_TRELLIS")[0].split("$")[0].split(".")
    return ".".join(parts[:min(depth, max(1, len(parts) - 1))])


def analyse(top_json: Path, *, block_depth: int = 3) -> list[Path_]:
    """The worst path ending in each block, slowest first."""
    module = json.loads(Path(top_json).read_text())["modules"]["top"]
    cells = module["cells"]
    names: dict[int, str] = {}
    for n, v in module["netnames"].items():
        for b in v["bits"]:
            if isinstance(b, int) and (b not in names or n.count("$") < names[b].count("$")):
                names[b] = n
    driver: dict[int, tuple[str, str]] = {}
    for cn, c in cells.items():
        for p, d in c.get("port_directions", {}).items():
            if d == "output":
                for b in c["connections"][p]:
                    if isinstance(b, int):
                        driver[b] = (cn, p)

    def inputs(c):
        return [(p, b) for p, d in c["port_directions"].items() if d == "input"
                for b in c["connections"][p] if isinstance(b, int)]

    arrival: dict[int, float] = {}
    level: dict[int, int] = {}
    came: dict[int, int | None] = {}
    expanding: set[int] = set()
    for root in list(driver):
        stack = [root]
        while stack:                       # iterative DFS: cones are thousands deep
            b = stack[-1]
            if b in arrival:
                stack.pop()
                continue
            if b not in driver:
                arrival[b], level[b], came[b] = 0.0, 0, None
                stack.pop()
                continue
            cn, out = driver[b]
            c = cells[cn]
            t = c["type"]
            if t in CLOCK_TO_OUT:
                arrival[b], level[b], came[b] = CLOCK_TO_OUT[t], 0, None
                stack.pop()
                continue
            ins = inputs(c)
            pending = [x for _, x in ins if x not in arrival]
            if pending:
                # A bit being expanded is an ancestor of everything pushed after it, so
                # meeting one again means the logic feeds itself without a register.
                loop = [x for x in pending if x in expanding]
                if loop:
                    raise ValueError(f"top_json: combinational loop through "
                                     f"{names.get(loop[0], loop[0])} (cell {cn})")
                expanding.add(b)
                stack.extend(pending)
                continue
            expanding.discard(b)
            best, lv, src = 0.0, 0, None
            for p, x in ins:
                delay = _comb_ns(t, p, out)
                if delay is None:
                    continue
                src_cell = driver.get(x, (None,))[0]
                wire = 0.0 if p == "CIN" or (
                    src_cell and (cells[src_cell]["type"], t) in _IN_SLICE) else NET_NS
                v = arrival[x] + wire + delay
                if v > best:
                    best, lv, src = v, level[x] + (t == "LUT4"), x
            arrival[b], level[b], came[b] = best, lv, src

    worst: dict[str, Path_] = {}
    for cn, c in cells.items():
        if c["type"] not in ("TRELLIS_FF", "DP16KD"):
            continue
        for p, b in inputs(c):
            if c["type"] == "TRELLIS_FF" and p not in ("DI", "CE", "LSR"):
                continue
            if b not in arrival:
                continue
            ns = arrival[b] + NET_NS + SETUP_NS
            blk = block_of(cn, block_depth)
            if blk in worst and worst[blk].ns >= ns:
                continue
            chain, x = [], b
            while x is not None:
                chain.append(names.get(x, str(x)))
                x = came.get(x)
            chain.reverse()
            worst[blk] = Path_(ns, level[b], blk, f"{cn}.{p}", chain[0], _design_names(chain))
    return sorted(worst.values(), key=lambda p: -p.ns)


def table(paths: list[Path_], limit: int = 20) -> str:
    rows = [f"{'block':38} {'est. ns':>8} {'MHz':>6} {'LUT lvls':>8}  from"]
    for p in paths[:limit]:
        start = block_of(p.start, 6).removeprefix(p.block + ".") or p.start
        rows.append(f"{p.block[:38]:38} {p.ns:8.1f} {p.mhz:6.1f} {p.levels:8d}  {start[:50]}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("top_json", type=Path, help="yosys' netlist (build folder's top.json)")
    ap.add_argument("--depth", type=int, default=3, help="hierarchy levels per block")
    ap.add_argument("--rows", type=int, default=20)
    ap.add_argument("--via", type=int, default=0, metavar="N",
                    help="also print the named nets along the N slowest paths")
    args = ap.parse_args(argv)
    paths = analyse(args.top_json, block_depth=args.depth)
    print(table(paths, args.rows))
    for p in paths[:args.via]:
        print(f"\n{p.block}: {p.ns:.1f} ns, {p.levels} LUT levels, ends at {p.endpoint}")
        for n in p.via:
            print(f"  {n}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
