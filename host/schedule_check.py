"""The call signature check of a host schedule (:mod:`fpgaccl.host.algorithms`), on the
engine thread. Schedules send no GRANT to carry a digest, so the first message a rank
sends each peer in a call starts with its schedule record
(:func:`fpgaccl.proto.signature.schedule_record`), and a rank lands a peer's data only
once that peer's record agrees:

* A peer's record that differs fails the call on both ranks of the pair (each holds
  both records), and the detector tells its other software peers with a mismatch
  notice, so ranks still waiting in the call fail with the same field.
* All-to-all-v talks to every rank: each rank waits for every record before it lands a
  byte, and checks the whole count matrix, so a pair whose counts disagree fails every
  rank with the same error.
* A rank that only sends to a peer still waits for that peer's record before its call
  returns. That is all it waits for: a rank whose part of a call only sends (a leaf of
  a ``tree`` reduce, the root of a ``tree`` broadcast), to peers that agree with it,
  may return before the ranks that disagree compare. Its result is not wrong (a
  non-root reduce has none, a root broadcasts its own buffer); every rank whose result
  depends on the ranks that disagree fails.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator, Sequence
from typing import Any

import numpy as np

from fpgaccl.errors import CollectiveMismatchError, CountMismatchError
from fpgaccl.proto.signature import (
    STEP_MISMATCH,
    STEP_RECORD,
    Signature,
    counts_difference,
    schedule_counts,
    schedule_data,
    schedule_record,
    schedule_record_bytes,
)

from .engine import Engine
from .executor import (
    digest_mismatch_error,
    drain_stale,
    mismatch_error,
    notice_error,
    take_notice,
)
from .matching import RecvOp, land
from .qp import Arrival, Completion, QueuePair


class ScheduleCheck:
    """One host schedule's check: ``mine`` is this rank's signature, ``counts`` its
    (sendcounts, recvcounts) for all-to-all-v (every receive then waits for every
    rank's record), ``software`` the peers that can read a notice."""

    def __init__(self, engine: Engine, coll_id: int, mine: Signature, world: int,
                 software: frozenset[int],
                 counts: tuple[Sequence[int], Sequence[int]] | None = None) -> None:
        self.engine = engine
        self.coll_id = coll_id & 0xFFFF
        self.mine = mine
        self.world = world
        self.software = software
        record = schedule_record(mine, world, *(counts or ()))
        self.size = schedule_record_bytes(world)
        self.alone = memoryview(record)      # the record, no data after it
        self.prefix = record[:-8]            # the record less its data length
        self.everyone = counts is not None
        self.rows: dict[int, tuple[Sequence[int], Sequence[int]]] = \
            {mine.rank: counts} if counts is not None else {}
        self.takes: dict[int, RecvOp] = {}     # each peer's record, taken whole
        self.unread: dict[int, RecvOp] = {}    # takes whose record was not compared yet
        self.takes_seen = -1
        self.told: set[int] = set()             # peers sent this rank's record
        self.agreed: set[int] = set()
        self.data: dict[int, tuple[QueuePair, Arrival, int]] = {}
        """A peer's first data message that came inside its record, held in its ring
        slot for this rank's first receive from that peer."""
        self.received: set[int] = set()         # peers a receive was posted for
        self.error: CollectiveMismatchError | None = None
        self.notices: list[Completion] = []
        self.seen = -1
        self.settled = False   # every record expected has come and agreed
        self.rings = [q for p in sorted(software) if (q := engine.by_peer.get(p))]
        engine.dead_colls.discard(self.coll_id)   # an id reused after 2**16 calls
        drain_stale(engine, self.coll_id, software)
        if self.everyone:
            for p in range(world):
                if p != mine.rank:
                    self.expect(p)

    # ------------------------------------------------------------------ posting
    def expect(self, peer: int) -> None:
        """The schedule talks to ``peer``: take its record when it comes (once)."""
        if peer not in self.takes:
            self.settled = False
            self.takes[peer] = self.unread[peer] = self.engine.matcher.take(
                peer, self.coll_id, STEP_RECORD, "signature record")
            self.engine.arrivals_dirty = True

    def send(self, peer: int, step: int, data: memoryview) -> Sent:
        """Post a send of ``data`` to ``peer`` at ``step``: inside this rank's record if
        it is the first message to ``peer`` and both fit one ring slot (a copy of the
        data is cheaper than a message of its own: 64 KiB alltoallv blocks 1.1x the
        unchecked time merged, 1.2-1.3x with the record apart)."""
        self.expect(peer)
        engine = self.engine
        if peer not in self.told:
            self.told.add(peer)
            if self.size + len(data) > engine.slot_bytes:
                engine.send(peer, self.coll_id, STEP_RECORD, self.alone)
            else:
                msg = b"".join((self.prefix, len(data).to_bytes(8, "big"), data))
                return Sent(self, engine.send(peer, self.coll_id, STEP_RECORD,
                                              memoryview(msg)))
        return Sent(self, engine.send(peer, self.coll_id, step, data))

    def recv(self, peer: int, step: int, dest: np.ndarray, ufunc: Any | None,
             what: str) -> Gated:
        """A receive from ``peer`` at ``step``, landed once the check lets it."""
        self.expect(peer)
        if peer not in self.told:
            # Nothing of ours goes to it first: it still needs our record to compare.
            self.told.add(peer)
            self.engine.send(peer, self.coll_id, STEP_RECORD, self.alone)
        first = peer not in self.received
        self.received.add(peer)
        return Gated(self, peer, step, dest, ufunc, what, first)

    # ------------------------------------------------------------------ checking
    def look(self) -> CollectiveMismatchError | None:
        """The call's mismatch once known: compares the records that came, and takes a
        notice that came."""
        if self.error is not None:
            return self.error
        if not self.settled:
            self._compare()
            if self.error is not None:
                return self.error
        events = self.engine.events
        if events != self.seen:
            self.seen = events
            for qp in self.rings:
                if qp.arrived and (buf := take_notice(self.engine, qp, {self.coll_id})) \
                        is not None:
                    self.error = notice_error(buf)
                    break
        return self.error

    def _compare(self) -> None:
        """Compare the records that came since the last look."""
        matcher = self.engine.matcher
        if matcher.takes_done == self.takes_seen:
            return
        self.takes_seen = matcher.takes_done
        came = [(p, op) for p, op in self.unread.items() if op.taken is not None]
        sb = self.engine.slot_bytes
        for p, op in came:
            a = op.taken
            del self.unread[p]
            qp = self.engine.by_peer[p]
            start = a.slot * sb
            rec = qp.ring.view[start:start + min(a.length, self.size)]
            if len(rec) < self.size:   # not a record of this world's shape
                qp.give_back(a.slot)
                op.taken = None
                self._fail(digest_mismatch_error(p, 0, self.mine.rank, self.mine.digest))
                return
            if int.from_bytes(rec[:8], "big") != self.mine.digest:
                theirs = Signature.unpack(rec)
                qp.give_back(a.slot)
                op.taken = None
                self._fail(mismatch_error(self.mine, theirs), theirs)
                return
            self.agreed.add(p)
            if self.everyone:
                self.rows[p] = schedule_counts(rec, self.world)
            n = schedule_data(rec, self.world)
            if n is None:
                qp.give_back(a.slot)
            else:
                self.data[p] = (qp, a, n)   # its slot is given back once landed
            op.taken = None
        if self.everyone and len(self.rows) == self.world:
            differs = counts_difference(self.rows)
            if differs is not None:
                # Every rank holds the same matrix and names the same pair: no notice.
                self.error = CollectiveMismatchError.of("counts", *differs)
                return
        # Until the schedule expects another peer, only a notice can change the verdict.
        self.settled = len(self.agreed) == len(self.takes) and \
            (not self.everyone or len(self.rows) == self.world)

    def _fail(self, error: CollectiveMismatchError, theirs: Signature | None = None) -> None:
        self.error = error
        if theirs is None:
            return
        note = memoryview(theirs.pack() + self.mine.pack())
        self.notices = [self.engine.send(p, self.coll_id, STEP_MISMATCH, note)
                        for p in sorted(self.software) if p != theirs.rank]

    def ready(self, peer: int) -> bool:
        """Whether a receive from ``peer`` may land: its record (all-to-all-v: every
        rank's record, and the counts pair up) agreed."""
        if self.look() is not None:
            return False
        if self.everyone:
            return len(self.rows) == self.world
        return peer in self.agreed

    def missing(self, peer: int) -> int:
        """The rank whose record a receive from ``peer`` still waits for."""
        if self.everyone:
            return next((p for p in sorted(self.takes) if p not in self.agreed), peer)
        return peer

    def records(self) -> list[Record]:
        """Waitables for the record of every peer the schedule talked to."""
        return [Record(self, p) for p in self.takes]

    def release(self) -> None:
        """Give back the ring slots the check still holds (its call ended)."""
        for qp, a, _ in self.data.values():
            qp.give_back(a.slot)
        self.data.clear()
        for p, op in self.takes.items():
            if op.taken is not None:
                self.engine.by_peer[p].give_back(op.taken.slot)
                op.taken = None

    def run(self, body: Generator[Any, None, None]) -> Generator[Any, None, None]:
        """``body`` (the schedule, posting through a context that has this check), then
        the records of every peer it talked to; a mismatch raises once its notices are
        out, and the call's leftovers are dropped."""
        try:
            yield from body
            yield self.records()
            if self.look() is not None:
                raise self.error
        except CollectiveMismatchError:
            if self.error is None:
                raise
            # A rank whose process ends at once would leave the others to time out. A
            # peer that left before it ACKed one fails the transport (GeneratorExit):
            # the mismatch is still what to report.
            with contextlib.suppress(Exception, GeneratorExit):
                yield self.notices
            raise self.error from None
        except GeneratorExit:
            # The transport failed under the call (a peer that raised and left before
            # it ACKed our data): a mismatch known, or told, is still what to report.
            if self.look() is not None:
                raise self.error from None
            raise
        finally:
            if self.error is not None:
                # The world goes on after a mismatch: free what the call holds. (After
                # any other failure the engine is done; a credit now would only look
                # like progress to peers that wait out their own deadlines.)
                self.release()
                self.engine.forget_calls((self.coll_id,))


class Sent:
    """A schedule's send: done when ``real`` is; fails as soon as the call's mismatch
    is known (a notice), not only when the transport does."""

    __slots__ = ("check", "real")

    def __init__(self, check: ScheduleCheck, real: Completion) -> None:
        self.check = check
        self.real = real

    @property
    def peer(self) -> int:
        return self.real.peer

    @property
    def what(self) -> str:
        return self.real.what

    @property
    def error(self) -> BaseException | None:
        return self.check.look() or self.real.error

    @property
    def done(self) -> bool:
        return self.real.done


class Gated:
    """A schedule's receive from ``frm``, landed only once the check lets it: from the
    data inside ``frm``'s record (``first``: this rank's first receive from it), or
    posted to the engine; done when it has landed."""

    __slots__ = ("check", "dest", "first", "frm", "real", "step", "ufunc", "what_")

    def __init__(self, check: ScheduleCheck, frm: int, step: int, dest: np.ndarray,
                 ufunc: Any | None, what: str, first: bool) -> None:
        self.check = check
        self.frm = frm
        self.step = step
        self.dest = dest
        self.ufunc = ufunc
        self.what_ = what
        self.first = first
        self.real: Completion | None = None

    @property
    def peer(self) -> int:
        """Whom it waits on (a timeout names them): a record that has not come, else
        the sender."""
        return self.check.missing(self.frm) if self.real is None else self.frm

    @property
    def what(self) -> str:
        return "signature record" if self.real is None else f"message of step {self.step}"

    @property
    def error(self) -> BaseException | None:
        e = self.check.look()
        if e is not None:
            return e
        return None if self.real is None else self.real.error

    @property
    def done(self) -> bool:
        if self.real is None:
            check = self.check
            if not check.ready(self.frm):
                return False
            held = check.data.pop(self.frm, None) if self.first else None
            if held is None:
                self.real = check.engine.recv(self.frm, check.coll_id, self.step, self.dest,
                                              self.ufunc, self.what_)
                check.engine._match()   # the message may be in the ring already
            else:
                self.real = self._land(*held)
        return self.real.done

    def _land(self, qp: QueuePair, a: Arrival, n: int) -> Completion:
        done = Completion(0, self.frm, self.what_)
        try:
            if n != self.dest.nbytes or a.length != self.check.size + n:
                done.error = CountMismatchError(self.what_, f"peer {self.frm} sent {n} "
                                                f"bytes, {self.dest.nbytes} expected")
            else:
                start = a.slot * self.check.engine.slot_bytes + self.check.size
                land(self.dest, self.ufunc, 0, qp.ring.buf[start:start + n])
        finally:
            qp.give_back(a.slot)
        return done


class Record:
    """Done once ``peer``'s record has come and agreed (a timeout names it)."""

    __slots__ = ("check", "peer")
    what = "signature record"

    def __init__(self, check: ScheduleCheck, peer: int) -> None:
        self.check = check
        self.peer = peer

    @property
    def error(self) -> BaseException | None:
        return self.check.look()

    @property
    def done(self) -> bool:
        return self.check.look() is None and self.peer in self.check.agreed


__all__ = ["Gated", "Record", "ScheduleCheck", "Sent"]
