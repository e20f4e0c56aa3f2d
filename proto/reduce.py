"""Element types and operators of the reduction unit, and what it computes.

This module is the single source of truth for the codes the host writes into the
reduction unit's ``dtype``/``op`` registers, and :func:`reduce_reference` is the
executable definition of its result. The HDL (:mod:`fpgaccl.hw.reduce`) is verified
bit-exact against it, and the software backend can use it as its arithmetic.

Semantics (element-wise over ``a`` and ``b``, both laid out little-endian in the beat):

* integers: two's complement, results wrap modulo ``2**bits`` (numpy's behaviour for
  ``+`` and ``*``); ``band``/``bor``/``bxor`` act on the raw bits; min/max compare signed
  or unsigned as the type says.
* floats: IEEE 754 binary formats with round-to-nearest-even, subnormals kept as inputs
  and outputs (no flush-to-zero), overflow to infinity, ``x + (-x) = +0``. This is what
  numpy gives for ``a + b`` / ``a * b`` (float16 and bfloat16 numpy compute in float32
  and round once more; that double rounding is innocuous because 24 >= 2*11 + 2).
* min/max on floats: NaN propagates (``np.minimum``/``np.maximum`` semantics). For
  ``+0`` against ``-0`` numpy's answer depends on the argument order (and on the dtype);
  a reduction has to be commutative, so we follow IEEE 754-2019 ``minimum``/``maximum``
  instead: ``-0 < +0``.
* NaN results: if ``a`` is NaN the result is ``a`` made quiet, else if ``b`` is NaN it
  is ``b`` made quiet, else (``inf - inf``, ``0 * inf``) the default NaN with the sign bit
  set. That is the x86 SSE rule numpy exhibits for float32/float64 ``+``/``*`` on x86
  hosts; numpy's float16 prefers ``b``'s payload when both are NaN and ml_dtypes'
  bfloat16 returns a canonical NaN, so numpy itself has no one rule. Whether a result is
  NaN always agrees with numpy; the payload is fixed here, for every op and host, so the
  hardware can be checked bit for bit, payload included.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class DType(enum.IntEnum):
    """Element type codes, as written to the ``dtype`` register."""

    INT8 = 0
    INT16 = 1
    INT32 = 2
    INT64 = 3
    UINT8 = 4
    UINT16 = 5
    UINT32 = 6
    UINT64 = 7
    FLOAT16 = 8
    BFLOAT16 = 9
    FLOAT32 = 10
    FLOAT64 = 11

    @property
    def info(self) -> DTypeInfo:
        return _INFO[self]

    @property
    def bits(self) -> int:
        return _INFO[self].bits

    @property
    def is_float(self) -> bool:
        return _INFO[self].kind == "float"

    @property
    def is_signed(self) -> bool:
        return _INFO[self].kind in ("int", "float")

    @property
    def numpy_name(self) -> str:
        return _INFO[self].numpy_name

    def numpy_dtype(self):
        """The numpy dtype (bfloat16 from ``ml_dtypes``)."""
        import numpy as np
        if self is DType.BFLOAT16:
            import ml_dtypes
            return np.dtype(ml_dtypes.bfloat16)
        return np.dtype(self.numpy_name)

    @classmethod
    def from_numpy(cls, dtype) -> DType:
        import numpy as np
        name = np.dtype(dtype).name
        for d, info in _INFO.items():
            if info.numpy_name == name:
                return d
        raise ValueError(f"no reduction dtype for numpy {name}")


@dataclass(frozen=True)
class DTypeInfo:
    bits: int
    kind: str            # "int", "uint" or "float"
    numpy_name: str
    exp_bits: int = 0    # floats only
    frac_bits: int = 0   # floats only, without the hidden bit


_INFO: dict[DType, DTypeInfo] = {
    DType.INT8: DTypeInfo(8, "int", "int8"),
    DType.INT16: DTypeInfo(16, "int", "int16"),
    DType.INT32: DTypeInfo(32, "int", "int32"),
    DType.INT64: DTypeInfo(64, "int", "int64"),
    DType.UINT8: DTypeInfo(8, "uint", "uint8"),
    DType.UINT16: DTypeInfo(16, "uint", "uint16"),
    DType.UINT32: DTypeInfo(32, "uint", "uint32"),
    DType.UINT64: DTypeInfo(64, "uint", "uint64"),
    DType.FLOAT16: DTypeInfo(16, "float", "float16", 5, 10),
    DType.BFLOAT16: DTypeInfo(16, "float", "bfloat16", 8, 7),
    DType.FLOAT32: DTypeInfo(32, "float", "float32", 8, 23),
    DType.FLOAT64: DTypeInfo(64, "float", "float64", 11, 52),
}


class ReduceOp(enum.IntEnum):
    """Operator codes, as written to the ``op`` register."""

    SUM = 0
    PROD = 1
    MIN = 2
    MAX = 3
    BAND = 4
    BOR = 5
    BXOR = 6

    @classmethod
    def from_name(cls, name: str) -> ReduceOp:
        try:
            return cls[name.upper()]
        except KeyError:
            raise ValueError(f"unknown reduction op {name!r}") from None


DTYPE_BITS = 4   # the dtype field of ctrl.reduce and of the reduction unit's context
OP_BITS = 3      # the op field likewise
assert max(DType).bit_length() <= DTYPE_BITS and max(ReduceOp).bit_length() <= OP_BITS

BITWISE_OPS = frozenset({ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR})


def is_supported(dtype: DType, op: ReduceOp) -> bool:
    """Bitwise ops are defined on integers only; everything else on every type."""
    return not (DType(dtype).is_float and ReduceOp(op) in BITWISE_OPS)


SUPPORTED: tuple[tuple[DType, ReduceOp], ...] = tuple(
    (d, o) for d in DType for o in ReduceOp if is_supported(d, o))


def _uint_view(dtype: DType):
    import numpy as np
    return np.dtype(f"uint{DType(dtype).bits}")


def nan_fixup(dtype: DType, a, b, result):
    """Apply the NaN rule of the module docstring to ``result`` (arrays of ``dtype``)."""
    import numpy as np
    info = DType(dtype).info
    u = _uint_view(dtype)
    quiet = u.type(1 << (info.frac_bits - 1))
    default = u.type(((1 << (info.exp_bits + 2)) - 1) << (info.frac_bits - 1))
    ab, bb, rb = (np.asarray(x).view(u) for x in (a, b, result))
    a_nan, b_nan, r_nan = (np.isnan(np.asarray(x)) for x in (a, b, result))
    out = np.where(a_nan, ab | quiet, np.where(b_nan, bb | quiet, default))
    return np.where(r_nan, out, rb).astype(u).view(np.asarray(result).dtype)


def reduce_reference(dtype: DType, op: ReduceOp, a, b):
    """What the reduction unit computes for one pair of element vectors.

    ``a`` and ``b`` are numpy arrays (or anything ``np.asarray`` accepts) of ``dtype``'s
    numpy type; the result has that type too.
    """
    import numpy as np
    dtype, op = DType(dtype), ReduceOp(op)
    if not is_supported(dtype, op):
        raise ValueError(f"{op.name.lower()} is not defined for {dtype.name.lower()}")
    nt = dtype.numpy_dtype()
    a = np.asarray(a, dtype=nt)
    b = np.asarray(b, dtype=nt)
    if op in BITWISE_OPS:
        fn = {ReduceOp.BAND: np.bitwise_and, ReduceOp.BOR: np.bitwise_or,
              ReduceOp.BXOR: np.bitwise_xor}[op]
        return fn(a, b)
    if not dtype.is_float:
        with np.errstate(over="ignore"):
            fn = {ReduceOp.SUM: np.add, ReduceOp.PROD: np.multiply,
                  ReduceOp.MIN: np.minimum, ReduceOp.MAX: np.maximum}[op]
            return fn(a, b).astype(nt)
    with np.errstate(all="ignore"):
        if op is ReduceOp.SUM:
            r = (a + b).astype(nt)
        elif op is ReduceOp.PROD:
            r = (a * b).astype(nt)
        else:
            # -0 < +0 (see the module docstring): order by sign where the values tie.
            a_neg = np.signbit(a)
            if op is ReduceOp.MIN:
                pick_a = (a < b) | ((a == b) & a_neg)
            else:
                pick_a = (a > b) | ((a == b) & ~a_neg)
            r = np.where(pick_a, a, b).astype(nt)
            r = np.where(np.isnan(a) | np.isnan(b), np.array(np.nan, dtype=nt), r).astype(nt)
    return nan_fixup(dtype, a, b, r)


def reduce_bytes(dtype: DType, op: ReduceOp, a: bytes, b: bytes) -> bytes:
    """:func:`reduce_reference` on little-endian packed buffers (as on the wire)."""
    import numpy as np
    nt = DType(dtype).numpy_dtype().newbyteorder("<")
    if len(a) != len(b) or len(a) % nt.itemsize:
        raise ValueError("buffers must have the same length, a multiple of the element size")
    r = reduce_reference(dtype, op, np.frombuffer(a, nt), np.frombuffer(b, nt))
    return np.asarray(r).astype(nt).tobytes()


AVG = "avg"
"""``op="avg"``: the engine runs SUM, then every element is scaled once, by
:func:`average_reference` -- the single definition every backend applies (after the
program's last step, on the host: the reduction unit has no scaling stage yet).

* floats: ``sum * r`` with ``r = 1/n`` rounded to the dtype (nearest even), and the
  product rounded to the dtype: exactly ``reduce_reference(PROD, sum, r)``, NaN rule
  included, so the reduction unit's multiplier can take this step over bit for bit.
  (Not ``sum / n``: for n not a power of two the two differ in the last bit now and then.)
* integers: the wrapped sum divided by ``n`` rounding toward zero (C's ``/``, NCCL's and
  ``torch.div(rounding_mode="trunc")``); unsigned types simply floor."""


def average_scale(dtype: DType, n: int):
    """The float multiplier of :data:`AVG`: ``1/n`` rounded to ``dtype``."""
    import numpy as np
    return np.asarray(1.0 / n, dtype=np.float64).astype(DType(dtype).numpy_dtype())


def average_reference(dtype: DType, summed, n: int):
    """:data:`AVG`'s result from the SUM ``summed`` (an array of ``dtype``) of ``n`` ranks."""
    import numpy as np
    dtype = DType(dtype)
    if n < 1:
        raise ValueError(f"n: an average over {n} ranks")
    nt = dtype.numpy_dtype()
    s = np.asarray(summed, dtype=nt)
    if dtype.is_float:
        return reduce_reference(dtype, ReduceOp.PROD, s,
                                np.full(s.shape, average_scale(dtype, n), nt))
    # Wide enough for n whatever the element type (the quotient fits the type again).
    wide = s.astype(np.int64) if dtype.bits < 64 else s
    q = wide // wide.dtype.type(n)
    if dtype.is_signed:
        q = q + ((q * wide.dtype.type(n) != wide) & (wide < 0))
    return q.astype(nt)
