"""The engines a :class:`~fpgaccl.host.communicator.Communicator` can run on, each behind
one protocol (:class:`Backend`, in :mod:`.base`).

======== ============================================ ==========================
name     module                                       engine
======== ============================================ ==========================
software :mod:`.software`                             Python/numpy/C, RoCEv2 over UDP
sim      :mod:`.sim` over :mod:`.registers`           a node of the Verilator cluster
board    :mod:`.board` over :mod:`.registers`         a DMA engine behind a ``Device``
======== ============================================ ==========================

Each module is imported only when its backend is asked for; :func:`register` adds one
(a test's in-process loopback backend does: ``tests/host/loopback_backend.py``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from fpgaccl.errors import BackendUnavailableError

from .base import Backend, Pending, ProgramRun, Segment

Opener = Callable[..., Backend]
"""``opener(rank, world_size, **options)``: a connected backend for ``rank``."""

BACKENDS: dict[str, tuple[str | Opener, float]] = {
    "software": (f"{__name__}.software:SoftwareBackend", 60.0),
    "sim": (f"{__name__}.sim:open_sim", 600.0),
    "board": (f"{__name__}.board:open_board", 600.0),
}
"""name -> (the opener, or ``"module:attr"`` naming it; the default per-call deadline in
seconds: simulated engines run far slower than the wall clock)."""


def register(name: str, opener: str | Opener, deadline_s: float = 60.0) -> None:
    """Make ``Communicator(..., backend=name)`` open ``opener``."""
    BACKENDS[name] = (opener, deadline_s)


def open_backend(name: str) -> tuple[Opener, float]:
    """The opener of backend ``name`` and its default deadline."""
    if name not in BACKENDS:
        raise BackendUnavailableError(f"backend {name!r} is not available from the host "
                                      f"runtime; use one of {', '.join(map(repr, BACKENDS))}")
    opener, deadline_s = BACKENDS[name]
    if isinstance(opener, str):
        module, _, attr = opener.partition(":")
        opener = getattr(importlib.import_module(module), attr)
    return opener, deadline_s


__all__ = ["BACKENDS", "Backend", "Opener", "Pending", "ProgramRun", "Segment", "open_backend",
           "register"]
