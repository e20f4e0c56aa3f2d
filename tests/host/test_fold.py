"""host/fold.py and fastpath.c's fp_fold: reduce-on-receive gives the reference's bytes."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from fpgaccl.host import native, wire
from fpgaccl.host.fold import KINDS, Fold
from fpgaccl.proto.reduce import DType, ReduceOp, reduce_reference

from ._world import all_ok, run_world


@pytest.fixture(scope="module")
def fp() -> native.Fastpath:
    lib = native.load()
    if lib is None:
        pytest.skip(f"no C fast path: {native.reason}")
    return lib


def _specials(nt: np.dtype, rng: np.random.Generator, n: int) -> np.ndarray:
    """Random values with NaNs of several payloads (signalling ones too), infinities whose
    sum is NaN, signed zeros, subnormals and overflow."""
    if nt.kind != "f":
        info = np.iinfo(nt)
        return rng.integers(info.min, info.max, n, dtype=nt, endpoint=True)
    u = np.dtype(f"u{nt.itemsize}")
    finfo = np.finfo(nt)
    frac = finfo.nmant
    exp_all = ((1 << finfo.nexp) - 1) << frac
    nans = np.array([exp_all | (1 << (frac - 1)), exp_all | 1, exp_all | 0x5A,
                     (1 << (8 * nt.itemsize - 1)) | exp_all | 3], u).view(nt)
    pool = np.concatenate([nans, np.array([np.inf, -np.inf, 0.0, -0.0, finfo.max,
                                           -finfo.max, finfo.smallest_subnormal], nt)])
    x = rng.standard_normal(n).astype(nt)
    pick = rng.random(n) < 0.2
    x[pick] = rng.choice(pool, int(pick.sum()))
    return x


@pytest.mark.parametrize("nt", ["float32", "float64", "int32", "uint32", "int64", "uint64"])
@pytest.mark.parametrize("alias", [False, True], ids=["out", "in-place"])
def test_fold_is_the_reference_bit_for_bit(fp, nt: str, alias: bool) -> None:
    # Lengths around fp_fold's 512-element blocks and its 256-byte vector threshold; the
    # payload 4 bytes off an 8-byte boundary, as it lies after a 12-byte BTH in the
    # receive buffer; the destination one element off a 32-byte boundary (the vector
    # path's stores unaligned) or the operand itself.
    dt = np.dtype(nt)
    dtype = DType.from_numpy(dt)
    rng = np.random.default_rng(dt.itemsize + alias)
    cases = [(n, _specials(dt, rng, n), _specials(dt, rng, n))
             for n in (1, 7, 63, 64, 65, 511, 512, 513, 1024, 1500)]
    if dt.kind == "f":  # every element inf - inf: the default NaN
        cases += [(n, np.full(n, np.inf, dt), np.full(n, -np.inf, dt)) for n in (7, 100)]
    for n, a, b in cases:
        want = reduce_reference(dtype, ReduceOp.SUM, a, b)
        raw = np.zeros(n * dt.itemsize + 4, np.uint8)
        raw[4:] = b.view(np.uint8)
        x = a.copy()
        out = x if alias else np.full(n + 8, 7, dt)[1:n + 1]
        f = Fold.make(dtype, ReduceOp.SUM, x, np.empty_like(x), out)
        assert f is not None
        assert fp.fold(f.ref, 0, raw.ctypes.data + 4, n * dt.itemsize) == 0
        assert out.view(np.uint8).tobytes() == want.view(np.uint8).tobytes(), (nt, n)


def test_fold_into_a_misaligned_destination_is_still_elementwise(fp) -> None:
    # fp_fold's vector path steps from the destination's 32-byte boundary; a destination
    # off its elements' alignment goes the scalar way instead (Fold.make refuses such
    # arrays, fp_fold does not rely on it).
    raw = np.zeros(8 * 70, np.uint8)
    out = np.frombuffer(raw.data, np.float64, 64, 4)
    a = np.arange(64, dtype=np.float64)
    f = Fold(KINDS[(DType.FLOAT64, ReduceOp.SUM)], DType.FLOAT64, a, a.copy(), out)
    b = np.ones(64)
    assert fp.fold(f.ref, 0, b.ctypes.data, b.nbytes) == 0
    assert np.array_equal(out, a + 1)


def test_fold_at_an_offset_touches_only_its_elements(fp) -> None:
    a = np.arange(100, dtype=np.float32)
    out = np.full(100, -1.0, np.float32)
    f = Fold.make(DType.FLOAT32, ReduceOp.SUM, a, np.empty_like(a), out)
    b = np.full(10, 0.5, np.float32)
    fp.fold(f.ref, 40 * 4, b.ctypes.data, b.nbytes)
    assert np.array_equal(out[40:50], a[40:50] + 0.5)
    assert (out[:40] == -1).all() and (out[50:] == -1).all()


def test_only_what_fp_fold_knows_is_folded() -> None:
    x = np.zeros(64, np.float32)
    assert Fold.make(DType.FLOAT32, ReduceOp.MAX, x, x.copy(), x) is None
    assert Fold.make(DType.FLOAT16, ReduceOp.SUM, x.view(np.float16), x.view(np.float16).copy(),
                     x.view(np.float16)) is None
    assert Fold.make(DType.INT8, ReduceOp.SUM, x.view(np.int8), x.view(np.int8).copy(),
                     x.view(np.int8)) is None
    assert Fold.make(DType.FLOAT32, ReduceOp.SUM, x[::2], x[1::2].copy(), x[::2]) is None
    assert Fold.make(DType.FLOAT32, ReduceOp.SUM, x[:32], x[32:].copy(), x[1:33]) is None
    assert Fold.make(DType.FLOAT32, ReduceOp.SUM, x[:32], x[32:], x[:32]) is not None
    assert Fold.make(DType.FLOAT32, ReduceOp.SUM, x[:0], x[:0], x[:0]) is None
    # a overlapping land: the reference reads a after the message landed there.
    assert Fold.make(DType.FLOAT32, ReduceOp.SUM, x[:32], x[16:48], np.empty(32, np.float32)) \
        is None
    # Elements off their natural alignment (a float64 view 4 bytes into a buffer).
    odd = np.frombuffer(np.zeros(8 * 65, np.uint8).data, np.float64, 64, 4)
    assert not odd.flags.aligned
    y = np.zeros(64)
    assert Fold.make(DType.FLOAT64, ReduceOp.SUM, y, y.copy(), odd) is None
    assert set(KINDS) <= {(d, ReduceOp.SUM) for d in DType}


def test_take_runs_folds_checked_payloads_and_lands_nothing(fp) -> None:
    # The C receive path with a fold: each taken MIDDLE's payload is added into ``out``
    # (at its offset in the message) and the landing buffer is not written; the packet
    # that fails its ICRC and every one after it change nothing at all.
    from fpgaccl.host.qp import _MIDDLE
    mtu, k, psn0, state = 1024, 6, 77, 0x0BADCAFE
    seg = wire.BTH_LEN + mtu + wire.ICRC_LEN
    per = mtu // 4
    rng = np.random.default_rng(3)
    payloads = rng.standard_normal((k, per)).astype(np.float32)
    head = wire.BTH_FMT.pack(_MIDDLE, 0, wire.PKEY, 0x102, 0)[:8]
    rows = np.zeros((k, seg), np.uint8)
    for i in range(k):
        rows[i, :8] = np.frombuffer(head, np.uint8)
        rows[i, 8:12] = np.frombuffer((psn0 + i).to_bytes(4, "big"), np.uint8)
        rows[i, wire.BTH_LEN:wire.BTH_LEN + mtu] = payloads[i].view(np.uint8)
        icrc = wire.crc32(rows[i, 8:seg - 4].tobytes(), state)
        rows[i, seg - 4:] = np.frombuffer(icrc.to_bytes(4, "little"), np.uint8)
    rows[4, seg - 5] ^= 0x40  # packet 4's ICRC no longer matches
    buf = np.zeros(native.SLOT_BYTES, np.uint8)
    buf[:k * seg] = rows.reshape(-1)
    meta = np.array([[k * seg], [seg], [7], [4791]], np.uint32)
    a = rng.standard_normal(k * per + per).astype(np.float32)
    out = np.full_like(a, 9.0)
    land = np.full(k * mtu + mtu, 0xAA, np.uint8)
    # The message's first packet (its FIRST) lies at offset 0; these MIDDLEs follow it.
    f = Fold.make(DType.FLOAT32, ReduceOp.SUM, a, land.view(np.float32), out)
    ackreq, whole = ctypes.c_uint32(), ctypes.c_uint32()
    taken = fp.take_runs(buf.ctypes.data, native.SLOT_BYTES, 0, 1,
                         *(int(m.ctypes.data) for m in meta), seg, wire.BTH_LEN, psn0,
                         wire.PSN_MASK, wire.ACKREQ, state, fp.crc, land.ctypes.data + mtu,
                         100, ctypes.byref(ackreq), ctypes.byref(whole), f.ref, mtu)
    assert (taken, whole.value) == (4, 0)
    want = a[per:5 * per] + payloads[:4].reshape(-1)
    assert np.array_equal(out[per:5 * per], want)
    assert (out[:per] == 9).all() and (out[5 * per:] == 9).all()
    assert (land == 0xAA).all()


def _allreduce_digest(comm, *, fold: bool) -> dict:
    # A ring allreduce (8 MiB: above the halving-doubling range) of values with NaN
    # payloads and infinities, folded on receive or landed and then reduced.
    from fpgaccl.host import executor
    executor.FOLD_ON_RECEIVE = fold
    x = _specials(np.dtype(np.float32), np.random.default_rng(comm.rank), 2 << 20)
    comm.allreduce(x, algo="ring")
    return {"bytes": x.tobytes(), "folded": comm.stats().get("rx_folded", 0)}


def test_folding_on_receive_gives_the_same_bytes_as_landing() -> None:
    if native.load() is None:
        pytest.skip(f"no C fast path: {native.reason}")
    on = all_ok(run_world(4, _allreduce_digest, fold=True, timeout=180))
    off = all_ok(run_world(4, _allreduce_digest, fold=False, timeout=180))
    assert all(r["folded"] > 0 for r in on), "nothing was folded"
    assert all(r["folded"] == 0 for r in off)
    assert len({r["bytes"] for r in on + off}) == 1
