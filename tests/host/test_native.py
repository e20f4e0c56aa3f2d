"""host/native.py and fastpath.c: the build, the fallback, and the batched socket calls.

The C loops' packet bytes and checks are compared with their Python twins in
test_transport.py (sealed rows, coalesced receive, GSO runs with kernel drops)."""

from __future__ import annotations

import ctypes
import socket
import time

import numpy as np
import pytest

from fpgaccl.host import native
from fpgaccl.host.engine import Engine


@pytest.fixture
def fresh(monkeypatch):
    """native.load() as if first called in this process (restored afterwards)."""
    monkeypatch.setattr(native, "_tried", False)
    monkeypatch.setattr(native, "_lib", None)
    monkeypatch.setattr(native, "reason", "not loaded yet")
    return monkeypatch


def test_builds_into_the_cache_and_loads(fresh, tmp_path) -> None:
    fresh.setenv("FPGACCL_CACHE", str(tmp_path))
    fp = native.load()
    assert fp is not None, native.reason
    assert native.reason.startswith("loaded")
    assert [p.suffix for p in tmp_path.iterdir()] == [".so"]  # no temporary left behind
    assert native.load() is fp  # built once per process


def test_no_compiler_means_the_python_path(fresh, tmp_path) -> None:
    fresh.setenv("FPGACCL_CACHE", str(tmp_path))
    fresh.setenv("CC", "")
    fresh.setenv("PATH", str(tmp_path))  # neither gcc nor cc
    assert native.load() is None
    assert "no C compiler" in native.reason
    eng = Engine(0, "127.77.20.1")
    try:
        assert eng.fastpath is None and not eng._native_tx
    finally:
        eng.sock.close()


def test_turned_off_by_the_environment(fresh) -> None:
    fresh.setenv("FPGACCL_NATIVE", "0")
    assert native.load() is None and "FPGACCL_NATIVE=0" in native.reason


@pytest.mark.parametrize("per", [1, 7], ids=["datagrams", "gso-runs"])
def test_send_rows_and_recv_batch_carry_every_datagram(per: int) -> None:
    fp = native.load()
    if fp is None:
        pytest.skip(f"no C fast path: {native.reason}")
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        tx.bind(("127.77.21.1", 0))
        rx.bind(("127.77.21.2", 0))
        rx.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        if per > 1:
            try:
                rx.setsockopt(17, 104, 1)  # UDP_GRO: runs arrive coalesced
            except OSError:
                pytest.skip("this kernel has no UDP GRO")
        k, seg = 150, 1000  # more than one sendmmsg batch of 64 messages when per == 1
        rows = np.random.default_rng(per).integers(0, 256, (k, seg), np.uint8)
        sent = fp.send_rows(tx.fileno(), rows.ctypes.data, k, seg, per,
                            ctypes.byref(native.sockaddr(rx.getsockname())))
        assert sent == k
        buf = np.zeros(native.BATCH * native.SLOT_BYTES, np.uint8)
        meta = np.zeros((4, native.BATCH), np.uint32)
        got = bytearray()
        for _ in range(100):
            r = fp.recv_batch(rx.fileno(), buf.ctypes.data, native.SLOT_BYTES, native.BATCH,
                              *(int(m.ctypes.data) for m in meta))
            assert r >= 0
            for j in range(r):
                n, s, addr, port = (int(x) for x in meta[:, j])
                assert s == (seg if n > seg else n) and n % seg == 0
                assert socket.inet_ntoa(addr.to_bytes(4, "little")) == "127.77.21.1"
                assert port == tx.getsockname()[1]
                got += buf[j * native.SLOT_BYTES:j * native.SLOT_BYTES + n].tobytes()
            if len(got) >= k * seg:
                break
        assert bytes(got) == rows.tobytes()
        # Nothing waiting: 0, not an error.
        assert fp.recv_batch(rx.fileno(), buf.ctypes.data, native.SLOT_BYTES, 4,
                             *(int(m.ctypes.data) for m in meta)) == 0
    finally:
        tx.close()
        rx.close()


@pytest.mark.parametrize("shift", [0, 3, 17, 32])
def test_take_runs_lands_payloads_exactly_at_any_alignment(shift: int) -> None:
    # Full-MTU payloads are copied with streaming stores where the CPU has them: at any
    # destination alignment every taken payload lands whole, and nothing is written for
    # the packet that fails its ICRC or for any packet after it.
    from fpgaccl.host import wire
    from fpgaccl.host.qp import _MIDDLE
    fp = native.load()
    if fp is None:
        pytest.skip(f"no C fast path: {native.reason}")
    mtu, k, psn0, state = 4096, 12, (1 << 24) - 4, 0x1234ABCD
    seg = wire.BTH_LEN + mtu + wire.ICRC_LEN
    rng = np.random.default_rng(shift)
    payloads = rng.integers(0, 256, (k, mtu), np.uint8)
    rows = np.zeros((k, seg), np.uint8)
    head = wire.BTH_FMT.pack(_MIDDLE, 0, wire.PKEY, 0x101, 0)[:8]
    for i in range(k):
        rows[i, :8] = np.frombuffer(head, np.uint8)
        w2 = ((psn0 + i) & wire.PSN_MASK) | (wire.ACKREQ if i == 7 else 0)
        rows[i, 8:12] = np.frombuffer(w2.to_bytes(4, "big"), np.uint8)
        rows[i, wire.BTH_LEN:wire.BTH_LEN + mtu] = payloads[i]
        icrc = wire.crc32(rows[i, 8:seg - 4].tobytes(), state)
        rows[i, seg - 4:] = np.frombuffer(icrc.to_bytes(4, "little"), np.uint8)
    rows[9, wire.BTH_LEN + 100] ^= 1  # packet 9's ICRC no longer matches
    buf = np.zeros(2 * native.SLOT_BYTES, np.uint8)  # two GRO runs: 8 datagrams, then 4
    buf[:8 * seg] = rows[:8].reshape(-1)
    buf[native.SLOT_BYTES:native.SLOT_BYTES + 4 * seg] = rows[8:].reshape(-1)
    meta = np.array([[8 * seg, 4 * seg], [seg, seg], [7, 7], [4791, 4791]], np.uint32)
    dst = np.full(k * mtu + 64, 0xAA, np.uint8)
    ackreq, whole = ctypes.c_uint32(), ctypes.c_uint32()
    taken = fp.take_runs(buf.ctypes.data, native.SLOT_BYTES, 0, 2,
                         *(int(m.ctypes.data) for m in meta), seg, wire.BTH_LEN, psn0,
                         wire.PSN_MASK, wire.ACKREQ, state, fp.crc, dst.ctypes.data + shift,
                         100, ctypes.byref(ackreq), ctypes.byref(whole), None, 0)
    assert (taken, whole.value) == (9, 1)
    assert ackreq.value == wire.ACKREQ
    assert np.array_equal(dst[shift:shift + 9 * mtu], payloads[:9].reshape(-1))
    assert (dst[:shift] == 0xAA).all() and (dst[shift + 9 * mtu:] == 0xAA).all()


def test_wait_reports_the_readable_sockets_and_times_out_when_none_is() -> None:
    fp = native.load()
    if fp is None:
        pytest.skip(f"no C fast path: {native.reason}")
    a, b = socket.socketpair()
    c, d = socket.socketpair()
    try:
        fds = (ctypes.c_int32 * 2)(a.fileno(), c.fileno())
        t0 = time.monotonic()
        assert fp.wait(fds, 2, 100_000, 30) == 0  # a 100 us spin, then the 30 ms sleep
        assert time.monotonic() - t0 >= 0.025
        d.send(b"x")
        assert fp.wait(fds, 2, 100_000, 1000) == 0b10
        b.send(b"y")
        assert fp.wait(fds, 2, 0, 1000) == 0b11
        assert fp.wait(fds, 33, 0, 0) < 0  # more sockets than it takes: -EINVAL
    finally:
        for s in (a, b, c, d):
            s.close()
