"""A file descriptor that becomes readable at a set time: Linux's timerfd, through libc
(the standard library has ``os.timerfd_create`` only from Python 3.13).

The engine hands its timers back to its own thread with one: a caller that lets the
loop go sets the alarm for the next thing due, and the engine thread, asleep on it,
wakes then, not at once. A wake-up at once costs both threads a context switch, on
every call of a caller that calls again within microseconds.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os

_CLOCK_MONOTONIC = 1
_TFD_NONBLOCK = os.O_NONBLOCK
_TFD_CLOEXEC = os.O_CLOEXEC


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


class Alarm:
    """A one-shot timer on the monotonic clock whose descriptor polls readable once it
    has expired, until :meth:`clear`."""

    def __init__(self, libc: ctypes.CDLL) -> None:
        self._settime = libc.timerfd_settime
        self._settime.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.POINTER(_Itimerspec),
                                  ctypes.c_void_p]
        fd = libc.timerfd_create(_CLOCK_MONOTONIC, _TFD_NONBLOCK | _TFD_CLOEXEC)
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
        self._fd = fd
        self._spec = _Itimerspec()
        self._ref = ctypes.byref(self._spec)

    def fileno(self) -> int:
        return self._fd

    def set(self, delay_s: float) -> None:
        """Expire ``delay_s`` seconds from now (at least 1 us: zero would disarm it),
        replacing any earlier setting."""
        ns = max(1000, int(delay_s * 1e9))
        value = self._spec.it_value
        value.tv_sec, value.tv_nsec = divmod(ns, 1_000_000_000)
        if self._settime(self._fd, 0, self._ref, None) < 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))

    def clear(self) -> None:
        """Take the expiry, so that the descriptor polls quiet again."""
        with contextlib.suppress(BlockingIOError):
            os.read(self._fd, 8)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def make_alarm() -> Alarm | None:
    """An :class:`Alarm`, or None where the C library has no timerfd (not Linux)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name, use_errno=True)
        libc.timerfd_create  # noqa: B018 -- raises AttributeError where it is missing
        return Alarm(libc)
    except (OSError, AttributeError):
        return None
