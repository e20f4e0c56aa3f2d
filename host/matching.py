"""Point-to-point matching: the receives the host schedules post (send/recv, all-to-all-v,
barrier, the ``tree`` algorithms), and the messages that arrived in the queue pairs'
receive rings handed to them, in arrival order per peer."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import numpy as np

from fpgaccl.errors import CountMismatchError, FpgacclError

from . import wire
from .qp import Arrival, Completion, QueuePair


class RecvOp:
    """A posted receive: where the messages of one transfer go and how they combine; or,
    without ``dest``, a take: the first message itself, its ring slot held (``taken``)
    until the taker gives it back."""

    __slots__ = ("coll_id", "completion", "dest", "nbytes", "off", "step", "taken", "ufunc",
                 "what")

    def __init__(self, coll_id: int, step: int, dest: np.ndarray | None, ufunc: Any | None,
                 completion: Completion, what: str) -> None:
        self.coll_id = coll_id
        self.step = step
        self.dest = dest
        self.nbytes = 0 if dest is None else dest.nbytes
        self.ufunc = ufunc
        self.off = 0
        self.completion = completion
        self.what = what
        self.taken: Arrival | None = None


def land(dest: np.ndarray, ufunc: Any | None, off: int, src: np.ndarray) -> None:
    """Bytes ``src`` of a transfer, at byte ``off`` of ``dest``: copied, or combined into
    it with ``ufunc``."""
    end = off + len(src)
    if ufunc is None:
        dest.view(np.uint8).reshape(-1)[off:end] = src
    else:
        isz = dest.itemsize
        d = dest[off // isz:end // isz]
        ufunc(d, src.view(dest.dtype), out=d)


class Matcher:
    """Posted receives for the queue pairs of ``by_peer`` (the engine's own dict), whose
    receive rings have slots of ``slot_bytes``."""

    def __init__(self, by_peer: dict[int, QueuePair], slot_bytes: int) -> None:
        self.by_peer = by_peer
        self.slot_bytes = slot_bytes
        self.posted: dict[int, list[RecvOp]] = {}
        self.takes_done = 0   # how many takes have been satisfied: a cheap "anything new?"

    def add_peer(self, peer: int) -> None:
        self.posted[peer] = []

    def post(self, peer: int, coll_id: int, step: int, dest: np.ndarray, ufunc: Any | None,
             what: str) -> Completion:
        comp = Completion(1, peer, f"message of step {step}")
        self.posted[peer].append(RecvOp(coll_id & 0xFFFF, step, dest, ufunc, comp, what))
        return comp

    def take(self, peer: int, coll_id: int, step: int, what: str) -> RecvOp:
        """Post a take of ``peer``'s next message of ``(coll_id, step)`` (one ring slot)."""
        op = RecvOp(coll_id & 0xFFFF, step, None, None, Completion(1, peer, what), what)
        self.posted[peer].append(op)
        return op

    def cancel(self, coll_ids: Collection[int]) -> None:
        """Withdraw the posted receives of calls ``coll_ids`` (they failed)."""
        for peer, posted in self.posted.items():
            if any(op.coll_id in coll_ids and op.step != wire.STEP_P2P for op in posted):
                self.posted[peer] = [op for op in posted
                                     if op.coll_id not in coll_ids or op.step == wire.STEP_P2P]

    def match(self) -> bool:
        """Hand arrived messages to posted receives; whether any was delivered."""
        delivered = False
        for peer, qp in self.by_peer.items():
            posted = self.posted[peer]
            if not qp.arrived or not posted:
                continue
            keep = []
            while qp.arrived:
                a = qp.arrived.popleft()
                step = a.step & ~wire.STEP_FINAL
                for op in posted:
                    if op.coll_id == a.coll_id and op.step == step:
                        break
                else:
                    keep.append(a)
                    continue
                delivered = True
                if op.dest is None:
                    op.taken = a
                    self.takes_done += 1
                    op.completion.finish_one()
                    posted.remove(op)
                    continue
                try:
                    self._deliver(qp, op, a)
                except FpgacclError as e:
                    op.completion.error = e
                    op.completion.done = True
                if op.completion.done:
                    posted.remove(op)
            qp.arrived.extendleft(reversed(keep))
        return delivered

    def _deliver(self, qp: QueuePair, op: RecvOp, a: Arrival) -> None:
        start = a.slot * self.slot_bytes
        src = qp.ring.buf[start:start + a.length]
        end = op.off + a.length
        try:
            if end > op.nbytes:
                raise CountMismatchError(op.what, f"peer {qp.peer} sent more than the "
                                         f"{op.nbytes} bytes expected")
            land(op.dest, op.ufunc, op.off, src)
            op.off = end
            if a.step & wire.STEP_FINAL:
                if op.off != op.nbytes:
                    raise CountMismatchError(op.what, f"peer {qp.peer} sent {op.off} bytes, "
                                             f"{op.nbytes} expected")
                op.completion.finish_one()
        finally:
            qp.give_back(a.slot)
