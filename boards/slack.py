"""Routed arrival times at every register input of an ECP5 build, per block.

nextpnr prints one critical path per clock, so each routed build (the better part of an
hour for the full node here) names one path to fix. Its ``--detailed-timing-report``
also carries the latest arrival time at each sink where a path ends: at a flip-flop's
data, enable or reset input, or a block RAM's input, that is the routed delay of the
worst path ending there (nextpnr's ECP5 model puts setup at 0, so the worst such
arrival is the critical path's length). Grouped by block, they say every part of the
design that misses the clock in one build, with the routed delays nextpnr signed off,
not an estimate. Paths from or to the pins (the ``<async>`` event) are left out: they
are not register to register.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .depth import block_of

_ASYNC = "<async>"


@dataclass(frozen=True)
class Endpoint:
    cell: str
    port: str
    arrival_ns: float       # latest arrival from the launching clock edge, routed

    def block(self, depth: int = 3) -> str:
        return block_of(self.cell, depth)


@dataclass
class BlockSlack:
    block: str
    worst: Endpoint
    failing: int            # endpoints of the block later than the period
    endpoints: int

    def slack_ns(self, period_ns: float) -> float:
        return period_ns - self.worst.arrival_ns


def endpoints(folder: Path) -> list[Endpoint]:
    """Every clocked register input of the build in ``folder`` (its ``report.json``,
    written with ``--detailed-timing-report``), slowest first."""
    report = json.loads((Path(folder) / "report.json").read_text())
    if "detailed_net_timings" not in report:
        raise ValueError(f"{folder}/report.json: no detailed_net_timings (nextpnr was "
                         "run without --detailed-timing-report)")
    worst: dict[tuple[str, str], float] = {}
    for net in report["detailed_net_timings"]:
        if net["event"] == _ASYNC:
            continue
        for e in net["endpoints"]:
            if e["event"] == _ASYNC:
                continue
            key = (e["cell"], e["port"])
            worst[key] = max(worst.get(key, 0.0), e["delay"][1])
    eps = [Endpoint(c, p, t) for (c, p), t in worst.items()]
    return sorted(eps, key=lambda e: (-e.arrival_ns, e.cell, e.port))


def by_block(eps: list[Endpoint], period_ns: float, depth: int = 3) -> list[BlockSlack]:
    """The worst endpoint of each block and how many of its endpoints miss
    ``period_ns``, worst block first."""
    blocks: dict[str, BlockSlack] = {}
    for e in eps:                                   # slowest first: the first is worst
        b = e.block(depth)
        s = blocks.setdefault(b, BlockSlack(b, e, 0, 0))
        s.endpoints += 1
        s.failing += e.arrival_ns > period_ns
    return sorted(blocks.values(), key=lambda s: -s.worst.arrival_ns)


def table(blocks: list[BlockSlack], period_ns: float, rows: int = 15) -> str:
    out = [f"{'block':34} {'worst ns':>8} {'MHz':>6} {'slack':>6} {'failing':>9}  endpoint"]
    for s in blocks[:rows]:
        w = s.worst
        end = w.cell.removeprefix(s.block + ".")
        out.append(f"{s.block[:34]:34} {w.arrival_ns:8.2f} {1000 / w.arrival_ns:6.1f} "
                   f"{s.slack_ns(period_ns):6.2f} {s.failing:4d}/{s.endpoints:<4d}  "
                   f"{end[:40]}.{w.port}")
    return "\n".join(out)


def as_rows(blocks: list[BlockSlack], period_ns: float, rows: int = 15) -> list[dict]:
    return [{"block": s.block, "worst_ns": round(s.worst.arrival_ns, 3),
             "mhz": round(1000 / s.worst.arrival_ns, 1),
             "slack_ns": round(s.slack_ns(period_ns), 3), "failing": s.failing,
             "endpoints": s.endpoints, "endpoint": f"{s.worst.cell}.{s.worst.port}"}
            for s in blocks[:rows]]


def main(argv: list[str] | None = None) -> int:
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path, help="a routed build folder")
    ap.add_argument("--mhz", type=float, default=100.0, help="the clock target")
    ap.add_argument("--depth", type=int, default=3, help="hierarchy levels per block")
    ap.add_argument("--rows", type=int, default=20)
    args = ap.parse_args(argv)
    period = 1000.0 / args.mhz
    eps = endpoints(args.folder)
    late = sum(e.arrival_ns > period for e in eps)
    print(f"{len(eps)} register inputs, {late} later than {period:.2f} ns\n")
    print(table(by_block(eps, period, args.depth), period, args.rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
