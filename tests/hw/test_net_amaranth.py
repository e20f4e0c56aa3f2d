"""Builder and parser on Amaranth's own simulator (fast, no Verilator): a few frames
through the builder must equal proto.build_frame, and through the parser must give back
the record and payload; a corrupted frame is dropped and counted."""

import random

import pytest
from amaranth.sim import Simulator

from fpgaccl import proto
from fpgaccl.hw.net.builder import RoceBuilder
from fpgaccl.hw.net.parser import PARSER_DROPS, RoceParser
from fpgaccl.hw.stream.beat import beat_layout
from fpgaccl.proto import DropReason
from fpgaccl.sim.models.stream import beats_to_frame, frame_to_beats, pack, unpack
from fpgaccl.sim.tb.net_frames import random_fields, record_fields, record_word

WIDTH = 64


async def send(ctx, port, items):
    for item in items:
        ctx.set(port.payload.as_value(), item if isinstance(item, int)
                else pack(beat_layout(WIDTH), item))
        ctx.set(port.valid, 1)
        while True:
            ready = ctx.get(port.ready)
            await ctx.tick()
            if ready:
                break
    ctx.set(port.valid, 0)


async def collect(ctx, port, out, until, stall=None):
    """Take beats until ``until()``; ``stall`` (a random.Random) drops ready at random."""
    while not until():
        ready = 1 if stall is None else int(stall.random() < 0.4)
        ctx.set(port.ready, ready)
        valid = ctx.get(port.valid)
        payload = ctx.get(port.payload.as_value())
        await ctx.tick()
        if valid and ready:
            out.append(payload)


def split_frames(beats):
    frames, cur = [], []
    for b in (unpack(beat_layout(WIDTH), w) for w in beats):
        cur.append(b)
        if b["last"]:
            frames.append(beats_to_frame(cur, WIDTH))
            cur = []
    return frames


@pytest.fixture(scope="module")
def packets():
    rng = random.Random(4)
    out = []
    for op in (proto.Opcode.RDMA_WRITE_ONLY_WITH_IMMEDIATE, proto.Opcode.ACKNOWLEDGE,
               proto.Opcode.SEND_MIDDLE):
        fields = random_fields(rng, int(op))
        payload = bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 40)))
        if op == proto.Opcode.ACKNOWLEDGE:
            payload = b""
        out.append((fields, payload, proto.build_frame(payload=payload, **fields)))
    return out


@pytest.mark.parametrize("stall", [False, True], ids=["ready", "stalled"])
def test_builder_on_amaranth_simulator(packets, stall):
    # Stalled: the output FIFO fills and its room, not the input, paces the pipeline.
    dut = RoceBuilder(WIDTH)
    sim = Simulator(dut)
    sim.add_clock(1e-8)
    got = []
    want = [f for _, _, f in packets]

    async def headers(ctx):
        await send(ctx, dut.hdr, [record_word(f, len(p)) for f, p, _ in packets])

    async def payloads(ctx):
        await send(ctx, dut.i, [b for _, p, _ in packets if p for b in frame_to_beats(p, WIDTH)])

    async def sink(ctx):
        await collect(ctx, dut.o, got, lambda: len(split_frames(got)) == len(want),
                      random.Random(9) if stall else None)

    sim.add_testbench(headers, background=True)
    sim.add_testbench(payloads, background=True)
    sim.add_testbench(sink)
    sim.run_until(1e-8 * (2000 if stall else 400))
    assert split_frames(got) == want


def test_parser_on_amaranth_simulator(packets):
    dut = RoceParser(WIDTH, max_payload=256)
    sim = Simulator(dut)
    sim.add_clock(1e-8)
    bad = bytearray(packets[0][2])
    bad[60] ^= 0x10  # payload/RETH bit: ICRC mismatch
    frames = [packets[0][2], bytes(bad), packets[1][2], packets[2][2]]
    good = [packets[0], packets[1], packets[2]]
    recs, beats = [], []

    async def source(ctx):
        await send(ctx, dut.i, [b for f in frames for b in frame_to_beats(f, WIDTH)])

    async def hdr_sink(ctx):
        await collect(ctx, dut.hdr, recs, lambda: len(recs) == len(good))
        await ctx.tick().repeat(5)
        assert ctx.get(dut.drops[DropReason.BAD_ICRC]) == 1
        assert ctx.get(dut.accepted) == 3

    async def pay_sink(ctx):
        await collect(ctx, dut.o, beats,
                      lambda: len(split_frames(beats)) == sum(1 for _, p, _ in good if p))

    sim.add_testbench(source, background=True)
    sim.add_testbench(pay_sink, background=True)
    sim.add_testbench(hdr_sink)
    sim.run_until(1e-8 * 400)
    assert len(recs) == 3
    for (fields, payload, _), rec in zip(good, recs, strict=True):
        got = record_fields(rec)
        for key, vals in fields.items():
            for name, v in vals.items():
                assert got[key][name] == v, (key, name)
        assert got["payload_len"] == len(payload)
    assert split_frames(beats) == [p for _, p, _ in good if p]


def test_parser_drops_frames_larger_than_its_buffer(packets):
    """A frame that cannot fit the store-and-forward FIFO is dropped (``oversize``), and
    the parser neither deadlocks nor leaks any of it; the next frame passes."""
    dut = RoceParser(WIDTH, max_payload=64)
    big = proto.build_frame(bth={"opcode": int(proto.Opcode.SEND_MIDDLE)}, payload=bytes(1000))
    assert len(big) // (WIDTH // 8) > dut.depth
    fields, payload, small = packets[2]
    sim = Simulator(dut)
    sim.add_clock(1e-8)
    recs, beats = [], []

    async def source(ctx):
        await send(ctx, dut.i, [b for f in (big, small) for b in frame_to_beats(f, WIDTH)])

    async def hdr_sink(ctx):
        await collect(ctx, dut.hdr, recs, lambda: len(recs) == 1)
        await ctx.tick().repeat(10)
        assert ctx.get(dut.oversize) == 1
        assert ctx.get(dut.accepted) == 1

    async def pay_sink(ctx):
        await collect(ctx, dut.o, beats, lambda: False)

    sim.add_testbench(source, background=True)
    sim.add_testbench(pay_sink, background=True)
    sim.add_testbench(hdr_sink)
    sim.run_until(1e-8 * 600)
    assert record_fields(recs[0])["bth"]["psn"] == fields["bth"]["psn"]
    assert split_frames(beats) == [payload]


def test_parser_ignores_nonzero_ethernet_padding():
    """Bytes past the IP length are Ethernet padding, whatever their value: the ICRC
    covers the region only, so the byte mask of the beat where it ends (and the beats
    after) must drop them. Zero padding would pass even without the mask; 0xA5 does
    not. Payloads of 1..40 bytes move the region's end through the beat, and through
    the beats after the one carrying the IP length."""
    rng = random.Random(7)
    frames = []
    for n in range(1, 41):
        fields = random_fields(rng, int(proto.Opcode.RDMA_WRITE_ONLY_WITH_IMMEDIATE))
        payload = bytes(rng.getrandbits(8) for _ in range(n))
        frames.append(proto.build_frame(payload=payload, **fields)
                      + b"\xa5" * rng.randint(1, 2 * WIDTH // 8))
    dut = RoceParser(WIDTH, max_payload=64)
    sim = Simulator(dut)
    sim.add_clock(1e-8)
    recs, beats = [], []

    async def source(ctx):
        await send(ctx, dut.i, [b for f in frames for b in frame_to_beats(f, WIDTH)])

    counts = {}

    async def hdr_sink(ctx):
        await collect(ctx, dut.hdr, recs, lambda: False)

    async def pay_sink(ctx):
        await collect(ctx, dut.o, beats, lambda: False)

    async def counters(ctx):
        await ctx.tick().repeat(3000)
        counts["accepted"] = ctx.get(dut.accepted)
        counts["drops"] = {r.name: v for r in PARSER_DROPS if (v := ctx.get(dut.drops[r]))}

    sim.add_testbench(source, background=True)
    sim.add_testbench(pay_sink, background=True)
    sim.add_testbench(hdr_sink, background=True)
    sim.add_testbench(counters)
    sim.run()
    assert counts == {"accepted": len(frames), "drops": {}}
    assert len(recs) == len(frames)


@pytest.mark.parametrize("width", [128, 256])
def test_builder_to_parser_loopback_other_widths(width):
    """The widths the Verilator benches skip: frames the builder makes (checked against
    proto) go straight into the parser and come back as the same record and payload."""
    from amaranth.hdl import Module
    from amaranth.lib import wiring

    rng = random.Random(width)
    pkts = []
    for op in (proto.Opcode.RDMA_WRITE_FIRST, proto.Opcode.SEND_LAST_WITH_IMMEDIATE,
               proto.Opcode.ACKNOWLEDGE, proto.Opcode.RDMA_WRITE_MIDDLE):
        fields = random_fields(rng, int(op))
        n = 0 if op == proto.Opcode.ACKNOWLEDGE else rng.randint(1, 3 * width // 8)
        pkts.append((fields, bytes(rng.getrandbits(8) for _ in range(n))))
    m = Module()
    m.submodules.b = b = RoceBuilder(width)
    m.submodules.p = p = RoceParser(width, max_payload=256)
    wiring.connect(m, b.o, p.i)
    sim = Simulator(m)
    sim.add_clock(1e-8)
    recs, beats = [], []
    layout = beat_layout(width)

    async def headers(ctx):
        await send(ctx, b.hdr, [record_word(f, len(pl)) for f, pl in pkts])

    async def payloads(ctx):
        beats_in = [pack(layout, x) for _, pl in pkts if pl for x in frame_to_beats(pl, width)]
        await send(ctx, b.i, beats_in)

    async def pay_sink(ctx):
        await collect(ctx, p.o, beats, lambda: False)

    async def hdr_sink(ctx):
        await collect(ctx, p.hdr, recs, lambda: len(recs) == len(pkts))
        await ctx.tick().repeat(8)

    sim.add_testbench(headers, background=True)
    sim.add_testbench(payloads, background=True)
    sim.add_testbench(pay_sink, background=True)
    sim.add_testbench(hdr_sink)
    sim.run_until(1e-8 * 400)
    assert len(recs) == len(pkts)
    for (fields, pl), rec in zip(pkts, recs, strict=True):
        got = record_fields(rec)
        for key, vals in fields.items():
            for name, v in vals.items():
                assert got[key][name] == v, (key, name)
        assert got["payload_len"] == len(pl)
    frames, cur = [], []
    for w in beats:
        cur.append(unpack(layout, w))
        if cur[-1]["last"]:
            frames.append(beats_to_frame(cur, width))
            cur = []
    assert frames == [pl for _, pl in pkts if pl]


def test_parser_keeps_every_header_while_its_reader_stalls(packets):
    """Back-to-back ACK frames (header only) while nothing reads the header stream: the
    parser must stop taking input before its header FIFO overflows, never drop a
    header, and hand over all of them, in order, once the reader starts."""
    dut = RoceParser(WIDTH, max_payload=256, hdr_depth=8)
    sim = Simulator(dut)
    sim.add_clock(1e-8)
    ack_fields = packets[1][0]
    frames = []
    for i in range(24):
        fields = {k: dict(v) for k, v in ack_fields.items()}
        fields["bth"]["psn"] = i
        frames.append(proto.build_frame(payload=b"", **fields))
    recs = []

    async def source(ctx):
        await send(ctx, dut.i, [b for f in frames for b in frame_to_beats(f, WIDTH)])

    async def hdr_sink(ctx):
        ctx.set(dut.hdr.ready, 0)
        await ctx.tick().repeat(600)  # long enough for the input to back up
        assert ctx.get(dut.accepted) < len(frames)
        await collect(ctx, dut.hdr, recs, lambda: len(recs) == len(frames))

    sim.add_testbench(source, background=True)
    sim.add_testbench(hdr_sink)
    sim.run_until(1e-8 * 3000)
    assert [record_fields(r)["bth"]["psn"] for r in recs] == list(range(len(frames)))
