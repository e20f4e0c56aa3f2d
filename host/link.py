"""A lossy link between the engine and its socket: drop, duplicate and reorder datagrams.

Used by tests and ``fpgaccl run --impair`` to prove that the transport, not luck, keeps
results right. Decisions come from a seeded generator so a failing run can be replayed.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

Send = Callable[[tuple, tuple[str, int]], None]


@dataclass
class ImpairedLink:
    loss: float = 0.0
    dup: float = 0.0
    reorder: float = 0.0
    seed: int = 0
    stats: dict[str, int] = field(default_factory=lambda: {"lost": 0, "duplicated": 0,
                                                           "reordered": 0})

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)
        self._held: tuple[tuple, tuple[str, int]] | None = None

    def __call__(self, parts: tuple, addr: tuple[str, int], send: Send) -> None:
        # Freeze the bytes: a held or duplicated packet must carry what was sent then.
        parts = (b"".join(bytes(p) for p in parts),)
        rng = self._rng
        if rng.random() < self.loss:
            self.stats["lost"] += 1
            self._release(send)
            return
        if self._held is None and rng.random() < self.reorder:
            self.stats["reordered"] += 1
            self._held = (parts, addr)  # goes out after the next datagram
            return
        send(parts, addr)
        if rng.random() < self.dup:
            self.stats["duplicated"] += 1
            send(parts, addr)
        self._release(send)

    def _release(self, send: Send) -> None:
        if self._held is not None:
            held, self._held = self._held, None
            send(*held)

    @classmethod
    def parse(cls, spec: str, seed: int = 0) -> ImpairedLink:
        """``"loss=0.05,dup=0.02,reorder=0.05[,seed=N]"``"""
        kw: dict[str, float] = {}
        for item in filter(None, (s.strip() for s in spec.split(","))):
            key, _, value = item.partition("=")
            if key not in ("loss", "dup", "reorder", "seed"):
                from fpgaccl.errors import InvalidArgumentError
                raise InvalidArgumentError("impair", f"unknown impairment {key!r}")
            kw[key] = float(value)
        s = int(kw.pop("seed", seed))
        return cls(seed=s, **kw)
