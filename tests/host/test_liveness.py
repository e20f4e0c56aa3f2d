"""Liveness apart from the deadline: a dead peer is found by the transport within the
peer timeout (or the retry limit) and named; a slow peer that keeps moving is never
failed, however long its call; a timeout names the ranks it waits on."""

from __future__ import annotations

import errno
import os
import signal
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fpgaccl.errors import (
    CollectiveTimeoutError,
    PeerDeadError,
    RanksTimeoutError,
    TransportError,
)
from fpgaccl.host import wire
from fpgaccl.host.engine import PEER_TIMEOUT_S, Engine
from fpgaccl.host.udp import SocketError
from fpgaccl.proto.drops import DropReason
from fpgaccl.proto.opcodes import Opcode

from ._world import all_ok, run_world
from .test_transport import sealed

N_KILL = 4 << 20  # float32: 16 MiB, a call that is still in flight 20 ms in


def _killed(comm, victim: int, stamp: str) -> tuple:
    x = np.ones(N_KILL, np.float32)
    comm.allreduce(np.ones(1024, np.float32))  # all in, the world formed
    if comm.rank == victim:
        comm.allreduce(x, async_op=True)
        time.sleep(0.02)
        Path(stamp).write_text(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        comm.allreduce(x)
    except CollectiveTimeoutError as e:
        return (type(e).__name__, isinstance(e, TransportError), getattr(e, "peer", None),
                getattr(e, "ranks", None), time.time(), str(e))
    return ("completed", False, None, None, time.time(), "")


def test_a_killed_rank_is_named_by_every_other_rank_within_the_peer_timeout() -> None:
    with tempfile.TemporaryDirectory() as d:
        stamp = os.path.join(d, "killed")
        res = run_world(4, _killed, victim=2, stamp=stamp, timeout=60, _close=False)
        killed_at = float(Path(stamp).read_text())
    assert res[2][0] == "died", res
    for r in (0, 1, 3):
        status, v = res[r]
        assert status == "ok", res
        name, transport, peer, ranks, at, why = v
        # The deadline (60 s) never came into it: the transport found the peer dead. Every
        # rank names rank 2, even where a rank that had found it first and exited
        # closed its own port meanwhile (the dead-peer notice).
        assert (name, transport, peer, ranks) == ("PeerDeadError", True, 2, [2]), (r, v)
        assert at - killed_at < 2.5, f"rank {r} took {at - killed_at:.2f} s"
        print(f"rank {r}: PeerDeadError naming rank 2 {at - killed_at:.2f} s after the kill: "
              f"{why}")
    # The killed rank's host answered port unreachable: faster than the peer timeout.
    assert any("port unreachable" in res[r][1][5] for r in (0, 1, 3)), res


def _late(comm, late: int, deadline: float) -> tuple:
    comm.barrier()
    if comm.rank == late:
        time.sleep(deadline * 1.125 + 2.5)  # alive, answering the transport, not calling
        return ("late",)
    n = comm.world_size
    x = np.arange(4 * n, dtype=np.float32)
    try:
        comm.alltoallv(x, [4] * n, np.zeros(4 * n, np.float32), [4] * n)
    except CollectiveTimeoutError as e:
        return (type(e).__name__, getattr(e, "ranks", None), str(e))
    return ("completed",)


def test_a_rank_that_never_calls_is_named_by_every_other_rank() -> None:
    deadline = 1.0
    res = run_world(4, _late, late=2, deadline=deadline, comm_kw={"deadline_s": deadline},
                    timeout=60, _close=False)
    for r, v in enumerate(all_ok(res)):
        if r == 2:
            continue
        # Alive: not a dead peer, a timeout that names whom this rank waits on.
        assert v[0] == "RanksTimeoutError" and v[1] == [2], (r, v)
        # alltoallv lands nothing before every rank's signature record has come.
        assert "rank 2 (signature record)" in v[2], v[2]


def _slow(comm, n: int) -> tuple:
    x = np.full(n, comm.rank + 1, np.float32)
    t0 = time.monotonic()
    comm.allreduce(x)
    return float(x[0]), float(x[-1]), time.monotonic() - t0


def test_a_slow_peer_that_keeps_moving_never_times_out() -> None:
    # A 30 ms link each way and a window of 1 MiB: the call takes many deadlines, each
    # with progress, and a peer timeout of a few round trips never sees a silent peer.
    # (No loss here: a lost message end waits out rto_s, which is no progress.)
    deadline = 0.3
    n = 8 << 20  # 32 MiB
    res = all_ok(run_world(2, _slow, n=n, timeout=60,
                           comm_kw={"deadline_s": deadline, "peer_timeout_s": 0.5,
                                    "rto_s": 0.2, "impair": "delay=0.03"}))
    for first, last, took in res:
        assert (first, last) == (3.0, 3.0)
        assert took > 5 * deadline, f"{took:.2f} s: not slow enough to prove anything"
    print(f"slow allreduce: {max(t for _, _, t in res):.2f} s with a {deadline} s deadline")


def _silent_peer(retry_limit: int | None, peer_timeout_s: float | None, **engine: Any
                 ) -> tuple:
    """An engine whose one peer is a socket that takes everything and ACKs nothing."""
    eng = Engine(0, "127.77.41.1", rto_s=0.01, retry_limit=retry_limit,
                 peer_timeout_s=peer_timeout_s, **engine)
    qp = eng.create_qp(1)
    sink = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sink.bind(("127.77.41.2", wire.ROCEV2_UDP_PORT))
    qp.connect(remote_qpn=0x4242, addr=sink.getsockname(), local_ip=eng.addr[0],
               send_psn=10, recv_psn=100, remote_va=0, remote_rkey=0)
    return eng, sink


def _send_and_wait(eng: Engine, deadline_s: float,
                   peer: int = 1) -> tuple[BaseException | None, float]:
    def program():
        yield eng.send(peer, 1, 0, memoryview(bytes(100)))

    t0 = time.monotonic()
    job = eng.submit("send", program(), deadline_s, ordered=False)
    assert job.event.wait(deadline_s * 2 + 10)
    return job.error, time.monotonic() - t0


def test_the_retry_limit_fails_a_peer_that_stops_acking() -> None:
    eng, sink = _silent_peer(retry_limit=3, peer_timeout_s=None)
    try:
        eng.start()
        err, took = _send_and_wait(eng, deadline_s=30.0)
        assert isinstance(err, PeerDeadError) and err.peer == 1, err
        assert "3 retransmissions" in str(err)
        assert eng.stats["timeouts"] == 4  # the 4th expiry fails the queue pair
        assert took < 2.0, took  # 10 + 20 + 40 + 80 ms of timer
    finally:
        eng.stop()
        sink.close()


def test_the_peer_timeout_fails_a_peer_that_stops_acking() -> None:
    eng, sink = _silent_peer(retry_limit=None, peer_timeout_s=0.3)
    try:
        eng.start()
        err, took = _send_and_wait(eng, deadline_s=30.0)
        assert isinstance(err, PeerDeadError) and err.peer == 1 and err.ranks == [1], err
        assert "unACKed" in str(err) and "rank 1 is dead" in str(err)
        assert 0.3 <= took < 2.0, took
        again, _ = _send_and_wait(eng, deadline_s=30.0)  # later calls name it too
        assert isinstance(again, PeerDeadError) and again.peer == 1, again
    finally:
        eng.stop()
        sink.close()


def test_a_peer_whose_port_is_closed_is_dead_in_a_round_trip() -> None:
    # A killed rank's host answers port unreachable: no waiting out the peer timeout.
    eng, sink = _silent_peer(retry_limit=None, peer_timeout_s=5.0)
    sink.close()
    try:
        eng.start()
        err, took = _send_and_wait(eng, deadline_s=30.0)
        assert isinstance(err, PeerDeadError) and err.peer == 1, err
        assert "port unreachable" in str(err), err
        assert took < 2.5, took  # a probe interval (1 s) at most, not the peer timeout
        assert eng.stats["port_unreachable"] >= 1
    finally:
        eng.stop()


def test_a_closed_port_fails_only_a_peer_that_owes_something_and_stays_silent() -> None:
    eng, sink = _silent_peer(retry_limit=None, peer_timeout_s=1.0)  # probe interval 0.2 s
    try:
        qp = eng.by_peer[1]

        def closed(now: float) -> None:
            eng.socket_errors([SocketError(qp.addr, errno.ECONNREFUSED, True, 3, 3)], now)

        closed(1.0)  # it owes nothing: noted, not judged
        assert qp.error is None and qp.closed_at == 1.0
        assert eng.stats["port_unreachable"] == 1
        qp.heard(2.0)  # then it spoke: that port belonged to someone before it
        qp.probed = 2.5
        eng.check_liveness(3.0)
        assert qp.error is None
        qp.heard(3.0)
        closed(3.05)  # forged, say: the peer spoke 50 ms ago, which no ICMP undoes
        assert qp.error is None
        qp.probed = 3.05  # a call waits on it
        eng.check_liveness(3.1)
        assert qp.error is None
        eng.check_liveness(3.25)  # silent a probe interval since: its process is gone
        assert isinstance(qp.error, PeerDeadError) and "port unreachable" in str(qp.error)
        other = ("127.77.41.9", 4791)  # no peer's address: counted, nothing else
        eng.socket_errors([SocketError(other, errno.EHOSTUNREACH, True, 3, 1)], 5.0)
        assert eng.stats["socket_errors_other"] == 1
    finally:
        eng.stop()
        sink.close()


def test_a_rank_that_finds_a_peer_dead_tells_the_others_which() -> None:
    # Engines 0 and 1 talk to each other and each to rank 2, a socket that never answers.
    a = Engine(0, "127.77.42.1", peer_timeout_s=20.0)
    b = Engine(1, "127.77.42.2", peer_timeout_s=20.0)
    sink = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sink.bind(("127.77.42.3", wire.ROCEV2_UDP_PORT))
    try:
        qa, qb = a.create_qp(1), b.create_qp(0)
        for eng, qp, other, q in ((a, qa, b, qb), (b, qb, a, qa)):
            qp.connect(remote_qpn=q.qpn, addr=other.addr, local_ip=eng.addr[0],
                       send_psn=5 if eng is a else 9, recv_psn=9 if eng is a else 5,
                       remote_va=q.ring.va, remote_rkey=q.ring.rkey)
            qp.selective = True  # software peers, as the rendezvous says
            eng.create_qp(2).connect(remote_qpn=0x4242, addr=sink.getsockname(),
                                     local_ip=eng.addr[0], send_psn=1, recv_psn=1,
                                     remote_va=0, remote_rkey=0)
        a.start()
        b.start()
        a.peer_dead(a.by_peer[2], "a test said so")  # as the peer timeout would
        err, took = _send_and_wait(b, deadline_s=30.0, peer=2)  # b waits on rank 2 too
        assert isinstance(err, PeerDeadError) and err.peer == 2, err
        assert "rank 0 found it dead" in str(err), err
        assert took < 2.0 and b.stats["dead_notices_rx"] == 1, (took, b.stats)
        assert a.stats["dead_notices"] == 1  # to rank 1 only: not to the dead one
    finally:
        a.stop()
        b.stop()
        sink.close()


def test_a_timeout_without_liveness_names_the_silent_peer() -> None:
    # No retry limit, no peer timeout: the deadline alone, naming whose ACKs are owed.
    eng, sink = _silent_peer(retry_limit=None, peer_timeout_s=None)
    try:
        eng.start()
        err, _ = _send_and_wait(eng, deadline_s=0.3)
        assert isinstance(err, RanksTimeoutError) and err.ranks == [1], err
        assert "rank 1 (ACKs" in str(err)
    finally:
        eng.stop()
        sink.close()


@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), True, "1"])
def test_peer_timeout_must_be_positive_seconds_or_none(bad) -> None:
    from fpgaccl.errors import InvalidArgumentError
    with pytest.raises(InvalidArgumentError) as e:
        Engine(0, "127.77.42.1", peer_timeout_s=bad)
    assert e.value.argument == "peer_timeout_s"
    assert PEER_TIMEOUT_S <= 1.5


def test_a_peer_heard_from_lately_is_not_probed_and_hearing_answers_a_probe() -> None:
    # In a world of 32 ranks on 2 cores, a probe to every peer on every round was most of
    # a starved rank's datagrams: anything a peer sends shows it alive.
    eng, sink = _silent_peer(retry_limit=None, peer_timeout_s=1.25)
    try:
        qp = eng.by_peer[1]
        quiet = 1.25 / 5
        qp.heard(10.0)
        eng.probe([1], 10.0 + quiet / 2)
        assert eng.stats["probes_tx"] == 0 and qp.probed == 0.0
        eng.probe([1], 10.0 + quiet)
        assert eng.stats["probes_tx"] == 1 and qp.probed == 10.0 + quiet
        assert qp.silent_for(10.0 + 2 * quiet) == pytest.approx(quiet)
        qp.heard(10.0 + 2 * quiet)  # any datagram from the peer answers the probe
        assert qp.probed == 0.0 and qp.silent_for(10.0 + 3 * quiet) == 0.0
    finally:
        eng.stop()
        sink.close()


@pytest.mark.parametrize("native_path", [False, True])
def test_a_datagram_from_the_peer_answers_its_probe(native_path) -> None:
    # The receive path tells the queue pair it heard from its peer (here an ACK of what
    # was last ACKed, the answer to a probe); a stranger's datagram does not.
    eng, peer = _silent_peer(retry_limit=None, peer_timeout_s=1.25, native_path=native_path)
    qp = eng.by_peer[1]
    stranger = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    stranger.bind(("127.77.41.3", wire.ROCEV2_UDP_PORT))
    try:
        body = wire.AETH_FMT.pack(wire.ACK_SYNDROME << wire.SYNDROME_SHIFT)
        qp.probed = 5.0
        for sock in (stranger, peer):
            src = sock.getsockname()[0]
            sock.sendto(sealed(Opcode.ACKNOWLEDGE, 9, qp.qpn, body, src, eng.addr[0]),
                        eng.addr)
            time.sleep(0.05)
            eng.receiver.receive()
            if sock is stranger:
                assert qp.probed == 5.0 and qp.heard_at == 0.0
        assert qp.probed == 0.0 and qp.heard_at > 0.0
        assert eng.drops[DropReason.WRONG_SOURCE] == 1
    finally:
        eng.stop()
        peer.close()
        stranger.close()
