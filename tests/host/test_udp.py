"""The engine's UDP sockets: an ICMP error for one peer's datagram is read off the error
queue, names that peer's address, and costs no other peer's datagram."""

from __future__ import annotations

import select
import socket
import time
from collections import Counter

import pytest

from fpgaccl.host import native
from fpgaccl.host.udp import Udp


def _udp(ip: str, fastpath: bool) -> Udp:
    fp = native.load() if fastpath else None
    if fastpath and fp is None:
        pytest.skip("the C fast path did not build here")
    return Udp(ip, 0, 1 << 20, Counter(), link=None, tap=None, fastpath=fp,
               no_gso=lambda: None)


def _closed_port(ip: str) -> tuple[str, int]:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind((ip, 0))
    addr = s.getsockname()
    s.close()  # nothing listens there now: the kernel answers port unreachable
    return addr


@pytest.mark.parametrize("fastpath", [False, True], ids=["python", "native"])
def test_a_closed_port_is_read_off_the_error_queue_and_costs_no_other_datagram(
        fastpath: bool) -> None:
    udp = _udp("127.61.0.1", fastpath)
    live = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    live.bind(("127.61.0.2", 0))
    live.settimeout(2.0)
    gone = _closed_port("127.61.0.3")
    try:
        udp.transmit((b"to the dead",), gone)
        deadline = time.monotonic() + 2.0
        while not udp.errors_pending and time.monotonic() < deadline:
            # The ICMP error is reported once, to the next socket call: a send.
            udp.transmit((b"to the living",), live.getsockname())
            assert live.recv(100) == b"to the living"
        assert udp.errors_pending
        errors = udp.read_errors()
        assert not udp.errors_pending
        assert [(e.dst, e.port_closed) for e in errors] == [(gone, True)], errors
        assert udp.stats["socket_errors"] == 1
        # The queue is empty again: poll no longer reports an error.
        p = select.poll()
        p.register(udp.sock, 0)
        assert p.poll(0) == []
    finally:
        udp.close()
        live.close()


def test_with_nothing_sent_to_a_closed_port_no_error_is_queued() -> None:
    udp = _udp("127.61.0.4", False)
    try:
        assert udp.read_errors() == [] and not udp.errors_pending
    finally:
        udp.close()
