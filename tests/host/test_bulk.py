"""fp_bulk (fastpath.c): the engine's steady state in C, and the engine handing it over.

The C loop takes a WRITE's MIDDLEs and sends a borrowed message's MIDDLEs with the same
checks and bytes as the Python loop and ``fp_take_runs``/``fp_seal_meta``; anything else
it leaves where it stopped. Here: real loopback sockets with hand-made datagrams, then
whole worlds with the loop on and off. Loss and duplication under it are in
test_netns.py (kernel drops on a veth pair: the link shims of test_transport.py turn
the C send path, and with it this loop, off).
"""

from __future__ import annotations

import ctypes
import socket
import time

import numpy as np
import pytest

from fpgaccl.host import native, wire
from fpgaccl.host.qp import _MIDDLE, _head8, _middle_state
from fpgaccl.proto.opcodes import AethKind, NakCode, aeth_syndrome

from ._world import all_ok, run_world

MTU = 1024
SEG = wire.BTH_LEN + MTU + wire.ICRC_LEN
RX_QPN, TX_QPN = 0x101, 0x102  # this side's QP, the peer's


@pytest.fixture
def fp():
    lib = native.load()
    if lib is None:
        pytest.skip(f"no C fast path: {native.reason}")
    return lib


@pytest.fixture
def pair():
    """(ours, peer): two connected-by-address loopback UDP sockets."""
    ours = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    peer = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    for s in (ours, peer):
        s.bind(("127.0.0.1", 0))
        s.setblocking(False)
    yield ours, peer
    ours.close()
    peer.close()


class _Side:
    """An engine's side of fp_bulk without the engine: the receive batch arrays and a
    Bulk with the fixed fields as Receiver.bulk_setup fills them."""

    def __init__(self, fp, ours: socket.socket, wake: socket.socket) -> None:
        self.buf = np.zeros(native.BATCH * native.SLOT_BYTES, np.uint8)
        self.meta = np.zeros((4, native.BATCH), np.uint32)
        b = self.b = native.Bulk()
        b.tx_fd, b.wake_fd, b.nfds = ours.fileno(), wake.fileno(), 1
        b.fds[0] = ours.fileno()
        b.rxbuf = self.buf.ctypes.data
        b.lens, b.segs, b.addrs, b.ports = (int(m.ctypes.data) for m in self.meta)
        b.slot, b.nslots = native.SLOT_BYTES, 32
        b.bth_len, b.psn_mask, b.ackreq_bit = wire.BTH_LEN, wire.PSN_MASK, wire.ACKREQ
        b.ack_syndrome, b.syn_shift, b.mtu = wire.ACK_SYNDROME, wire.SYNDROME_SHIFT, MTU
        b.crc = fp.crc.value
        b.yields = 1
        b.rto = 10.0


def _ip(sock: socket.socket) -> int:
    return wire.ip_to_int(sock.getsockname()[0])


def _middle(psn: int, payload: bytes, state: int, ackreq: bool = False,
            qpn: int = RX_QPN) -> bytes:
    head = wire.BTH_FMT.pack(_MIDDLE, 0, wire.PKEY, qpn, 0)[:8]
    w2 = ((psn & wire.PSN_MASK) | (wire.ACKREQ if ackreq else 0)).to_bytes(4, "big")
    return head + w2 + payload + wire.crc32(w2 + payload, state).to_bytes(4, "little")


def _drain(sock: socket.socket) -> list[bytes]:
    got = []
    end = time.monotonic() + 1.0
    while time.monotonic() < end:
        try:
            got.append(sock.recv(65536))
        except BlockingIOError:
            if got:
                break
            time.sleep(0.01)
    return got


@pytest.mark.parametrize("bad", ["icrc", "duplicate", "other-qp", "past-room"])
def test_takes_checked_middles_acks_them_and_stops_at_the_first_bad_one(fp, pair,
                                                                       bad: str) -> None:
    # Six good MIDDLEs, then one fp_bulk must leave to the Python loop (which counts
    # and drops it, or NAKs, or fails the WRITE), then a good one after it.
    ours, peer = pair
    wake_r, wake_w = socket.socketpair()
    side = _Side(fp, ours, wake_r)
    b = side.b
    pport, oport = peer.getsockname()[1], ours.getsockname()[1]
    seed = wire.icrc_seed(_ip(peer), _ip(ours), pport, oport, wire.UDP_LEN + SEG)
    state = _middle_state(seed, RX_QPN)
    psn0, k = wire.PSN_MASK - 2, 6  # across the PSN wrap
    rng = np.random.default_rng(7)
    pays = [rng.integers(0, 256, MTU, np.uint8).tobytes() for _ in range(k + 2)]
    for i in range(k):
        peer.sendto(_middle(psn0 + i, pays[i], state, ackreq=i == 3), ours.getsockname())
    odd = bytearray(_middle(psn0 + k, pays[k], state))
    if bad == "icrc":
        odd[wire.BTH_LEN + 5] ^= 1  # its ICRC no longer matches
    elif bad == "duplicate":
        odd = _middle(psn0 + k - 1, pays[k], state)  # a PSN already taken
    elif bad == "other-qp":
        odd = _middle(psn0 + k, pays[k], state, qpn=RX_QPN + 1)
    peer.sendto(bytes(odd), ours.getsockname())
    peer.sendto(_middle(psn0 + k + 1, pays[k + 1], state), ours.getsockname())
    time.sleep(0.05)

    dst = np.full((k + 3) * MTU, 0xAA, np.uint8)
    ack = wire.AckSealer(_ip(ours), _ip(peer), TX_QPN, oport, pport)
    b.rx_on, b.rx_seg, b.rx_port = 1, SEG, pport
    b.rx_addr = socket.htonl(_ip(peer))
    b.rx_head = _head8(_MIDDLE, RX_QPN)
    b.rx_state, b.epsn = state, psn0
    b.rx_dst, b.rx_room = dst.ctypes.data, k if bad == "past-room" else k + 2
    b.ack_head = (ctypes.c_uint8 * 8)(*ack.head)
    b.ack_state = ack.state
    b.aeth = (wire.ACK_SYNDROME << wire.SYNDROME_SHIFT) | 5
    b.ack_dst = native.sockaddr(peer.getsockname())
    b.deadline = time.monotonic() + 5
    stop = fp.bulk(ctypes.byref(b))

    assert stop == native.BULK_BATCH
    assert (b.j, b.part, b.r) == (k, 0, k + 2)  # the bad one, then one more for Python
    assert b.rx_taken == k and b.epsn == (psn0 + k) & wire.PSN_MASK
    assert dst[:k * MTU].tobytes() == b"".join(pays[:k])
    assert (dst[k * MTU:] == 0xAA).all()  # nothing of the odd one, nor of the one after
    # One ACK, for the AckReq on packet 3, covering all six taken (cumulative).
    assert b.acks_tx == 1
    assert _drain(peer) == [ack((psn0 + k - 1) & wire.PSN_MASK, wire.ACK_SYNDROME, 5)]
    wake_r.close()
    wake_w.close()


_NAK_SEQ = aeth_syndrome(AethKind.NAK, NakCode.PSN_SEQUENCE_ERROR)
# (MIDDLEs to send, the peer's reply queued before the call as (syndrome, PSN offset) or
# None, the PSN offset whose ACK ends a message or None) -> (why fp_bulk returns, rows
# sealed, in flight after, the ACKed PSN offset or None, ACKs taken); window 4, PSNs
# from 100.
TX_CASES = {
    "ack": (10, (wire.ACK_SYNDROME, 1), None, (native.BULK_TIMER, 6, 4, 1, 1)),
    "nak": (10, (_NAK_SEQ, 1), None, (native.BULK_BATCH, 4, 4, None, 0)),
    # A duplicate report is an ACK too, but what it names is the queue pair's to read.
    "duplicate": (10, (wire.DUPLICATE_SYNDROME, 1), None, (native.BULK_BATCH, 4, 4, None, 0)),
    # An ACK for a PSN not outstanding (nor the newest ACKed, offset -1) is Python's to
    # drop and count (ACK_PSN_INVALID); it ACKs nothing here.
    "beyond-sent": (10, (wire.ACK_SYNDROME, 50), None, (native.BULK_BATCH, 4, 4, None, 0)),
    "stale": (10, (wire.ACK_SYNDROME, -5), None, (native.BULK_BATCH, 4, 4, None, 0)),
    "repeat": (10, (wire.ACK_SYNDROME, -1), None, (native.BULK_TIMER, 4, 4, None, 1)),
    "message-end": (10, (wire.ACK_SYNDROME, 1), 1, (native.BULK_ACKED, 4, 2, 1, 1)),
    "all-sent": (3, None, None, (native.BULK_TX_DONE, 3, 3, None, 0)),
}


@pytest.mark.parametrize("case", list(TX_CASES))
def test_sends_the_window_and_takes_plain_acks_only(fp, pair, case: str) -> None:
    k, reply, notify, (want_stop, sealed, inflight, acked, acks_rx) = TX_CASES[case]
    ours, peer = pair
    wake_r, wake_w = socket.socketpair()
    side = _Side(fp, ours, wake_r)
    b = side.b
    pport, oport = peer.getsockname()[1], ours.getsockname()[1]
    window, psn0 = 4, 100
    src = np.random.default_rng(3).integers(0, 256, k * MTU, np.uint8)
    meta = np.zeros((k, wire.BTH_LEN + wire.ICRC_LEN), np.uint8)
    seed = wire.icrc_seed(_ip(ours), _ip(peer), oport, pport, wire.UDP_LEN + SEG)
    peer_ack = wire.AckSealer(_ip(peer), _ip(ours), RX_QPN, pport, oport)
    if reply is not None:
        peer.sendto(peer_ack(psn0 + reply[1], reply[0], 0), ours.getsockname())
        time.sleep(0.05)

    b.tx_on, b.per = 1, 1
    b.tx_head = _head8(_MIDDLE, TX_QPN)
    b.tx_state = _middle_state(seed, TX_QPN)
    b.next_psn, b.inflight, b.since, b.window, b.half = psn0, 0, 0, window, window // 2
    b.src, b.k_left, b.meta = src.ctypes.data, k, meta.ctypes.data
    b.tx_dst = native.sockaddr(peer.getsockname())
    b.peer_ack_head = (ctypes.c_uint8 * 8)(*peer_ack.head)
    b.peer_ack_state = peer_ack.state
    b.notify_on, b.notify_psn = notify is not None, psn0 + (notify or 0)
    b.deadline = time.monotonic() + 0.1
    stop = fp.bulk(ctypes.byref(b))

    assert stop == want_stop
    if stop == native.BULK_BATCH:  # a NAK is the queue pair's to act on
        assert (b.j, b.part) == (0, 0)
    assert (b.sealed, b.sent, b.k_left) == (sealed, sealed, k - sealed)
    assert b.inflight == inflight and b.acks_rx == acks_rx
    assert (b.acked_psn - psn0 if b.acked else None) == acked
    assert b.next_psn == psn0 + sealed and b.src == src.ctypes.data + sealed * MTU
    got = _drain(peer)
    assert len(got) == sealed
    state = _middle_state(seed, TX_QPN)
    for i, d in enumerate(got):
        assert d[:8] == wire.BTH_FMT.pack(_MIDDLE, 0, wire.PKEY, TX_QPN, 0)[:8]
        w2 = int.from_bytes(d[8:12], "big")
        assert w2 == (psn0 + i) | (wire.ACKREQ if i % 2 == 1 else 0)  # every half window
        assert d[wire.BTH_LEN:-4] == src[i * MTU:(i + 1) * MTU].tobytes()
        assert int.from_bytes(d[-4:], "little") == wire.crc32(d[8:-4], state)
        assert bytes(meta[i, :wire.BTH_LEN]) == d[:wire.BTH_LEN]  # kept for a resend
    wake_r.close()
    wake_w.close()


def test_a_wake_up_ends_the_wait(fp, pair) -> None:
    ours, _peer = pair
    wake_r, wake_w = socket.socketpair()
    side = _Side(fp, ours, wake_r)
    side.b.deadline = time.monotonic() + 30
    wake_w.send(b"x")
    t = time.monotonic()
    assert fp.bulk(ctypes.byref(side.b)) == native.BULK_WAKE
    assert time.monotonic() - t < 5
    wake_r.close()
    wake_w.close()


def _world_digest(comm, *, bulk: bool) -> dict:
    # Ring and halving-doubling allreduce, reduce_scatter and allgather of 8 MiB, in
    # place and not: the steady state of every WRITE runs in fp_bulk, or in the engine's
    # Python loop.
    from fpgaccl.host import receive
    receive.BULK_LOOP = bulk
    rng = np.random.default_rng(comm.rank)
    x = rng.standard_normal(2 << 20).astype(np.float32)
    y = np.empty_like(x)
    comm.allreduce(x, y, algo="ring")
    z = np.empty_like(x)
    comm.allreduce(x, z, algo="rhd")
    w = x.copy()
    comm.allreduce(w, algo="rhd")
    comm.allreduce(x, algo="ring")
    rs = np.empty(len(x) // comm.world_size, np.float32)
    comm.reduce_scatter(x, rs)
    ag = np.empty(len(rs) * comm.world_size, np.float32)
    comm.allgather(rs, ag)
    ints = rng.integers(-1 << 40, 1 << 40, 1 << 20, np.int64)
    comm.allreduce(ints, algo="ring")
    assert z.tobytes() == w.tobytes()  # the same program in place: the same bits
    st = comm.stats()
    return {"common": b"".join(a.tobytes() for a in (y, z, w, x, ag, ints)),
            "mine": rs.tobytes(),
            "c": [st.get(k, 0) for k in ("bulk_runs", "bulk_rx_packets", "bulk_tx_packets",
                                         "bulk_acks_rx")]}


def test_the_c_loop_gives_the_same_bytes_as_the_python_loop() -> None:
    if native.load() is None:
        pytest.skip(f"no C fast path: {native.reason}")
    on = all_ok(run_world(4, _world_digest, bulk=True, timeout=240))
    off = all_ok(run_world(4, _world_digest, bulk=False, timeout=240))
    # The C loop ran, and took, sent and was ACKed packets itself.
    assert all(min(r["c"]) > 0 for r in on), [r["c"] for r in on]
    assert all(max(r["c"]) == 0 for r in off)
    assert len({r["common"] for r in on}) == 1  # every rank has the same result
    assert [(r["common"], r["mine"]) for r in on] == [(r["common"], r["mine"]) for r in off]
