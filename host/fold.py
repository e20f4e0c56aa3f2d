"""Reduce-on-receive: a RECV_REDUCE's payload folded into its destination as it lands.

The DESIGN's data flow has the receive side route a RECV_REDUCE's payload through the
reduction unit rather than to memory first. The software engine does the same where the
C fast path can (``fp_fold`` in ``fastpath.c``): when the sequencer reaches a RECV_REDUCE
whose message has not landed yet, it arms a :class:`Fold` on that peer's queue pair, and
the MIDDLE packets of the matching WRITE are checked as always and then reduced straight
from the receive buffer into the destination (``out = a op payload``). The landing buffer
is never written or read for them: a 64 MiB ring allreduce moves 48 MiB less through
memory on each rank.

What is folded is a prefix of the message; whatever lands another way (its FIRST and
LAST packets, the Python path, packets before the fold was armed) lands in memory as
before, and the sequencer reduces that part when the message is complete. The reduction
is elementwise, so the result is the same bytes either way: the tests check ``fp_fold``
against :func:`fpgaccl.proto.reduce.reduce_reference`, NaN rule included.
"""

from __future__ import annotations

import ctypes

import numpy as np

from fpgaccl.proto.reduce import DType, ReduceOp

# fastpath.c's FOLD_* kinds. Wrapping sums are the same bits for signed and unsigned.
KINDS: dict[tuple[DType, ReduceOp], int] = {
    (DType.FLOAT32, ReduceOp.SUM): 1,
    (DType.FLOAT64, ReduceOp.SUM): 2,
    (DType.INT32, ReduceOp.SUM): 3,
    (DType.UINT32, ReduceOp.SUM): 3,
    (DType.INT64, ReduceOp.SUM): 4,
    (DType.UINT64, ReduceOp.SUM): 4,
}


class FoldSpec(ctypes.Structure):
    """``fold_t`` of fastpath.c."""

    _fields_ = [("a", ctypes.c_uint64), ("out", ctypes.c_uint64), ("quiet", ctypes.c_uint64),
                ("dflt", ctypes.c_uint64), ("kind", ctypes.c_uint32), ("pad", ctypes.c_uint32)]


def _nan_bits(dtype: DType) -> tuple[int, int]:
    """The quiet bit and the default NaN of a float dtype (proto.reduce's NaN rule)."""
    info = dtype.info
    if info.kind != "float":
        return 0, 0
    return 1 << (info.frac_bits - 1), ((1 << (info.exp_bits + 2)) - 1) << (info.frac_bits - 1)


def _address(x: np.ndarray) -> int:
    return x.__array_interface__["data"][0]


class Fold:
    """An armed RECV_REDUCE: the WRITE of ``nbytes`` landing at address ``land`` is
    reduced into ``out`` as ``out = a op payload``. ``done``: bytes of the message
    folded so far, always a prefix."""

    __slots__ = ("_a", "_out", "done", "land", "nbytes", "ref", "spec")

    def __init__(self, kind: int, dtype: DType, a: np.ndarray, land: np.ndarray,
                 out: np.ndarray) -> None:
        self._a, self._out = a, out  # kept alive while armed
        quiet, dflt = _nan_bits(dtype)
        self.spec = FoldSpec(_address(a), _address(out), quiet, dflt, kind, 0)
        self.ref = ctypes.byref(self.spec)
        self.land = _address(land)
        self.nbytes = land.nbytes
        self.done = 0

    def lands_at(self, addr: int, nbytes: int) -> bool:
        """Whether a WRITE of ``nbytes`` to ``addr`` is this fold's message, not yet
        folded into."""
        return self.done == 0 and self.land == addr and self.nbytes == nbytes

    @classmethod
    def make(cls, dtype: DType, op: ReduceOp, a: np.ndarray, land: np.ndarray,
             out: np.ndarray) -> Fold | None:
        """A fold for ``out = reduce(a, land)``, or None where ``fp_fold`` has no such
        reduction or the arrays are not three contiguous vectors of one length."""
        kind = KINDS.get((dtype, op))
        if kind is None or not (a.size == land.size == out.size > 0):
            return None
        if not all(x.flags.c_contiguous and x.flags.aligned for x in (a, land, out)):
            return None  # (fp_fold's vectors step whole elements from out's alignment)
        # fp_fold works block by block: out may be a itself (or land, for the part that
        # landed in memory), but not overlap either at an offset. A folded payload never
        # lands, so a must not overlap land at all: the reference reads a after landing.
        o = _address(out)
        if any(np.may_share_memory(x, out) and _address(x) != o for x in (a, land)):
            return None
        if np.may_share_memory(a, land):
            return None
        return cls(kind, dtype, a, land, out)


__all__ = ["KINDS", "Fold", "FoldSpec"]
