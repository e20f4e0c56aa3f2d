"""hw/compress on Amaranth's simulator: the encoder writes proto.codec's bytes and the
decoder gives back the elements, bit for bit, on random bits, real weights and gradients
and edge values, at 64 and 512 bits; under random stalls; a beat per cycle with none;
malformed input reported, not passed on."""

from __future__ import annotations

import random
from functools import cache
from pathlib import Path

import numpy as np
import pytest
from amaranth.sim import Simulator

from fpgaccl.hw.compress import BlockDecoder, BlockEncoder
from fpgaccl.proto import codec

REAL = Path(__file__).resolve().parent.parent / "data" / "codec_real.npz"


@cache
def real(kind: str, dtype: str) -> np.ndarray:
    f = codec.format_of(dtype)
    return np.load(REAL)[kind].astype(f.dtype.numpy_dtype()).view(f.uint)


def edges(dtype: str, n: int, seed: int) -> np.ndarray:
    f = codec.format_of(dtype)
    E, M = f.exp_bits, f.man_bits
    emax = (1 << E) - 1
    vals = [s | e << M | m for s in (0, 1 << (E + M)) for e in (0, 1, 100 % emax, emax - 1, emax)
            for m in (0, 1, (1 << M) - 1, 1 << (M - 1))]
    return np.random.default_rng(seed).choice(np.array(vals, np.uint64), n).astype(f.uint)


def random_bits(dtype: str, n: int, seed: int) -> np.ndarray:
    f = codec.format_of(dtype)
    return np.random.default_rng(seed).integers(0, 1 << f.bits, n, dtype=np.uint64) \
        .astype(f.uint)


def to_beats(payload: bytes, width: int) -> list[tuple[int, int, bool]]:
    wb = width // 8
    out = []
    for at in range(0, len(payload), wb):
        chunk = payload[at:at + wb]
        junk = bytes([0xA5]) * (wb - len(chunk))  # past keep: never to be used
        out.append((int.from_bytes(chunk + junk, "little"), (1 << len(chunk)) - 1,
                    at + wb >= len(payload)))
    return out


def run(dut, messages: list[tuple[list[tuple[int, int, bool]], int]], *, p_valid=1.0,
        p_ready=1.0, seed=0, limit=200_000):
    """Drive ``messages`` (beats, count) into ``dut.i`` and collect ``dut.o`` per message:
    (bytes, error flag); also the cycles of every input and output handshake."""
    rng = random.Random(seed)
    flat = [(d, k, first == 0, last, count) for beats, count in messages
            for first, (d, k, last) in enumerate(beats)]
    got: list[tuple[bytes, bool]] = []
    took_in, took_out = [], []
    counters: list[int] = []
    has_count = hasattr(dut.i.payload, "count")
    has_error = hasattr(dut.o.payload, "error")
    wb = dut.width // 8

    async def bench(ctx):
        sent, cur = 0, bytearray()
        error = False
        for cycle in range(limit):
            if len(got) == len(messages):
                if hasattr(dut, "errors"):
                    counters.append(ctx.get(dut.errors))
                return
            offer = sent < len(flat) and rng.random() < p_valid
            ctx.set(dut.i.valid, offer)
            ctx.set(dut.i.payload.data, rng.getrandbits(dut.width))  # junk unless offered
            if offer:
                d, k, first, last, count = flat[sent]
                ctx.set(dut.i.payload.data, d)
                ctx.set(dut.i.payload.keep, k)
                ctx.set(dut.i.payload.first, first)
                ctx.set(dut.i.payload.last, last)
                if has_count:
                    ctx.set(dut.i.payload.count, count)
            ready = rng.random() < p_ready
            ctx.set(dut.o.ready, ready)
            if offer and ctx.get(dut.i.ready):
                took_in.append(cycle)
                sent += 1
            if ready and ctx.get(dut.o.valid):
                took_out.append(cycle)
                keep = ctx.get(dut.o.payload.keep)
                n = bin(keep).count("1")
                assert keep == (1 << n) - 1, "keep is a prefix"
                assert ctx.get(dut.o.payload.first) == (len(cur) == 0 and not error)
                cur += ctx.get(dut.o.payload.data).to_bytes(wb, "little")[:n]
                error |= bool(has_error and ctx.get(dut.o.payload.error))
                if ctx.get(dut.o.payload.last):
                    got.append((bytes(cur), error))
                    cur, error = bytearray(), False
            await ctx.tick()
        raise AssertionError(f"not done in {limit} cycles: {len(got)} of {len(messages)}")

    sim = Simulator(dut)
    sim.add_clock(1e-8)
    sim.add_testbench(bench)
    sim.run()
    run.errors = counters[0] if counters else None
    return got, took_in, took_out


@cache
def encoder(dtype: str, width: int) -> BlockEncoder:
    return BlockEncoder(codec.format_of(dtype), width)


@cache
def decoder(dtype: str, width: int) -> BlockDecoder:
    return BlockDecoder(codec.format_of(dtype), width)


def vectors(dtype: str, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    w = real("weights", dtype)
    g = real("gradients", dtype)
    at = int(rng.integers(0, 4096 - 64 * 6))
    return [g[at:at + 64 * 5 + 7], random_bits(dtype, 64 * 2 + 63, seed),
            w[at:at + 64 * 3], edges(dtype, 64 * 2 + 1, seed), g[:1],
            np.zeros(64 * 2, codec.format_of(dtype).uint)]


CASES = [("bfloat16", 64), ("bfloat16", 512), ("float16", 512), ("float32", 512),
         ("float32", 128)]


@pytest.mark.parametrize("dtype, width", CASES)
def test_encoder_writes_the_reference_bytes(dtype, width):
    xs = vectors(dtype, width)
    msgs = [(to_beats(x.tobytes(), width), x.size) for x in xs]
    got, _, _ = run(encoder(dtype, width), msgs, p_valid=0.8, p_ready=0.7, seed=width)
    for x, (data, _) in zip(xs, got, strict=True):
        assert data == codec.encode(x.view(codec.format_of(dtype).dtype.numpy_dtype()), dtype)


@pytest.mark.parametrize("dtype, width", CASES)
def test_decoder_gives_back_the_elements(dtype, width):
    f = codec.format_of(dtype)
    xs = vectors(dtype, width + 1)
    msgs = [(to_beats(codec.encode(x.view(f.dtype.numpy_dtype()), dtype), width), x.size)
            for x in xs]
    got, _, _ = run(decoder(dtype, width), msgs, p_valid=0.8, p_ready=0.7, seed=width)
    for x, (data, error) in zip(xs, got, strict=True):
        assert not error and data == x.tobytes()


@pytest.mark.parametrize("width", [64, 512])
def test_one_beat_per_cycle_on_a_long_stream(width):
    """Real gradients, 64 blocks, no back-pressure: the encoder takes a beat every cycle
    and the decoder gives one every cycle, from first to last."""
    dtype = "bfloat16"
    f = codec.format_of(dtype)
    x = real("gradients", dtype)[:64 * 64]
    beats = to_beats(x.tobytes(), width)
    got, took_in, took_out = run(encoder(dtype, width), [(beats, x.size)])
    coded = codec.encode(x.view(f.dtype.numpy_dtype()), dtype)
    assert got[0][0] == coded
    assert took_in == list(range(took_in[0], took_in[0] + len(beats)))
    block_beats = -(-f.max_block_bytes // (width // 8))
    assert took_out[-1] - took_in[-1] <= block_beats + 3  # one block's latency: no backlog
    got, took_in, took_out = run(decoder(dtype, width), [(to_beats(coded, width), x.size)])
    assert got[0][0] == x.tobytes()
    assert took_out == list(range(took_out[0], took_out[0] + len(beats)))
    assert took_out[0] - took_in[0] <= block_beats + 3


def test_raw_blocks_cost_only_their_headers_in_cycles():
    dtype, width = "bfloat16", 512
    x = random_bits(dtype, 64 * 64, 5)
    beats = to_beats(x.tobytes(), width)
    got, took_in, took_out = run(encoder(dtype, width), [(beats, x.size)])
    assert len(got[0][0]) == 64 * 130
    cycles = took_out[-1] - took_in[0] + 1
    assert cycles <= len(beats) * 130 / 128 + 6


def test_malformed_input_is_reported_and_the_next_message_decodes():
    dtype, width = "bfloat16", 512
    f = codec.format_of(dtype)
    x = real("gradients", dtype)[:64 * 3 + 5]
    good = codec.encode(x.view(f.dtype.numpy_dtype()), dtype)
    bad_k = bytearray(good)
    bad_k[0] = 9
    over = np.full(64, 0x3F80, np.uint16)
    over[0] = 0x4000
    bad_code = bytearray(codec.encode(over.view(f.dtype.numpy_dtype()), dtype))
    bad_code[1] = 255
    msgs = [(to_beats(bytes(bad_k), width), x.size),
            (to_beats(good, width), x.size),
            (to_beats(good[:-3], width), x.size),            # short
            (to_beats(good + b"\0" * 2, width), x.size),     # too long
            (to_beats(bytes(bad_code), width), 64),
            (to_beats(good, width), x.size)]
    dut = decoder(dtype, width)
    got, _, _ = run(dut, msgs, p_valid=0.9, p_ready=0.8, seed=3)
    assert [e for _, e in got] == [True, False, True, True, True, False]
    assert got[1][0] == got[5][0] == x.tobytes()
    assert run.errors == 4
