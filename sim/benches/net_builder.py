"""cocotb bench of :class:`fpgaccl.hw.net.builder.RoceBuilder`.

Seeded random headers (every supported opcode) and payloads go in as a header record
plus a payload stream, each with random idle cycles; the frames that come out under
random back-pressure must equal, byte for byte, the frame scapy builds from the same
fields (BTH pad and ICRC included) and the one :func:`fpgaccl.proto.build_frame` builds.
"""

from __future__ import annotations

import random

import cocotb
from cocotb.clock import Clock
from cocotb.triggers import ClockCycles, RisingEdge, with_timeout

from fpgaccl import proto
from fpgaccl.sim import bench_params
from fpgaccl.sim.models.stream import StreamSink, StreamSource, frame_to_beats
from fpgaccl.sim.tb.net_frames import random_fields, record_word, scapy_frame


class RecordSource:
    def __init__(self, dut, prefix: str, clk, *, idle_prob: float, rng: random.Random):
        self.payload = getattr(dut, f"{prefix}__payload")
        self.valid = getattr(dut, f"{prefix}__valid")
        self.ready = getattr(dut, f"{prefix}__ready")
        self.clk, self.idle_prob, self.rng = clk, idle_prob, rng
        self.valid.value = 0

    async def send(self, word: int) -> None:
        while self.idle_prob and self.rng.random() < self.idle_prob:
            self.valid.value = 0
            await RisingEdge(self.clk)
        self.payload.value = word
        self.valid.value = 1
        while True:
            await RisingEdge(self.clk)
            if self.ready.value:
                break
        self.valid.value = 0


class TB:
    def __init__(self, dut, *, idle: float, stall: float, seed: int) -> None:
        self.dut = dut
        params = bench_params()
        self.width = params["width"]
        # Port names: the builder alone (hdr/i/o) or inside NetPort (tx_hdr/tx_payload/tx).
        ports = {"hdr": "hdr", "i": "i", "o": "o", **params.get("ports", {})}
        self.rng = random.Random(seed)
        Clock(dut.clk, 4, unit="ns").start()
        self.hdr = RecordSource(dut, ports["hdr"], dut.clk, idle_prob=idle,
                                rng=random.Random(self.rng.random()))
        self.source = StreamSource(dut, ports["i"], dut.clk, self.width, idle_prob=idle,
                                   rng=random.Random(self.rng.random()))
        self.sink = StreamSink(dut, ports["o"], dut.clk, self.width, stall_prob=stall,
                               rng=random.Random(self.rng.random()))

    async def reset(self) -> None:
        self.dut.rst.value = 1
        await ClockCycles(self.dut.clk, 3)
        self.dut.rst.value = 0
        await ClockCycles(self.dut.clk, 1)

    def packet(self, max_payload: int, opcode: int | None = None) -> tuple[int, bytes, bytes]:
        rng = self.rng
        fields = random_fields(rng, opcode)
        n = rng.choice([0, rng.randint(1, 9), rng.randint(1, max_payload), max_payload])
        payload = bytes(rng.getrandbits(8) for _ in range(n))
        want = scapy_frame(fields, payload)
        ref = proto.build_frame(payload=payload, **{k: v for k, v in fields.items()})
        assert want == ref, "scapy and proto.build_frame disagree"
        return record_word(fields, len(payload)), payload, want

    async def run(self, packets: list[tuple[int, bytes, bytes]]) -> None:
        async def send_headers():
            for word, _, _ in packets:
                await self.hdr.send(word)

        async def send_payloads():
            for _, payload, _ in packets:
                if payload:
                    await self.source.send_beats(frame_to_beats(payload, self.width))

        async def check():
            for n, (_, _, want) in enumerate(packets):
                got = await self.sink.recv()
                assert got == want, f"frame {n}:\n got {got.hex()}\nwant {want.hex()}"

        cocotb.start_soon(send_headers())
        cocotb.start_soon(send_payloads())
        total = sum(len(w) for _, _, w in packets)
        cycles = 100 + total * 6 // (self.width // 8) + 20 * len(packets)
        await with_timeout(cocotb.start_soon(check()), cycles * 4, "ns")
        await ClockCycles(self.dut.clk, 5)
        assert not self.sink.valid.value, "unexpected output beat"


@cocotb.test()
@cocotb.parametrize(idle=[0.0, 0.3], stall=[0.0, 0.4])
async def random_frames_match_scapy(dut, idle: float, stall: float) -> None:
    tb = TB(dut, idle=idle, stall=stall, seed=int(idle * 10 + stall * 100) + 5)
    await tb.reset()
    packets = [tb.packet(300, op) for op in sorted(proto.Opcode)]
    packets += [tb.packet(300) for _ in range(30)]
    tb.rng.shuffle(packets)
    await tb.run(packets)


@cocotb.test()
async def back_to_back_full_rate(dut) -> None:
    """Max-size frames with no idle and no stall leave at one beat per cycle."""
    tb = TB(dut, idle=0.0, stall=0.0, seed=9)
    await tb.reset()
    packets = [tb.packet(4096, int(proto.Opcode.RDMA_WRITE_MIDDLE)) for _ in range(4)]
    packets = [p for p in packets if len(p[1]) > 1000] or packets
    beats = 0
    span = [None, None]

    async def watch():
        nonlocal beats
        cycle = 0
        while True:
            await RisingEdge(dut.clk)
            cycle += 1
            if tb.sink.valid.value and tb.sink.ready.value:
                beats += 1
                span[0] = cycle if span[0] is None else span[0]
                span[1] = cycle

    cocotb.start_soon(watch())
    await tb.run(packets)
    want = sum(-(-len(w) // (tb.width // 8)) for _, _, w in packets)
    assert beats == want
    assert span[1] - span[0] + 1 == beats, f"{beats} beats over {span[1] - span[0] + 1} cycles"
