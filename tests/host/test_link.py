"""The lossy link shim (host/link.py): what each impairment does to the datagrams."""

from __future__ import annotations

import time

import pytest

from fpgaccl.errors import InvalidArgumentError
from fpgaccl.host.link import ImpairedLink

ADDR = ("127.0.0.2", 4791)


def _through(link: ImpairedLink, n: int) -> list[int]:
    got: list[int] = []

    def send(parts: tuple, addr: tuple[str, int]) -> None:
        assert addr == ADDR
        got.append(parts[0][0])

    for i in range(n):
        link((bytes([i]),), ADDR, send)
    return got


def test_a_lagged_datagram_arrives_behind_those_sent_after_it() -> None:
    link = ImpairedLink(reorder=0.3, lag=0.02, seed=3)
    got = _through(link, 40)
    lagged = link.stats["reordered"]
    assert 0 < lagged < 40 and len(got) == 40 - lagged
    assert got == sorted(got)  # the rest at once, in order
    deadline = time.monotonic() + 2
    while len(got) < 40 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sorted(got) == list(range(40))  # nothing lost, nothing twice
    assert got[40 - lagged:] == sorted(got[40 - lagged:])  # the lagged, in order


def test_without_a_lag_a_reordered_datagram_swaps_with_the_next() -> None:
    link = ImpairedLink(reorder=0.3, seed=3)
    got = _through(link, 40)
    assert link.stats["reordered"] > 0 and got != sorted(got)
    # Each reordered one went out right after the next (the last may still wait).
    assert sorted(got) == list(range(len(got))) and len(got) >= 39
    assert all(abs(i - v) <= 1 for i, v in enumerate(got))


def test_parse_takes_each_impairment_and_refuses_others() -> None:
    link = ImpairedLink.parse("loss=0.1,dup=0.2,reorder=0.3,delay=0.004,lag=0.002,seed=7")
    assert (link.loss, link.dup, link.reorder, link.delay, link.lag, link.seed) == \
        (0.1, 0.2, 0.3, 0.004, 0.002, 7)
    with pytest.raises(InvalidArgumentError, match="jitter"):
        ImpairedLink.parse("jitter=0.1")
