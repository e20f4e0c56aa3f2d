"""Rendezvous: every rank gets the table; the port rank 0 listens on; a taken port;
strangers at the port (scans, probes, idle connections, forged records) never fail a job."""

from __future__ import annotations

import hashlib
import hmac
import json
import socket
import threading
import time

import pytest

from fpgaccl.errors import CollectiveTimeoutError, InvalidArgumentError
from fpgaccl.host import rendezvous
from fpgaccl.host.rendezvous import exchange, rendezvous_port


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _world(n: int, port: int) -> list:
    out: list = [None] * n

    def rank(r: int) -> None:
        out[r] = exchange(r, n, ("127.0.0.1", port), {"me": r}, timeout_s=10)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(15)
    return out


def test_every_rank_gets_the_whole_table() -> None:
    got = _world(3, _free_port())
    assert got == [[{"me": 0}, {"me": 1}, {"me": 2}]] * 3


def test_the_listening_port(monkeypatch) -> None:
    monkeypatch.delenv("FPGACCL_RDZV_PORT", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert rendezvous_port(29500) == 29500
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")  # torchrun's agent holds MASTER_PORT
    assert rendezvous_port(29500) == 29501
    monkeypatch.setenv("FPGACCL_RDZV_PORT", "31000")
    assert rendezvous_port(29500) == 31000


def test_a_taken_port_names_master_port_and_the_way_out(monkeypatch) -> None:
    monkeypatch.delenv("FPGACCL_RDZV_PORT", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    with socket.socket() as store:  # a torchrun agent's TCPStore, say
        store.bind(("127.0.0.1", 0))
        store.listen()
        taken = store.getsockname()[1]
        with pytest.raises(InvalidArgumentError, match="FPGACCL_RDZV_PORT") as e:
            exchange(0, 2, ("127.0.0.1", taken), {}, timeout_s=2)
        assert e.value.argument == "master_port"
        monkeypatch.setenv("FPGACCL_RDZV_PORT", str(_free_port()))
        got = _world(2, taken)
    assert got == [[{"me": 0}, {"me": 1}]] * 2


def _self_connected(port: int) -> socket.socket:
    """What a connect to a port nobody listens on can be given when the port lies in the
    ephemeral range: a TCP socket joined to itself (simultaneous open)."""
    s = socket.socket()
    s.bind(("127.0.0.1", port))
    s.connect(("127.0.0.1", port))
    assert s.getsockname() == s.getpeername()
    return s


def test_a_connect_that_joins_itself_is_no_master(monkeypatch) -> None:
    monkeypatch.delenv("FPGACCL_RDZV_PORT", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    port = _free_port()
    made = []

    def connect(addr, timeout=None):
        made.append(_self_connected(port))
        return made[-1]

    monkeypatch.setattr(rendezvous.socket, "create_connection", connect)
    with pytest.raises(CollectiveTimeoutError, match="no master"):
        exchange(1, 2, ("127.0.0.1", port), {"me": 1}, timeout_s=0.3)
    assert made and all(s.fileno() == -1 for s in made)  # each one closed, and retried


def test_a_master_of_another_world_size_is_refused(monkeypatch) -> None:
    monkeypatch.delenv("FPGACCL_RDZV_PORT", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    port = _free_port()
    got: list = []
    master = threading.Thread(target=lambda: got.append(
        exchange(0, 2, ("127.0.0.1", port), {"me": 0}, timeout_s=10)))
    master.start()
    with pytest.raises(InvalidArgumentError, match="world of 3") as e:
        exchange(1, 3, ("127.0.0.1", port), {"me": 1}, timeout_s=10)
    master.join(15)
    assert e.value.argument == "world_size"
    assert got == [[{"me": 0}, {"me": 1}]]


SECRET = "job-secret-of-this-test"


def _listening(port: int, timeout_s: float = 10) -> None:
    """Wait for rank 0 to listen (itself a stranger: a connect and a close)."""
    end = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            assert time.monotonic() < end, "rank 0 never listened"
            time.sleep(0.02)


def _stranger(port: int, send: bytes | None, read_hello: bool = True) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    if read_hello:
        assert json.loads(s.makefile("rb").readline())["nonce"]
    if send is not None:
        s.sendall(send)
    return s


def _answer(s: socket.socket) -> dict:
    """What rank 0 said last before it closed the connection."""
    lines = b"".join(iter(lambda: s.recv(65536), b"")).splitlines()
    s.close()
    return json.loads(lines[-1])


def _fake(rank: int, mac: str | None = None) -> bytes:
    rec = {"rank": rank, "info": {"me": "impostor"}}
    return (json.dumps({**rec, "mac": mac} if mac is not None else rec) + "\n").encode()


def test_strangers_at_the_port_never_fail_the_job(monkeypatch, caplog) -> None:
    monkeypatch.delenv("FPGACCL_RDZV_PORT", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setenv(rendezvous.SECRET_ENV, SECRET)
    port, n = _free_port(), 4
    out: list = [None] * n
    errors: list = []

    def rank(r: int) -> None:
        try:
            out[r] = exchange(r, n, ("127.0.0.1", port), {"me": r}, timeout_s=10)
        except BaseException as e:  # reported by the assertion below
            errors.append(e)

    master = threading.Thread(target=rank, args=(0,))
    master.start()
    _listening(port)  # a port scan: connect, close
    t0 = time.monotonic()
    idle = socket.create_connection(("127.0.0.1", port), timeout=5)  # never sends
    http = _stranger(port, b"GET / HTTP/1.0\r\nHost: x\r\n\r\n", read_hello=False)
    garbage = _stranger(port, b"\x00\xff\xfe not a record\n")
    no_mac = _stranger(port, _fake(1))
    wrong = hmac.new(b"guessed", b"anything", hashlib.sha256).hexdigest()
    wrong_mac = _stranger(port, _fake(1, wrong))
    array = _stranger(port, b"[1, 2]\n")
    for s in (http, garbage, no_mac, wrong_mac, array):
        assert "error" in _answer(s)
    others = [threading.Thread(target=rank, args=(r,)) for r in range(1, n)]
    for t in others:
        t.start()
    for t in [master, *others]:
        t.join(15)
    assert not errors, errors
    assert out == [[{"me": r} for r in range(n)]] * n
    # The idle connection held nobody up: the world formed long before it timed out.
    assert time.monotonic() - t0 < rendezvous.CLIENT_TIMEOUT_S
    assert "complete" in _answer(idle)["error"]
    refused = [r.getMessage() for r in caplog.records if "refused 127.0.0.1:" in r.getMessage()]
    assert len(refused) == 7, refused  # scan, HTTP, garbage, two fakes, array, idle
    assert any("not JSON" in m for m in refused) and any("secret" in m for m in refused)


def test_a_stranger_that_says_nothing_is_timed_out_alone(monkeypatch, caplog) -> None:
    monkeypatch.delenv("FPGACCL_RDZV_PORT", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setattr(rendezvous, "CLIENT_TIMEOUT_S", 0.3)
    port = _free_port()
    got: list = []
    master = threading.Thread(target=lambda: got.append(
        exchange(0, 2, ("127.0.0.1", port), {"me": 0}, timeout_s=10, secret=SECRET)))
    master.start()
    _listening(port)
    idle = _stranger(port, b'{"rank": 1, "info"')  # half a record, then silence
    assert "no record within 0.3 s" in _answer(idle)["error"]
    assert exchange(1, 2, ("127.0.0.1", port), {"me": 1}, timeout_s=10, secret=SECRET) == \
        [{"me": 0}, {"me": 1}]
    master.join(15)
    assert got == [[{"me": 0}, {"me": 1}]]


def test_a_rank_with_another_secret_is_refused_by_name(monkeypatch) -> None:
    """A genuine misconfiguration fails fast on the rank, typed; rank 0 names who is
    missing when its deadline passes."""
    monkeypatch.delenv("FPGACCL_RDZV_PORT", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    port = _free_port()
    errors: list = []

    def master() -> None:
        try:
            exchange(0, 2, ("127.0.0.1", port), {"me": 0}, timeout_s=1.5, secret=SECRET)
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=master)
    t.start()
    t0 = time.monotonic()
    with pytest.raises(InvalidArgumentError, match="refused rank 1") as e:
        exchange(1, 2, ("127.0.0.1", port), {"me": 1}, timeout_s=10, secret="other")
    assert e.value.argument == rendezvous.SECRET_ENV
    assert time.monotonic() - t0 < 1.5
    t.join(15)
    assert len(errors) == 1 and isinstance(errors[0], CollectiveTimeoutError)
    assert "ranks [1] never arrived" in str(errors[0])


def test_without_a_secret_anyone_can_join_and_rank_0_says_so(monkeypatch, caplog) -> None:
    monkeypatch.delenv("FPGACCL_RDZV_PORT", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.delenv(rendezvous.SECRET_ENV, raising=False)
    monkeypatch.setattr(rendezvous, "_warned_open", False)
    for _ in range(2):
        assert _world(2, _free_port()) == [[{"me": 0}, {"me": 1}]] * 2
    warned = [r for r in caplog.records if "anyone who reaches" in r.getMessage()]
    assert len(warned) == 1


def test_a_rank_outside_the_world_or_taken_is_refused_by_name(monkeypatch) -> None:
    """Typed on the rank that is refused, not fatal on rank 0 (a stranger could send the
    same). Without a secret the first claim of a rank wins: strangers can join."""
    monkeypatch.delenv("FPGACCL_RDZV_PORT", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.delenv(rendezvous.SECRET_ENV, raising=False)
    port = _free_port()
    got: list = []
    master = threading.Thread(target=lambda: got.append(
        exchange(0, 3, ("127.0.0.1", port), {"me": 0}, timeout_s=10)))
    master.start()
    with pytest.raises(InvalidArgumentError, match=r"rank 5 is not one of ranks 1\.\.2") as e:
        exchange(5, 6, ("127.0.0.1", port), {"me": 5}, timeout_s=10)
    assert e.value.argument == "rank"
    impostor = _stranger(port, _fake(1))
    with pytest.raises(InvalidArgumentError, match="rank 1 already joined from") as e:
        exchange(1, 3, ("127.0.0.1", port), {"me": 1}, timeout_s=10)
    assert e.value.argument == "rank"
    assert exchange(2, 3, ("127.0.0.1", port), {"me": 2}, timeout_s=10) == \
        [{"me": 0}, {"me": "impostor"}, {"me": 2}]
    assert _answer(impostor)["table"][1] == {"me": "impostor"}
    master.join(15)
    assert got == [[{"me": 0}, {"me": "impostor"}, {"me": 2}]]
