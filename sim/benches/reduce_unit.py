"""cocotb bench of :class:`fpgaccl.hw.reduce.unit.ReduceUnit`: every supported dtype x op
with random operands (NaN/inf/subnormal/signed-zero edge cases included), random idles
on both inputs and random back-pressure on the output, checked bit for bit (NaN
payloads included) against :func:`fpgaccl.proto.reduce.reduce_reference`."""

from __future__ import annotations

import random

import cocotb
import numpy as np
from cocotb.clock import Clock
from cocotb.triggers import ClockCycles, RisingEdge

from fpgaccl.hw.reduce.unit import LATENCY
from fpgaccl.proto.reduce import SUPPORTED, DType, ReduceOp, reduce_bytes
from fpgaccl.sim import bench_params
from fpgaccl.sim.models.stream import StreamSink, StreamSource, pack
from fpgaccl.sim.tb.reduce_vectors import operands


class TB:
    def __init__(self, dut, *, idle: float = 0.0, stall: float = 0.0, seed: int = 0) -> None:
        self.dut = dut
        self.width = bench_params()["width"]
        self.rng = random.Random(seed)
        self.nprng = np.random.default_rng(seed)
        Clock(dut.clk, 4, unit="ns").start()
        self.src_a = StreamSource(dut, "a", dut.clk, self.width, idle_prob=idle,
                                  rng=random.Random(self.rng.random()))
        self.src_b = StreamSource(dut, "b", dut.clk, self.width, idle_prob=idle,
                                  rng=random.Random(self.rng.random()))
        self.sink = StreamSink(dut, "o", dut.clk, self.width, stall_prob=stall,
                               rng=random.Random(self.rng.random()))

    async def reset(self) -> None:
        self.dut.rst.value = 1
        await ClockCycles(self.dut.clk, 3)
        self.dut.rst.value = 0
        await ClockCycles(self.dut.clk, 1)

    def frame(self, dtype: DType, beats: int) -> tuple[bytes, bytes]:
        """Operands for ``beats`` full beats, as little-endian bytes."""
        n = beats * self.width // dtype.bits
        a, b = operands(dtype, n, self.nprng)
        return a.astype("<u" + str(dtype.bits // 8)).tobytes(), \
            b.astype("<u" + str(dtype.bits // 8)).tobytes()

    def beats(self, data: bytes) -> list[dict[str, int]]:
        nb = self.width // 8
        chunks = [data[i:i + nb] for i in range(0, len(data), nb)]
        return [{"data": int.from_bytes(c, "little"), "keep": (1 << nb) - 1,
                 "first": int(i == 0), "last": int(i == len(chunks) - 1)}
                for i, c in enumerate(chunks)]

    async def send(self, dtype: DType, op: ReduceOp, a: bytes, b: bytes) -> None:
        # The unit samples dtype/op with each beat taken; both sources finish on the
        # same handshake, so changing them here is between frames.
        self.dut.dtype.value = int(dtype)
        self.dut.op.value = int(op)
        ta = cocotb.start_soon(self.src_a.send_beats(self.beats(a)))
        tb = cocotb.start_soon(self.src_b.send_beats(self.beats(b)))
        await ta
        await tb


def _describe(dtype: DType, got: bytes, want: bytes, a: bytes, b: bytes) -> str:
    k = dtype.bits // 8
    for i in range(0, len(want), k):
        if got[i:i + k] != want[i:i + k]:
            x, y, g, w = (int.from_bytes(v[i:i + k], "little") for v in (a, b, got, want))
            return f"element {i // k}: {x:#x} , {y:#x} -> {g:#x}, want {w:#x}"
    return "framing differs"


@cocotb.test()
@cocotb.parametrize(flow=["full", "idle_stall"])
async def every_dtype_and_op(dut, flow: str) -> None:
    idle, stall = (0.0, 0.0) if flow == "full" else (0.3, 0.4)
    tb = TB(dut, idle=idle, stall=stall, seed=1 if flow == "full" else 2)
    await tb.reset()
    beats_per = max(8, 2048 // tb.width)      # keeps the element count similar per width
    cases = []
    for dtype, op in SUPPORTED:
        a, b = tb.frame(dtype, beats_per)
        cases.append((dtype, op, a, b, reduce_bytes(dtype, op, a, b)))

    async def produce():
        for dtype, op, a, b, _ in cases:
            await tb.send(dtype, op, a, b)

    cocotb.start_soon(produce())
    bad = []
    for dtype, op, a, b, want in cases:
        beats = []
        while True:
            beat = await tb.sink.recv_beat()
            beats.append(beat)
            if beat["last"]:
                break
        got = b"".join(x["data"].to_bytes(tb.width // 8, "little") for x in beats)
        if got != want or beats[0]["first"] != 1 or len(beats) != beats_per:
            bad.append(f"{dtype.name} {op.name}: {_describe(dtype, got, want, a, b)}")
    assert not bad, f"{len(bad)} of {len(cases)} cases wrong:\n" + "\n".join(bad)


@cocotb.test()
async def full_rate_and_latency(dut) -> None:
    """Unstalled, the unit takes a beat every cycle and answers LATENCY cycles later."""
    tb = TB(dut, seed=3)
    await tb.reset()
    dtype, op = DType.FLOAT32, ReduceOp.SUM
    nbeats = 64
    a, b = tb.frame(dtype, nbeats)
    want = reduce_bytes(dtype, op, a, b)
    tb.sink.ready.value = 1
    cocotb.start_soon(tb.send(dtype, op, a, b))
    cycle = 0
    first_in = first_out = last_out = None
    out = []
    while len(out) < nbeats:
        await RisingEdge(dut.clk)
        if first_in is None and dut.a__valid.value and dut.a__ready.value:
            first_in = cycle
        if dut.o__valid.value:
            first_out = cycle if first_out is None else first_out
            last_out = cycle
            out.append(int(dut.o__payload.value) & ((1 << tb.width) - 1))
        cycle += 1
    got = b"".join(x.to_bytes(tb.width // 8, "little") for x in out)
    assert got == want
    assert first_out - first_in == LATENCY, f"latency {first_out - first_in}"
    assert last_out - first_out == nbeats - 1, "output had bubbles at full rate"


@cocotb.test()
async def config_changes_every_beat(dut) -> None:
    """dtype/op travel down the pipeline with their beat: a different pair on every
    beat, under idles and back-pressure, still gives each beat its own result."""
    tb = TB(dut, stall=0.3, seed=4)
    await tb.reset()
    nb = tb.width // 8
    pairs = [tb.rng.choice(SUPPORTED) for _ in range(200)]
    beats = []
    for dtype, op in pairs:
        a, b = tb.frame(dtype, 1)
        beats.append((dtype, op, a, b, reduce_bytes(dtype, op, a, b)))

    async def produce():
        # One driver for both inputs: their ready is the same joined handshake.
        for i, (dtype, op, a, b, _) in enumerate(beats):
            while tb.rng.random() < 0.2:
                dut.a__valid.value = dut.b__valid.value = 0
                await RisingEdge(dut.clk)
            dut.dtype.value, dut.op.value = int(dtype), int(op)
            for port, data in (("a", a), ("b", b)):
                getattr(dut, f"{port}__payload").value = pack(tb.src_a.layout, {
                    "data": int.from_bytes(data, "little"), "keep": (1 << nb) - 1,
                    "first": int(i == 0), "last": int(i == len(beats) - 1)})
                getattr(dut, f"{port}__valid").value = 1
            while True:
                await RisingEdge(dut.clk)
                if dut.a__ready.value:
                    break
        dut.a__valid.value = dut.b__valid.value = 0

    cocotb.start_soon(produce())
    for i, (dtype, op, a, b, want) in enumerate(beats):
        beat = await tb.sink.recv_beat()
        got = beat["data"].to_bytes(nb, "little")
        assert got == want, f"beat {i} {dtype.name} {op.name}: {_describe(dtype, got, want, a, b)}"
