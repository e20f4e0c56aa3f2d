"""cocotb bench of :class:`fpgaccl.hw.net.parser.RoceParser`.

Frames built with scapy (seeded random headers and payloads, plus mutations for every
drop reason) go in with random idle cycles; the header record and the realigned payload
come out under random back-pressure and are compared field for field and byte for byte
with :func:`fpgaccl.proto.parse_frame`, which is the reference model; the drop counters
must equal the reference's count per reason.
"""

from __future__ import annotations

import random
from collections import Counter

import cocotb
from cocotb.clock import Clock
from cocotb.triggers import ClockCycles, RisingEdge, with_timeout

from fpgaccl.hw.net.parser import PARSER_DROPS
from fpgaccl.proto import DropReason, Frame
from fpgaccl.proto.drops import DROP_COUNTER_BITS
from fpgaccl.sim import bench_params
from fpgaccl.sim.models.stream import StreamSink, StreamSource
from fpgaccl.sim.tb.net_frames import bad_frame, expect, good_frame, record_fields


class RecordSink:
    """Takes header records, stalling at random."""

    def __init__(self, dut, prefix: str, clk, *, stall_prob: float, rng: random.Random):
        self.payload = getattr(dut, f"{prefix}__payload")
        self.valid = getattr(dut, f"{prefix}__valid")
        self.ready = getattr(dut, f"{prefix}__ready")
        self.clk, self.stall_prob, self.rng = clk, stall_prob, rng
        self.ready.value = 0

    async def recv(self) -> dict:
        while True:
            self.ready.value = int(not (self.stall_prob and self.rng.random() < self.stall_prob))
            await RisingEdge(self.clk)
            if self.ready.value and self.valid.value:
                self.ready.value = 0
                return record_fields(int(self.payload.value))


class TB:
    def __init__(self, dut, *, idle: float, stall: float, seed: int) -> None:
        self.dut = dut
        params = bench_params()
        self.width = params["width"]
        # Port names: the parser alone (i/hdr/o) or inside NetPort (rx/rx_hdr/rx_payload).
        self.ports = ports = {"i": "i", "hdr": "hdr", "o": "o", **params.get("ports", {})}
        self.rng = random.Random(seed)
        Clock(dut.clk, 4, unit="ns").start()
        self.source = StreamSource(dut, ports["i"], dut.clk, self.width, idle_prob=idle,
                                   rng=random.Random(self.rng.random()))
        self.sink = StreamSink(dut, ports["o"], dut.clk, self.width, stall_prob=stall,
                               rng=random.Random(self.rng.random()))
        self.hdr = RecordSink(dut, ports["hdr"], dut.clk, stall_prob=stall,
                              rng=random.Random(self.rng.random()))

    async def reset(self) -> None:
        self.dut.rst.value = 1
        await ClockCycles(self.dut.clk, 3)
        self.dut.rst.value = 0
        await ClockCycles(self.dut.clk, 1)

    def counters(self) -> dict[int, int]:
        word = int(self.dut.drops.value)
        mask = (1 << DROP_COUNTER_BITS) - 1
        return {int(r): (word >> (DROP_COUNTER_BITS * int(r))) & mask for r in PARSER_DROPS}

    async def run(self, frames: list[bytes]) -> Counter:
        """Send ``frames``, check every output against the reference, return drops."""
        want = [expect(f) for f in frames]
        good: list[Frame] = [w for w in want if isinstance(w, Frame)]
        drops = Counter(w for w in want if isinstance(w, DropReason))

        async def produce():
            for f in frames:
                await self.source.send(f)

        async def check_headers():
            for n, w in enumerate(good):
                got = await self.hdr.recv()
                for key in ("eth", "ip", "udp", "bth"):
                    ref = getattr(w, key)
                    assert got[key] == ref, f"frame {n} {key}: {got[key]} != {ref}"
                for key in ("reth", "aeth", "immdt"):
                    ref = getattr(w, key)
                    assert got[f"has_{key}"] == int(ref is not None), f"frame {n} has_{key}"
                    if ref is not None:
                        assert got[key] == ref, f"frame {n} {key}: {got[key]} != {ref}"
                assert got["payload_len"] == len(w.payload), f"frame {n} payload_len"

        async def check_payloads():
            for n, w in enumerate(x for x in good if x.payload):
                got = await self.sink.recv()
                assert got == w.payload, f"payload {n}: {got.hex()} != {w.payload.hex()}"

        cocotb.start_soon(produce())
        hdr_task = cocotb.start_soon(check_headers())
        pay_task = cocotb.start_soon(check_payloads())
        cycles = 50 + sum(len(f) for f in frames) * 6 // (self.width // 8) + 20 * len(frames)
        await with_timeout(hdr_task, cycles * 4, "ns")
        await with_timeout(pay_task, cycles * 4, "ns")
        await ClockCycles(self.dut.clk, 10)
        # Nothing more may come out: no payload or header of a dropped frame.
        assert not self.hdr.valid.value, "unexpected header record"
        assert not self.sink.valid.value, "unexpected payload beat"
        got = self.counters()
        for r in PARSER_DROPS:
            assert got[int(r)] == drops[r], f"{r.name}: counted {got[int(r)]}, want {drops[r]}"
        assert int(self.dut.accepted.value) == len(good)
        return drops


@cocotb.test()
@cocotb.parametrize(idle=[0.0, 0.3], stall=[0.0, 0.4])
async def random_frames_and_every_drop(dut, idle: float, stall: float) -> None:
    tb = TB(dut, idle=idle, stall=stall, seed=int(idle * 10 + stall * 100) + 1)
    await tb.reset()
    rng = tb.rng
    frames = []
    for _ in range(40):
        frames.append(good_frame(rng)[0])
    for r in PARSER_DROPS:
        frames += [bad_frame(rng, r) for _ in range(2)]
    rng.shuffle(frames)
    drops = await tb.run(frames)
    missing = [r.name for r in PARSER_DROPS if not drops[r]]
    assert not missing, f"drop reasons not exercised: {missing}"


@cocotb.test()
async def back_to_back_full_rate(dut) -> None:
    """No idle, no stall: the input never waits, including 4 KiB payload frames."""
    tb = TB(dut, idle=0.0, stall=0.0, seed=11)
    await tb.reset()
    rng = tb.rng
    frames = [good_frame(rng, max_payload=4096)[0] for _ in range(6)]
    frames += [good_frame(rng)[0] for _ in range(6)]
    nbytes = tb.width // 8
    beats = sum(-(-len(f) // nbytes) for f in frames)
    stalls = 0

    async def count_stalls():
        nonlocal stalls
        while True:
            await RisingEdge(dut.clk)
            if tb.source.valid.value and not tb.source.ready.value:
                stalls += 1

    cocotb.start_soon(count_stalls())
    await tb.run(frames)
    assert stalls == 0, f"input stalled {stalls} cycles over {beats} beats"
