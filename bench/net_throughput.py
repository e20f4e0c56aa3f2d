"""Throughput and latency of the RoCEv2 parser and builder on Verilator.

Runs at 512 bits with 4096-byte RDMA WRITE payloads. Traffic generators and counters are
HDL (a ROM replaying one frame back to back into the parser with every output always
ready; a constant header record plus a ROM of payload beats into the builder), so no
Python runs per cycle. Payload beats coming out are compared in hardware with the
expected ones (``#wrong``).

Prints a table and writes bench/results/net_throughput.json (command, git revision,
machine, date, numbers).

    .venv/bin/python bench/net_throughput.py [--width 512] [--payload 4096] [--cycles 200000]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

from amaranth.hdl import Const, Module, Signal
from amaranth.lib import data, memory, wiring
from amaranth.lib.wiring import In, Out

from fpgaccl import proto
from fpgaccl.hw.net.builder import RoceBuilder
from fpgaccl.hw.net.parser import RoceParser
from fpgaccl.hw.net.record import RECORD
from fpgaccl.hw.stream.beat import beat_layout
from fpgaccl.sim.models.stream import frame_to_beats, pack
from fpgaccl.sim.runner import FAST_BUILD_ARGS, build, run
from fpgaccl.sim.tb.net_frames import record_word

REPO = Path(__file__).resolve().parent.parent
COUNTER_BITS = 32


def test_packet(payload_len: int) -> tuple[dict, bytes, bytes]:
    fields = {
        "eth": {"dst": 0x020000000002, "src": 0x020000000001},
        "ip": {"src": 0x0A000001, "dst": 0x0A000002, "ttl": 64, "id": 7},
        "udp": {"sport": 0xC123, "dport": proto.ROCEV2_UDP_PORT},
        "bth": {"opcode": int(proto.Opcode.RDMA_WRITE_MIDDLE), "dqpn": 0x11, "psn": 5},
    }
    payload = bytes((i * 7 + 3) & 0xFF for i in range(payload_len))
    return fields, payload, proto.build_frame(payload=payload, **fields)


class ThroughputTop(wiring.Component):
    """Parser and builder, each fed by a replaying ROM, outputs always ready."""

    def __init__(self, width: int, payload_len: int) -> None:
        self.width = width
        self.fields, self.payload, self.frame = test_packet(payload_len)
        ports = {"go": In(1)}
        for name in ("cycles", "p_in", "p_pay", "p_hdr", "p_first_in", "p_first_hdr",
                     "p_first_out", "p_bad", "b_out", "b_frames", "b_pay_in", "b_first_in",
                     "b_first_out", "b_bad"):
            ports[name] = Out(COUNTER_BITS)
        super().__init__(ports)

    def _rom(self, m: Module, name: str, beats: list[dict]):
        layout = beat_layout(self.width)
        mem = memory.Memory(shape=layout.size, depth=len(beats),
                            init=[pack(layout, b) for b in beats])
        m.submodules[name] = mem
        port = mem.read_port(domain="comb")
        idx = Signal(range(len(beats)), name=f"{name}_idx")
        m.d.comb += port.addr.eq(idx)
        return data.View(layout, port.data), idx, len(beats)

    def elaborate(self, platform) -> Module:
        m = Module()
        W = self.width
        go = self.go
        m.d.sync += self.cycles.eq(self.cycles + go)

        def first(counter: Signal, seen: Signal, event) -> None:
            with m.If(event & ~seen):
                m.d.sync += [counter.eq(self.cycles), seen.eq(1)]

        def step(idx, n, when):
            with m.If(when):
                m.d.sync += idx.eq(0)
                with m.If(idx != n - 1):
                    m.d.sync += idx.eq(idx + 1)

        # Parser: the frame replayed back to back.
        m.submodules.parser = p = RoceParser(W)
        frame, fidx, fn = self._rom(m, "frame_rom", frame_to_beats(self.frame, W))
        want, widx, wn = self._rom(m, "pay_rom", frame_to_beats(self.payload, W))
        m.d.comb += [p.i.payload.eq(frame), p.i.valid.eq(go), p.o.ready.eq(1), p.hdr.ready.eq(1)]
        take = p.i.valid & p.i.ready
        step(fidx, fn, take)
        seen_in, seen_out, seen_hdr = Signal(), Signal(), Signal()
        first(self.p_first_in, seen_in, take)
        with m.If(take):
            m.d.sync += self.p_in.eq(self.p_in + 1)
        out = p.o.valid
        first(self.p_first_out, seen_out, out)
        with m.If(out):
            m.d.sync += self.p_pay.eq(self.p_pay + 1)
            step(widx, wn, 1)
            with m.If(p.o.payload.as_value() != want.as_value()):
                m.d.sync += self.p_bad.eq(self.p_bad + 1)
        first(self.p_first_hdr, seen_hdr, p.hdr.valid)
        with m.If(p.hdr.valid):
            m.d.sync += self.p_hdr.eq(self.p_hdr + 1)

        # Builder: a constant header record and the payload replayed.
        m.submodules.builder = b = RoceBuilder(W)
        pay, pidx, pn = self._rom(m, "tx_pay_rom", frame_to_beats(self.payload, W))
        exp, eidx, en = self._rom(m, "tx_frame_rom", frame_to_beats(self.frame, W))
        word = record_word(self.fields, len(self.payload))
        m.d.comb += [b.hdr.payload.as_value().eq(Const(word, RECORD.size)), b.hdr.valid.eq(go),
                     b.i.payload.eq(pay), b.i.valid.eq(go), b.o.ready.eq(1)]
        btake = b.i.valid & b.i.ready
        step(pidx, pn, btake)
        seen_bin, seen_bout = Signal(), Signal()
        first(self.b_first_in, seen_bin, b.hdr.valid & b.hdr.ready)
        with m.If(btake):
            m.d.sync += self.b_pay_in.eq(self.b_pay_in + 1)
        first(self.b_first_out, seen_bout, b.o.valid)
        with m.If(b.o.valid):
            m.d.sync += self.b_out.eq(self.b_out + 1)
            step(eidx, en, 1)
            with m.If(b.o.payload.as_value() != exp.as_value()):
                m.d.sync += self.b_bad.eq(self.b_bad + 1)
            with m.If(b.o.payload.last):
                m.d.sync += self.b_frames.eq(self.b_frames + 1)
        return m


def git_rev() -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, check=True,
                             capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "hw/net", "hw/stream",
                                "bench/net_throughput.py"], cwd=REPO, check=True,
                               capture_output=True, text=True).stdout.strip()
        return rev + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--payload", type=int, default=4096)
    ap.add_argument("--cycles", type=int, default=200_000)
    ap.add_argument("--out", type=Path, default=REPO / "bench/results/net_throughput.json")
    args = ap.parse_args(argv)

    top = ThroughputTop(args.width, args.payload)
    nbytes = args.width // 8
    frame_beats = -(-len(top.frame) // nbytes)
    pay_beats = -(-len(top.payload) // nbytes)
    sim = build(top, f"net_throughput_w{args.width}_p{args.payload}",
                build_args=FAST_BUILD_ARGS)
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "counters.json"
        run(sim, "fpgaccl.sim.benches.net_throughput",
            params={"cycles": args.cycles, "out": str(raw)})
        c = json.loads(raw.read_text())

    cyc = c["cycles"]
    # Steady state: one frame beat per cycle is the line rate; header-only beats are the
    # frame beats that carry no payload beat of their own.
    hdr_beats = frame_beats - pay_beats
    frames_in = c["p_in"] / frame_beats
    rows = [
        {"dut": "parser", "width": args.width, "payload_bytes": args.payload,
         "frame_bytes": len(top.frame), "frame_beats": frame_beats, "payload_beats": pay_beats,
         "cycles": cyc, "in_beats_per_cycle": round(c["p_in"] / cyc, 4),
         "payload_beats_per_cycle": round(c["p_pay"] / cyc, 4),
         "payload_beats_per_cycle_excl_header":
             round(c["p_pay"] / (cyc - hdr_beats * frames_in), 4),
         "frames": c["p_hdr"],
         "latency_first_in_to_first_payload_out": c["p_first_out"] - c["p_first_in"],
         "latency_first_in_to_header_out": c["p_first_hdr"] - c["p_first_in"],
         "wrong": c["p_bad"]},
        {"dut": "builder", "width": args.width, "payload_bytes": args.payload,
         "frame_bytes": len(top.frame), "frame_beats": frame_beats, "payload_beats": pay_beats,
         "cycles": cyc, "out_beats_per_cycle": round(c["b_out"] / cyc, 4),
         "payload_beats_per_cycle": round(c["b_pay_in"] / cyc, 4),
         "payload_beats_per_cycle_excl_header":
             round(c["b_pay_in"] / (cyc - hdr_beats * c["b_frames"]), 4),
         "frames": c["b_frames"],
         "latency_first_in_to_first_out": c["b_first_out"] - c["b_first_in"],
         "wrong": c["b_bad"]},
    ]
    print(f"{'dut':>8} {'width':>5} {'payload':>7} {'frame':>6} {'beats/f':>7} "
          f"{'beats/cyc':>9} {'pay/cyc':>8} {'pay/cyc*':>8} {'frames':>7} {'latency':>7} "
          f"{'#wrong':>6}")
    for r in rows:
        line_rate = r.get("in_beats_per_cycle", r.get("out_beats_per_cycle"))
        lat = r.get("latency_first_in_to_first_payload_out", r.get("latency_first_in_to_first_out"))
        print(f"{r['dut']:>8} {r['width']:>5} {r['payload_bytes']:>7} {r['frame_bytes']:>6} "
              f"{r['frame_beats']:>7} {line_rate:>9.4f} {r['payload_beats_per_cycle']:>8.4f} "
              f"{r['payload_beats_per_cycle_excl_header']:>8.4f} {r['frames']:>7} {lat:>7} "
              f"{r['wrong']:>6}")
    print("pay/cyc* = payload beats per cycle excluding header-only beats; latency in cycles "
          "(parser: first frame beat in -> first payload beat out, store-and-forward; "
          "builder: header record in -> first frame beat out)")
    result = {
        "bench": "net_throughput",
        "command": " ".join([f"bench/{Path(sys.argv[0]).name}",
                             *(argv if argv is not None else sys.argv[1:])]),
        "git_rev": git_rev(),
        "machine": f"{platform.node()} {platform.machine()} {platform.processor()}".strip(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "simulator": "verilator (cocotb, GPI clock, HDL traffic generators)",
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 1 if any(r["wrong"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
