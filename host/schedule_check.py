"""The call signature check of a host schedule (:mod:`fpgaccl.host.algorithms`), on the
engine thread: schedules send no GRANT to carry a digest, so each rank sends every peer
it talks to a schedule record (:func:`fpgaccl.proto.signature.schedule_record`) ahead
of its data, and lands a peer's data only once that peer's record agrees.

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
from collections.abc import Callable, Generator, Sequence
from typing import Any

import numpy as np

from fpgaccl.errors import CollectiveMismatchError
from fpgaccl.proto.signature import (
    RECORD,
    STEP_MISMATCH,
    STEP_RECORD,
    Signature,
    counts_difference,
    digest_only,
    schedule_counts,
    schedule_record,
    schedule_record_bytes,
)

from .engine import Engine
from .executor import digest_mismatch_error, mismatch_error, take_notice
from .qp import Completion


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
        self.record = memoryview(schedule_record(mine, world, *(counts or ())))
        self.everyone = counts is not None
        self.rows: dict[int, tuple[Sequence[int], Sequence[int]]] = \
            {mine.rank: counts} if counts is not None else {}
        self.met: dict[int, tuple[Completion, np.ndarray]] = {}
        self.agreed: set[int] = set()
        self.error: CollectiveMismatchError | None = None
        self.notices: list[Completion] = []
        self.seen = -1
        self.settled = False   # every record met has come and agreed
        self.rings = [q for p in sorted(software) if (q := engine.by_peer.get(p))]
        engine.dead_colls.discard(self.coll_id)   # an id reused after 2**16 calls
        if self.everyone:
            for p in range(world):
                if p != mine.rank:
                    self.meet(p)

    def meet(self, peer: int) -> None:
        """The schedule talks to ``peer``: send it this rank's record (once) and post a
        receive for its own."""
        if peer in self.met:
            return
        self.settled = False
        buf = np.empty(schedule_record_bytes(self.world), np.uint8)
        got = self.engine.recv(peer, self.coll_id, STEP_RECORD, buf, None, "signature record")
        self.met[peer] = (got, buf)
        self.engine.send(peer, self.coll_id, STEP_RECORD, self.record)

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
                    self.error = _notice_error(buf)
                    break
        return self.error

    def _compare(self) -> None:
        """Compare the records that came since the last look."""
        for p, (got, buf) in self.met.items():
            if p in self.agreed or not got.done:
                continue
            if got.error is not None:   # not a record of this world's shape
                self._fail(digest_mismatch_error(p, 0, self.mine.rank, self.mine.digest))
                return
            theirs = Signature.unpack(buf)
            if theirs.digest != self.mine.digest:
                self._fail(mismatch_error(self.mine, theirs), theirs)
                return
            self.agreed.add(p)
            if self.everyone:
                self.rows[p] = schedule_counts(buf, self.world)
        if self.everyone and len(self.rows) == self.world:
            differs = counts_difference(self.rows)
            if differs is not None:
                # Every rank holds the same matrix and names the same pair: no notice.
                self.error = CollectiveMismatchError.of("counts", *differs)
                return
        # Until the schedule meets another peer, only a notice can change the verdict.
        self.settled = len(self.agreed) == len(self.met) and \
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
            return next((p for p in sorted(self.met) if p not in self.agreed), peer)
        return peer

    def sent(self, peer: int, post: Callable[[], Completion]) -> Sent:
        self.meet(peer)
        return Sent(self, post())

    def gated(self, peer: int, post: Callable[[], Completion]) -> Gated:
        self.meet(peer)
        return Gated(self, peer, post)

    def records(self) -> list[Record]:
        """Waitables for the record of every peer the schedule talked to."""
        return [Record(self, p) for p in self.met]

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
                self.engine.forget_calls((self.coll_id,))


class Gated:
    """A schedule's receive from ``peer``, posted (``post``) only once the check lets
    it land; done when that receive is."""

    __slots__ = ("check", "frm", "post", "real")

    def __init__(self, check: ScheduleCheck, peer: int, post: Callable[[], Completion]) -> None:
        self.check = check
        self.frm = peer
        self.post = post
        self.real: Completion | None = None

    @property
    def peer(self) -> int:
        """Whom it waits on (a timeout names them): a record that has not come, else
        the sender."""
        if self.real is None:
            return self.check.missing(self.frm)
        return self.frm

    @property
    def what(self) -> str:
        return "message" if self.real is not None else "signature record"

    @property
    def error(self) -> BaseException | None:
        e = self.check.look()
        if e is not None:
            return e
        return None if self.real is None else self.real.error

    @property
    def done(self) -> bool:
        if self.real is None:
            if not self.check.ready(self.frm):
                return False
            self.real = self.post()
            self.check.engine._match()   # the message may be in the ring already
        return self.real.done


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


def _notice_error(buf: np.ndarray) -> CollectiveMismatchError:
    first, second = buf[:RECORD.size], buf[RECORD.size:]
    about, theirs = digest_only(first), digest_only(second)
    if about is None and theirs is None:
        return mismatch_error(Signature.unpack(first), Signature.unpack(second))
    a = about or (Signature.unpack(first).digest, Signature.unpack(first).rank)
    b = theirs or (Signature.unpack(second).digest, Signature.unpack(second).rank)
    return digest_mismatch_error(a[1], a[0], b[1], b[0])


__all__ = ["Gated", "Record", "ScheduleCheck", "Sent"]
