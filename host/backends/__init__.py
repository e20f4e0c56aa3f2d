"""The engines a :class:`~fpgaccl.host.communicator.Communicator` can run on, each behind
one protocol (:class:`Backend`, in :mod:`.base`).

======== ============================================ ==========================
name     module                                       engine
======== ============================================ ==========================
software :mod:`.software`                             Python/numpy/C, RoCEv2 over UDP
sim      :mod:`.sim` over :mod:`.registers`           a node of the Verilator cluster
board    :mod:`.board` over :mod:`.registers`         a DMA engine behind a ``Device``
======== ============================================ ==========================

Each module is imported only when its backend is asked for.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from fpgaccl.errors import BackendUnavailableError

from .base import Backend, Pending, ProgramRun, Segment

BACKENDS: dict[str, tuple[str, str, float]] = {
    "software": ("software", "SoftwareBackend", 60.0),
    "sim": ("sim", "open_sim", 600.0),
    "board": ("board", "open_board", 600.0),
}
"""name -> (module, the callable that opens it, default per-call deadline in seconds:
simulated engines run far slower than the wall clock)."""


def open_backend(name: str) -> tuple[Callable[..., Backend], float]:
    """The opener of backend ``name`` (called as ``opener(rank, world_size, **options)``)
    and its default deadline."""
    if name not in BACKENDS:
        raise BackendUnavailableError(f"backend {name!r} is not available from the host "
                                      f"runtime; use one of {', '.join(map(repr, BACKENDS))}")
    module, attr, deadline_s = BACKENDS[name]
    opener: Any = getattr(importlib.import_module(f"{__name__}.{module}"), attr)
    return opener, deadline_s


__all__ = ["BACKENDS", "Backend", "Pending", "ProgramRun", "Segment", "open_backend"]
