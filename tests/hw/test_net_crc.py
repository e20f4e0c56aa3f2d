"""The parallel CRC-32 matrices, the un-zero trick, the ICRC masking and the commit FIFO,
on Python models and on Amaranth's simulator."""

import random

import pytest
from amaranth.hdl import Module, Signal
from amaranth.sim import Simulator
from hypothesis import given, settings
from hypothesis import strategies as st

from fpgaccl import proto
from fpgaccl.hw.net import crc
from fpgaccl.hw.stream.commit_fifo import CommitFIFO
from fpgaccl.proto.icrc import VARIANT_MASK


@settings(max_examples=60, deadline=None)
@given(state=st.integers(0, 2**32 - 1), data=st.binary(min_size=1, max_size=64))
def test_matrix_equals_bitwise_crc(state, data):
    assert crc.apply_update(state, data) == crc.raw_update(state, data)


@settings(max_examples=60, deadline=None)
@given(state=st.integers(0, 2**32 - 1), data=st.binary(min_size=0, max_size=40),
       z=st.integers(0, 63))
def test_unzero_undoes_trailing_zero_bytes(state, data, z):
    padded = crc.raw_update(state, data + bytes(z))
    assert crc.apply_columns(crc.unzero_columns(z), padded) == crc.raw_update(state, data)


def test_zero_init_stream_gives_icrc_and_residue():
    frame = proto.build_frame(bth={"opcode": 0x0A, "dqpn": 3, "psn": 9},
                              reth={"va": 1, "rkey": 2, "dlen": 3}, payload=b"xyz" * 7)
    tx = crc.raw_update(0, crc.icrc_stream_bytes(frame, len(frame) - 4)) ^ 0xFFFFFFFF
    assert tx.to_bytes(4, "little") == frame[-4:]
    assert crc.raw_update(0, crc.icrc_stream_bytes(frame, len(frame))) == crc.RESIDUE
    assert crc.RESIDUE == 0xFFFFFFFF ^ 0x2144DF1C  # the well-known CRC-32 residue


def test_beat_masks_cover_the_variant_fields():
    masks = crc.icrc_beat_masks(8)
    flat_or = b"".join(o.to_bytes(8, "little") for _, o in masks)
    assert flat_or[crc.ETH.size:crc.ICRC_MASK_END] == VARIANT_MASK
    assert flat_or[crc.LRH_ZERO:crc.ETH.size] == b"\xff" * 4


@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("nbytes", [8, 64])
def test_crc_circuit_on_amaranth_simulator(nbytes, group):
    state, data, z = Signal(32), Signal(8 * nbytes), Signal(nbytes.bit_length() - 1)
    m = Module()
    upd = Signal(32)
    m.d.comb += upd.eq(crc.crc_update(state, data))
    fin = crc.crc_unzero(m, upd, z, group=group)
    rng = random.Random(nbytes + group)

    async def bench(ctx):
        for _ in range(20):
            s = rng.getrandbits(32)
            keep = rng.randint(1, nbytes)
            d = bytes(rng.getrandbits(8) for _ in range(keep))
            ctx.set(state, s)
            ctx.set(data, int.from_bytes(d, "little"))
            ctx.set(z, nbytes - keep)
            assert ctx.get(upd) == crc.raw_update(s, d + bytes(nbytes - keep))
            assert ctx.get(fin) == crc.raw_update(s, d)

    sim = Simulator(m)
    sim.add_testbench(bench)
    sim.run()


def test_commit_fifo_rewinds_and_commits():
    dut = CommitFIFO(64, 8)
    sim = Simulator(dut)
    sim.add_clock(1e-6)

    async def write(ctx, value, *, commit=False, rewind=False):
        ctx.set(dut.w_en, 1)
        ctx.set(dut.w_data, {"data": value, "keep": 0xFF, "first": 0, "last": int(commit)})
        ctx.set(dut.commit, commit)
        ctx.set(dut.rewind, rewind)
        await ctx.tick()
        ctx.set(dut.w_en, 0)
        ctx.set(dut.commit, 0)
        ctx.set(dut.rewind, 0)

    async def bench(ctx):
        ctx.set(dut.o.ready, 1)
        await write(ctx, 1)
        await write(ctx, 2, rewind=True)  # drops 1 and 2
        await ctx.tick().repeat(3)
        assert not ctx.get(dut.o.valid)
        await write(ctx, 3)
        await write(ctx, 4, commit=True)
        got = []
        for _ in range(6):
            if ctx.get(dut.o.valid):
                got.append(ctx.get(dut.o.payload.data))
            await ctx.tick()
        assert got == [3, 4]
        assert ctx.get(dut.space) == 8 and ctx.get(dut.pending) == 0

    sim.add_testbench(bench)
    sim.run()


def test_commit_fifo_registered_space_and_pending():
    """``space_r`` (a register) is ``space`` as of the previous cycle's reads: equal,
    except one less the cycle after a read; ``pending`` (a register) counts the writes
    since the last commit or rewind (one written with a commit counts, one written with
    a rewind does not). Random writes, commits, rewinds and reader stalls."""
    import random
    dut = CommitFIFO(64, 8)
    sim = Simulator(dut)
    sim.add_clock(1e-6)
    rng = random.Random(3)

    async def bench(ctx):
        pending, prev, seen = 0, None, 0
        for n in range(600):
            space, space_r = ctx.get(dut.space), ctx.get(dut.space_r)
            valid = ctx.get(dut.o.valid)
            if prev is not None:
                was_valid, was_ready = prev
                read = valid and (not was_valid or was_ready)
                assert space_r == space - int(read), n
                seen += read
            assert ctx.get(dut.pending) == pending, n
            w = int(space >= 2 and rng.random() < 0.6)
            commit = int(rng.random() < 0.2)
            rewind = int(not commit and rng.random() < 0.08)
            ready = int(rng.random() < 0.5)
            ctx.set(dut.w_en, w)
            ctx.set(dut.w_data, {"data": n, "keep": 0xFF, "first": 0, "last": commit})
            ctx.set(dut.commit, commit)
            ctx.set(dut.rewind, rewind)
            ctx.set(dut.o.ready, ready)
            prev = (valid, ready)
            pending = 0 if commit or rewind else pending + w
            await ctx.tick()
        assert seen > 50

    sim.add_testbench(bench)
    sim.run()
