"""Rendezvous: every rank gets the table; the port rank 0 listens on; a taken port."""

from __future__ import annotations

import socket
import threading

import pytest

from fpgaccl.errors import InvalidArgumentError
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
