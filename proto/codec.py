"""The lossless float codec of the wire (bf16, fp16, fp32), defined once.

The exponent of trained weights and gradients carries 2.5-3.3 bits of its 8, while sign
and mantissa are close to random (``bench/codec_data.py`` measures it on a real model).
So the codec codes only the exponents, per block, as fixed-width offsets against the
block's own base, and moves sign and mantissa raw. Every choice is made so that a
hardware unit can code one 512-bit beat per cycle: fixed block sizes in elements, every
field a fixed wiring of the element bits for each of the few widths ``k``, no entropy
coder, no state carried from one block to the next.

Stream
------
A vector of ``count`` elements is ``count // 64`` coded blocks of ``N = 64`` elements
each, then the ``count % 64`` remaining elements raw (little-endian, as in memory).
There is no stream header: the call knows the dtype and count. Each block starts with
its header, from which its length follows, so a receiver decodes the bytes in order as
they arrive and the transport cuts and resends them as any other payload.

Block (all sizes in bytes; ``E``/``M`` exponent/mantissa bits: bf16 8/7, fp16 5/10,
fp32 8/23; ``S = 1 + M`` sign-and-mantissa bits)::

    offset 0              byte   k | z << 4      k: bits 0..3, 0..E; z: bit 4; bits 5..7 zero
    offset 1              byte   base            below 2**E
    offset 2              S // 8 byte planes     plane p: byte p of sm[i] for i = 0..N-1
    then                  S % 8 bit planes       plane j: bit 8*(S//8) + j of sm[i]
    then                  k bit planes           plane j: bit j of code[i]

    block length = 2 + N*(S//8) + (N/8)*(S%8) + (N/8)*k
    bf16: 66 + 8k (raw 128)   fp16: 90 + 8k (raw 128)   fp32: 194 + 8k (raw 256)

A bit plane is N bits, N/8 bytes: element ``i``'s bit is bit ``i % 8`` of byte
``i // 8`` (LSB first: what x86 ``movemask`` writes). Element ``i`` of the block is the
unsigned integer ``x`` of its bits; ``e = (x >> M) & (2**E - 1)`` its exponent field and
``sm = (x >> (E + M)) << M | (x & (2**M - 1))`` its sign above its mantissa.

Exponent codes, by the header:

* ``k = 0``: every ``e`` is ``base`` (no planes).
* ``z = 0``: ``e = base + code``.
* ``z = 1``: ``code = 0`` is ``e = 0`` (zero or subnormal), else ``e = base + code - 1``:
  exact zeros (common in gradients) then do not widen the other exponents' range.

The encoder's choice is canonical, so that every implementation writes the same bytes:
if all ``e`` are equal, ``k = 0``, ``z = 0`` and ``base`` is that value; otherwise with
``lo``/``hi`` the least/greatest ``e`` and ``lo'`` the least non-zero one,
``k0 = bitlen(hi - lo)`` (``z = 0``, ``base = lo``) and ``k1 = bitlen(hi - lo' + 1)``
(``z = 1``, ``base = lo'``), taking ``z = 1`` only where ``k1 < k0``. ``k`` never exceeds
``E``: a block with all ``2**E`` exponent values in it costs its raw size plus the
2-byte header (1.6 % for bf16 and fp16, 0.8 % for fp32). Nothing of the value is
interpreted: NaN payloads, infinities, subnormals and -0.0 round-trip bit for bit.

Negotiation
-----------
A call says how its payload travels with a :class:`Codec` (4 bits; 0 = raw), resolved
from the user's ``compression`` ("off", "on", "auto") by :func:`choose_codec` from
what every rank of the call has alike (mode, dtype), so ranks agree without talking.
The field belongs in the call signature (``proto/signature.py``): its byte 30 holds
``kind`` in 3 bits, so ``codec << 4 | kind`` there leaves today's records (codec 0)
unchanged, puts the codec under the digest, and a mismatch names ``compression``. Not
yet done there: that module is being changed by the engine's owners.

A decoder rejects (:class:`~fpgaccl.errors.MalformedHeaderError`, header ``codec``) a
header with reserved bits set, ``k > E``, ``base >= 2**E``, ``z = 1`` with ``k = 0`` or
``base = 0`` (never written: ``base`` is then a non-zero exponent), a
code whose exponent would not fit ``E`` bits, and input that ends inside a block or goes
on past the last one.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import numpy as np

from fpgaccl.errors import InvalidArgumentError, MalformedHeaderError, UnsupportedError

from .reduce import DType

BLOCK = 64
"""Elements per coded block, for every dtype (measured: 32..128 within 1 % on real data)."""
HEADER_BYTES = 2
K_BITS = 4
Z_BIT = 4


class Codec(IntEnum):
    """How a call's payload is coded on the wire."""

    NONE = 0
    EXP_BLOCK64 = 1
    """This module's format: 64-element blocks, exponents against a per-block base."""


CODEC_BITS = 4
COMPRESSION_MODES = ("off", "on", "auto")


@dataclass(frozen=True)
class Format:
    """The block geometry of one dtype (see the module docstring)."""

    dtype: DType
    exp_bits: int
    man_bits: int

    @property
    def bits(self) -> int:
        return 1 + self.exp_bits + self.man_bits

    @property
    def sm_bits(self) -> int:
        return 1 + self.man_bits

    @property
    def sm_byte_planes(self) -> int:
        return self.sm_bits // 8

    @property
    def sm_bit_planes(self) -> int:
        return self.sm_bits % 8

    @property
    def raw_block_bytes(self) -> int:
        return BLOCK * self.bits // 8

    @property
    def fixed_bytes(self) -> int:
        """Header and sign/mantissa planes: the part of a block that does not depend on k."""
        return HEADER_BYTES + BLOCK * self.sm_byte_planes + BLOCK // 8 * self.sm_bit_planes

    def block_bytes(self, k: int) -> int:
        return self.fixed_bytes + BLOCK // 8 * k

    @property
    def max_block_bytes(self) -> int:
        return self.block_bytes(self.exp_bits)

    @property
    def uint(self) -> type[np.unsignedinteger]:
        return np.uint16 if self.bits == 16 else np.uint32


FORMATS = {
    DType.BFLOAT16: Format(DType.BFLOAT16, 8, 7),
    DType.FLOAT16: Format(DType.FLOAT16, 5, 10),
    DType.FLOAT32: Format(DType.FLOAT32, 8, 23),
}
_NAMES = {"bfloat16": DType.BFLOAT16, "bf16": DType.BFLOAT16, "float16": DType.FLOAT16,
          "fp16": DType.FLOAT16, "half": DType.FLOAT16, "float32": DType.FLOAT32,
          "fp32": DType.FLOAT32, "float": DType.FLOAT32}


def format_of(dtype: DType | str | np.dtype) -> Format:
    """The block format of ``dtype`` (a DType, a name, or a numpy dtype)."""
    if isinstance(dtype, DType):
        key: DType | None = dtype
    else:
        key = _NAMES.get(dtype if isinstance(dtype, str) else np.dtype(dtype).name)
    if key not in FORMATS:
        raise InvalidArgumentError("dtype", f"{dtype!r} is not a coded dtype "
                                   "(bfloat16, float16, float32)")
    return FORMATS[key]


def choose_codec(compression: str, dtype: DType | str | np.dtype) -> Codec:
    """The codec a call uses: "off" none; "on" this format, an error for a dtype it does
    not code; "auto" this format where the dtype is coded (bf16, fp16, fp32), else none."""
    if compression not in COMPRESSION_MODES:
        raise InvalidArgumentError("compression", f"{compression!r} is not one of "
                                   f"{', '.join(COMPRESSION_MODES)}")
    if compression == "off":
        return Codec.NONE
    try:
        format_of(dtype)
    except InvalidArgumentError:
        if compression == "on":
            raise UnsupportedError("compression", f"no codec for {dtype!r} (bfloat16, "
                                   "float16, float32 only)") from None
        return Codec.NONE
    return Codec.EXP_BLOCK64


def encoded_size_bound(count: int, dtype: DType | str | np.dtype) -> int:
    """The most bytes :func:`encode` writes for ``count`` elements."""
    f = format_of(dtype)
    return count // BLOCK * f.max_block_bytes + count % BLOCK * f.bits // 8


def _bits(array: np.ndarray, f: Format) -> np.ndarray:
    a = np.ascontiguousarray(array).reshape(-1)
    if a.dtype.itemsize * 8 != f.bits:
        raise InvalidArgumentError("array", f"{a.dtype} elements are not {f.bits}-bit "
                                   f"{f.dtype.name.lower()}")
    return a.view(f.uint)


def block_params(e: np.ndarray, exp_bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The canonical (k, z, base) of each row of exponent fields ``e`` (blocks x N)."""
    e = e.astype(np.int32)
    lo, hi = e.min(1), e.max(1)
    lo_nz = np.where(e == 0, 1 << exp_bits, e).min(1)
    k0 = _bitlen(hi - lo)
    k1 = np.where(lo_nz <= hi, _bitlen(hi - lo_nz + 1), exp_bits + 1)
    z = k1 < k0
    k = np.where(z, k1, k0)
    base = np.where(z, lo_nz, lo)
    return k, z, base


def _bitlen(v: np.ndarray) -> np.ndarray:
    return np.where(v > 0, np.floor(np.log2(np.maximum(v, 1))).astype(np.int32) + 1, 0)


def _planes(values: np.ndarray, first: int, n: int) -> np.ndarray:
    """Bit planes ``first .. first+n-1`` of each row's values: blocks x (n * N/8) bytes."""
    if n == 0:
        return np.zeros((values.shape[0], 0), np.uint8)
    shifts = np.arange(first, first + n, dtype=np.uint32)[None, :, None]
    bits = ((values[:, None, :].astype(np.uint32) >> shifts) & 1).astype(np.uint8)
    return np.packbits(bits, axis=2, bitorder="little").reshape(values.shape[0], -1)


def encode(array: np.ndarray, dtype: DType | str | np.dtype) -> bytes:
    """The coded bytes of ``array`` (any shape, read in C order) as ``dtype``."""
    f = format_of(dtype)
    x = _bits(array, f)
    nb = x.size // BLOCK
    tail = x[nb * BLOCK:]
    if nb == 0:
        return tail.astype(f"<u{f.bits // 8}").tobytes()
    X = x[:nb * BLOCK].reshape(nb, BLOCK).astype(np.uint32)
    M, E = f.man_bits, f.exp_bits
    e = (X >> M) & ((1 << E) - 1)
    sm = ((X >> (E + M)) << M) | (X & ((1 << M) - 1))
    k, z, base = block_params(e, E)
    ei = e.astype(np.int32)
    code = np.where(z[:, None], np.where(ei == 0, 0, ei - base[:, None] + 1),
                    ei - base[:, None]).astype(np.uint32)
    head = np.stack([(k | (z.astype(np.int32) << Z_BIT)), base], 1).astype(np.uint8)
    sm_bytes = [((sm >> (8 * p)) & 0xFF).astype(np.uint8) for p in range(f.sm_byte_planes)]
    full = np.concatenate([head, *sm_bytes, _planes(sm, 8 * f.sm_byte_planes, f.sm_bit_planes),
                           _planes(code, 0, E)], axis=1)
    length = f.fixed_bytes + BLOCK // 8 * k
    keep = np.arange(full.shape[1])[None, :] < length[:, None]
    return full[keep].tobytes() + tail.astype(f"<u{f.bits // 8}").tobytes()


def _malformed(field: str, message: str) -> MalformedHeaderError:
    return MalformedHeaderError("codec", field, message)


def block_offsets(data: bytes | np.ndarray, f: Format, blocks: int) -> np.ndarray:
    """Where each block starts and (last entry) where the raw tail starts; checks headers."""
    buf = np.frombuffer(data, np.uint8) if not isinstance(data, np.ndarray) else data
    offsets = np.empty(blocks + 1, np.int64)
    at, fixed, plane = 0, f.fixed_bytes, BLOCK // 8
    for b in range(blocks):
        offsets[b] = at
        if at + 1 >= buf.size:
            raise _malformed("length", f"input ends before block {b} of {blocks}")
        head, base = int(buf[at]), int(buf[at + 1])
        k = head & 0xF
        if head >> 5:
            raise _malformed("reserved", f"block {b}: reserved bits set in {head:#04x}")
        if k > f.exp_bits:
            raise _malformed("k", f"block {b}: k={k} exceeds {f.exp_bits} exponent bits")
        if base >> f.exp_bits:
            raise _malformed("base", f"block {b}: base {base} exceeds {f.exp_bits} bits")
        if head >> Z_BIT and (k == 0 or base == 0):
            raise _malformed("z", f"block {b}: z=1 with k={k}, base={base}")
        at += fixed + plane * k
    offsets[blocks] = at
    return offsets


def decode(data: bytes, dtype: DType | str | np.dtype, count: int) -> np.ndarray:
    """The ``count`` elements of ``dtype`` that :func:`encode` coded into ``data``."""
    f = format_of(dtype)
    if count < 0:
        raise InvalidArgumentError("count", f"{count} is negative")
    buf = np.frombuffer(data, np.uint8)
    nb, rest = divmod(count, BLOCK)
    offsets = block_offsets(buf, f, nb)
    tail_at = int(offsets[nb])
    if buf.size != tail_at + rest * f.bits // 8:
        raise _malformed("length", f"{buf.size} bytes where {nb} blocks end at {tail_at} and "
                         f"{rest} raw elements follow")
    out_dtype = f.dtype.numpy_dtype()
    tail = buf[tail_at:].view(f"<u{f.bits // 8}").astype(f.uint)
    if nb == 0:
        return tail.view(out_dtype)
    M, E = f.man_bits, f.exp_bits
    idx = offsets[:nb, None] + np.arange(f.max_block_bytes)[None, :]
    rows = buf[np.minimum(idx, buf.size - 1)]
    k = (rows[:, 0] & 0xF).astype(np.int32)
    z = (rows[:, 0] >> Z_BIT) & 1
    base = rows[:, 1].astype(np.int32)
    at = HEADER_BYTES
    sm = np.zeros((nb, BLOCK), np.uint32)
    for p in range(f.sm_byte_planes):
        sm |= rows[:, at:at + BLOCK].astype(np.uint32) << (8 * p)
        at += BLOCK
    plane = BLOCK // 8
    for j in range(f.sm_bit_planes):
        bits = np.unpackbits(rows[:, at:at + plane], axis=1, bitorder="little")
        sm |= bits.astype(np.uint32) << (8 * f.sm_byte_planes + j)
        at += plane
    code = np.zeros((nb, BLOCK), np.int32)
    for j in range(E):
        bits = np.unpackbits(rows[:, at:at + plane], axis=1, bitorder="little").astype(np.int32)
        code |= np.where((k > j)[:, None], bits, 0) << j
        at += plane
    zc = z[:, None] == 1
    e = np.where(zc & (code == 0), 0, base[:, None] + code - zc)
    if (bad := np.flatnonzero((e >= 1 << E).any(1))).size:
        raise _malformed("code", f"block {bad[0]}: an exponent code past {E} bits")
    x = ((sm >> M) << (E + M)) | (e.astype(np.uint32) << M) | (sm & ((1 << M) - 1))
    out = np.concatenate([x.reshape(-1).astype(f.uint), tail])
    return out.view(out_dtype)


def exponent_fields(array: np.ndarray, dtype: DType | str | np.dtype) -> np.ndarray:
    """The exponent field of every element (for measuring what the codec can save)."""
    f = format_of(dtype)
    return (_bits(array, f) >> f.man_bits) & ((1 << f.exp_bits) - 1)


__all__ = ["BLOCK", "CODEC_BITS", "COMPRESSION_MODES", "FORMATS", "HEADER_BYTES", "Codec",
           "Format", "block_offsets", "block_params", "choose_codec", "decode", "encode",
           "encoded_size_bound", "exponent_fields", "format_of"]
