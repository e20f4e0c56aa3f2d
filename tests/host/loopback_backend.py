"""A backend in one module, to show what adding one takes: every rank of a world lives in
this process (one thread each) and the ranks' programs run together on the executable
model of the sequencer (:class:`fpgaccl.sim.models.sequencer.SequencerModel`), in pure
numpy. It implements :class:`fpgaccl.host.backends.Backend` and nothing else; the
Communicator drives it unchanged."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from fpgaccl.errors import CountMismatchError, UnsupportedError
from fpgaccl.host.backends.base import Finished, Program, ProgramRun
from fpgaccl.host.backends.registers import StagingArea
from fpgaccl.proto.drops import DropReason
from fpgaccl.proto.signature import Signature
from fpgaccl.sim.models.sequencer import SequencerModel


class Fabric:
    """What the ranks of one world share: a meeting point per call."""

    def __init__(self, world_size: int, stage_bytes: int = 1 << 16) -> None:
        self.world_size = world_size
        self.stage_bytes = stage_bytes
        self._barrier = threading.Barrier(world_size)
        self._calls: dict[int, dict[int, Any]] = {}
        self._lock = threading.Lock()

    def meet(self, rank: int, coll_id: int, what: Any, deadline_s: float
             ) -> dict[int, Any]:
        """Every rank's ``what`` for ``coll_id``, once all have brought theirs."""
        with self._lock:
            self._calls.setdefault(coll_id, {})[rank] = what
        self._barrier.wait(deadline_s)
        got = self._calls[coll_id]
        self._barrier.wait(deadline_s)
        if rank == 0:
            with self._lock:
                del self._calls[coll_id]
        return got


class LoopbackBackend:
    name = "loopback"
    host_schedules = False
    p2p_programs = False
    clock_mhz = None
    barrier_at_close = False

    def __init__(self, rank: int, world_size: int, *, fabric: Fabric) -> None:
        self.rank, self.world_size, self.fabric = rank, world_size, fabric
        self.stage_bytes = fabric.stage_bytes
        self.staging = StagingArea(fabric.stage_bytes)
        self.segments = 0

    def run(self, run: ProgramRun, deadline_s: float) -> Finished:
        for s in run.segments:
            mine = (list(run.program), np.array(run.get_in(s.lo, s.hi)), run.dtype, run.op)
            calls = self.fabric.meet(self.rank, s.coll_id, mine, deadline_s)
            if {(len(x), d, o) for _, x, d, o in calls.values()} != {
                    (len(mine[1]), run.dtype, run.op)}:
                raise CountMismatchError("sendbuf", f"ranks called {run.name} differently")
            ranks = [calls[r] for r in range(self.world_size)]
            model = SequencerModel([p for p, _, _, _ in ranks], [x for _, x, _, _ in ranks],
                                   run.dtype, run.op, seed=s.coll_id)
            # Every rank runs the same seeded model of the whole world: same bits on each.
            run.put_out(model.run()[self.rank][:s.count], s.lo, s.hi)
            self.segments += 1
        return Finished(run.name, deadline_s)

    def schedule(self, name: str, body: Callable[[Any], Program], coll_id: int,
                 deadline_s: float, signature: Signature | None = None,
                 counts: tuple[Sequence[int], Sequence[int]] | None = None, *,
                 blocking: bool = False) -> Finished:
        raise UnsupportedError("algo", "the loopback backend runs sequencer programs only")

    def send(self, peer: int, seq: int, data: np.ndarray, deadline_s: float, *,
             blocking: bool = False) -> Finished:
        raise UnsupportedError("dst", "the loopback backend has no point-to-point")

    def recv(self, peer: int, seq: int, out: np.ndarray, deadline_s: float, *,
             blocking: bool = False) -> Finished:
        raise UnsupportedError("src", "the loopback backend has no point-to-point")

    def barrier(self, coll_id: int, deadline_s: float) -> Finished:
        self.fabric.meet(self.rank, coll_id, None, deadline_s)
        return Finished("barrier", deadline_s)

    def stats(self) -> dict[str, int]:
        return {"segments": self.segments}

    def drop_counters(self) -> dict[str, int]:
        return {r.name: 0 for r in DropReason}

    def close(self, linger_s: float | None = None) -> None:
        pass
