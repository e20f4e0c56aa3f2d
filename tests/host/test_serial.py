"""A register-driven backend's calls on a thread of their own (host/backends/serial.py)."""

from __future__ import annotations

import threading
import time

import pytest

from fpgaccl.host.backends.serial import SerialCalls


def test_calls_run_in_order_off_the_callers_thread_and_errors_reach_wait() -> None:
    calls = SerialCalls("t")
    ran: list[tuple[int, str]] = []
    gate = threading.Event()

    def work(i: int) -> None:
        gate.wait(5)
        ran.append((i, threading.current_thread().name))
        if i == 1:
            raise ValueError("second")

    pending = [calls.submit(f"c{i}", 1.0, lambda i=i: work(i)) for i in range(3)]
    assert not any(c.event.is_set() for c in pending)   # queued: submit did not block
    gate.set()
    for c in pending:
        assert c.event.wait(5)
    assert [i for i, _ in ran] == [0, 1, 2] and {n for _, n in ran} == {"t"}
    assert pending[0].error is None and pending[2].error is None
    assert isinstance(pending[1].error, ValueError)
    calls.stop()


def test_stop_waits_for_the_calls_issued_before_and_refuses_later_ones() -> None:
    calls = SerialCalls("t")
    done = []
    calls.submit("slow", 1.0, lambda: (time.sleep(0.2), done.append(1)))
    calls.stop()
    assert done == [1]
    late = calls.submit("late", 1.0, lambda: done.append(2))
    assert late.event.is_set() and isinstance(late.error, RuntimeError) and done == [1]


def test_an_abort_fails_the_running_call_and_the_queued_ones_with_its_error() -> None:
    calls = SerialCalls("t")
    release = threading.Event()

    def blocked() -> None:      # as a port's call whose socket the abort closes
        release.wait(5)
        raise OSError("connection closed")

    running = calls.submit("running", 1.0, blocked)
    queued = calls.submit("queued", 1.0, lambda: pytest.fail("ran after the abort"))
    time.sleep(0.05)
    calls.stop(lambda name: KeyError(name), wait=False)
    release.set()
    for c in (running, queued):
        assert c.event.wait(5)
        assert isinstance(c.error, KeyError) and c.error.args == (c.name,)
