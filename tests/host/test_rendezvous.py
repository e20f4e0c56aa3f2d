"""Rendezvous: every rank gets the table; the port rank 0 listens on; a taken port."""

from __future__ import annotations

import socket
import threading

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
