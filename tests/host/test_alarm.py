"""The engine thread's alarm: a descriptor that polls readable once its time is over."""

from __future__ import annotations

import select
import time

import pytest

from fpgaccl.host.alarm import make_alarm


def test_the_alarm_fires_when_set_not_before_and_clears() -> None:
    alarm = make_alarm()
    if alarm is None:
        pytest.skip("no timerfd in this C library")
    poll = select.poll()
    poll.register(alarm.fileno(), select.POLLIN)
    try:
        assert poll.poll(0) == []  # never set: quiet
        t = time.monotonic()
        alarm.set(0.02)
        assert poll.poll(5) == []
        assert poll.poll(1000), "the alarm did not fire"
        assert time.monotonic() - t >= 0.02
        alarm.clear()
        assert poll.poll(0) == []
        # A new setting replaces the old one: only the later time counts.
        alarm.set(0.01)
        alarm.set(0.2)
        assert poll.poll(50) == []
    finally:
        alarm.close()
