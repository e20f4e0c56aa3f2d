"""A lossy link between the engine and its socket: drop, duplicate, reorder and delay
datagrams.

Used by tests and ``fpgaccl run --impair`` to prove that the transport, not luck, keeps
results right. Decisions come from a seeded generator so a failing run can be replayed.
"""

from __future__ import annotations

import contextlib
import queue
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

Send = Callable[[tuple, tuple[str, int]], None]


@dataclass
class ImpairedLink:
    loss: float = 0.0
    dup: float = 0.0
    reorder: float = 0.0
    # Seconds each datagram spends on the link (a delay line on a thread of its own: the
    # engine never waits for it). A long link is a slow one for a windowed transport: a
    # peer that stays alive and moves, however long its calls take.
    delay: float = 0.0
    # With ``lag``, a reordered datagram is held back this many seconds (on a line of its
    # own) instead of until the next one: it arrives behind everything sent meanwhile, as
    # on a path whose packets take different routes.
    lag: float = 0.0
    seed: int = 0
    stats: dict[str, int] = field(default_factory=lambda: {"lost": 0, "duplicated": 0,
                                                           "reordered": 0})

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)
        self._held: tuple[tuple, tuple[str, int]] | None = None

    def __call__(self, parts: tuple, addr: tuple[str, int], send: Send) -> None:
        # Freeze the bytes: a held or duplicated packet must carry what was sent then.
        parts = (b"".join(bytes(p) for p in parts),)
        if self.delay:
            send = self._delayed(send)
        rng = self._rng
        if rng.random() < self.loss:
            self.stats["lost"] += 1
            self._release(send)
            return
        if self.lag:
            if rng.random() < self.reorder:
                self.stats["reordered"] += 1
                self._lagged(send)(parts, addr)
                return
        elif self._held is None and rng.random() < self.reorder:
            self.stats["reordered"] += 1
            self._held = (parts, addr)  # goes out after the next datagram
            return
        send(parts, addr)
        if rng.random() < self.dup:
            self.stats["duplicated"] += 1
            send(parts, addr)
        self._release(send)

    def _delayed(self, send: Send) -> Send:
        return self._later(send, "_line", self.delay)

    def _lagged(self, send: Send) -> Send:
        return self._later(send, "_lag_line", self.lag)

    def _later(self, send: Send, name: str, delay: float) -> Send:
        """``send`` through the delay line ``name`` (one thread each, first in first out:
        its datagrams all wait ``delay``)."""
        line = getattr(self, name, None)
        if line is None:
            line = queue.SimpleQueue()
            setattr(self, name, line)
            threading.Thread(target=self._drain, args=(line,), daemon=True,
                             name="fpgaccl-link-delay").start()

        def later(parts: tuple, addr: tuple[str, int]) -> None:
            line.put((time.monotonic() + delay, send, parts, addr))
        return later

    @staticmethod
    def _drain(line: queue.SimpleQueue) -> None:
        while True:
            due, send, parts, addr = line.get()
            wait = due - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            with contextlib.suppress(OSError):  # a closed engine's link goes down with it
                send(parts, addr)

    def _release(self, send: Send) -> None:
        if self._held is not None:
            held, self._held = self._held, None
            send(*held)

    @classmethod
    def parse(cls, spec: str, seed: int = 0) -> ImpairedLink:
        """``"loss=0.05,dup=0.02,reorder=0.05[,delay=0.001][,lag=0.002][,seed=N]"``"""
        kw: dict[str, float] = {}
        for item in filter(None, (s.strip() for s in spec.split(","))):
            key, _, value = item.partition("=")
            if key not in ("loss", "dup", "reorder", "delay", "lag", "seed"):
                from fpgaccl.errors import InvalidArgumentError
                raise InvalidArgumentError("impair", f"unknown impairment {key!r}")
            kw[key] = float(value)
        s = int(kw.pop("seed", seed))
        return cls(seed=s, **kw)
