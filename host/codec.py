"""The block codec of :mod:`fpgaccl.proto.codec` in C (``codec.c``), loaded through ctypes.

Same bytes as the reference, at memory speed: a block is coded from a few registers
(AVX2 for bfloat16, a generic loop for float16/float32 and CPUs without AVX2). The
library is built on first use like ``fastpath.c`` (:mod:`fpgaccl.host.native`): the
system's C compiler, into ``$FPGACCL_CACHE`` (default ``~/.cache/fpgaccl``), named by a
digest of the source; ``FPGACCL_NATIVE=0`` turns it off. When it cannot be built,
:func:`load` returns None and :data:`reason` says why; :func:`encode`/:func:`decode`
then fall back to the numpy reference.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np

from fpgaccl.errors import InvalidArgumentError, MalformedHeaderError
from fpgaccl.proto import codec as ref
from fpgaccl.proto.reduce import DType

from .native import open_library

SOURCE = Path(__file__).with_name("codec.c")
_ERRORS = {-1: "length", -2: "reserved", -3: "k", -4: "base", -5: "z", -6: "code", -7: "length"}

reason = "not loaded yet"
_lib: ctypes.CDLL | None = None
_tried = False


def load() -> ctypes.CDLL | None:
    """The library, built if needed; None (see :data:`reason`) when unavailable."""
    global _lib, _tried, reason
    if _tried:
        return _lib
    _tried = True
    lib, reason = open_library(SOURCE, "codec", "-O3")
    if lib is None:
        return None
    if lib.cc_block() != ref.BLOCK:
        reason = f"{SOURCE.name} codes blocks of {lib.cc_block()}, proto of {ref.BLOCK}"
        return None
    i, u64, p = ctypes.c_int, ctypes.c_uint64, ctypes.c_void_p
    lib.cc_encode.argtypes = [i, i, i, p, u64, p]
    lib.cc_encode.restype = ctypes.c_int64
    lib.cc_decode.argtypes = [i, i, i, p, u64, u64, p, ctypes.POINTER(u64)]
    lib.cc_decode.restype = ctypes.c_int64
    lib.cc_set_vector.argtypes = [i]
    _lib, reason = lib, "loaded (vector path: " + ("AVX2" if lib.cc_vector() else "none") + ")"
    return lib


def set_vector(on: bool) -> bool:
    """Use the AVX2 path where the CPU has it (True) or only the generic one; returns the
    previous setting. For tests, which hold both paths to the reference's bytes."""
    lib = load()
    return bool(lib.cc_set_vector(int(on))) if lib is not None else False


def encode(array: np.ndarray, dtype: DType | str | np.dtype,
           out: np.ndarray | None = None) -> memoryview:
    """:func:`fpgaccl.proto.codec.encode`, written into ``out`` (uint8, at least
    :func:`~fpgaccl.proto.codec.encoded_size_bound` bytes) or a new buffer."""
    f = ref.format_of(dtype)
    a = np.ascontiguousarray(array).reshape(-1)
    ref._bits(a, f)  # the reference's argument checks
    bound = ref.encoded_size_bound(a.size, f.dtype)
    if out is None:
        out = np.empty(bound, np.uint8)
    elif out.dtype != np.uint8 or out.size < bound or not out.flags.c_contiguous:
        raise InvalidArgumentError("out", f"needs {bound} contiguous uint8 bytes")
    lib = load()
    if lib is None:
        data = ref.encode(a, f.dtype)
        out[:len(data)] = np.frombuffer(data, np.uint8)
        return memoryview(out)[:len(data)]
    n = lib.cc_encode(f.bits, f.exp_bits, f.man_bits, a.ctypes.data, a.size, out.ctypes.data)
    return memoryview(out)[:n]


def decode(data: bytes | memoryview | np.ndarray, dtype: DType | str | np.dtype, count: int,
           out: np.ndarray | None = None) -> np.ndarray:
    """:func:`fpgaccl.proto.codec.decode`, into ``out`` (``count`` elements) or a new array;
    the same :class:`MalformedHeaderError` (header ``codec``) for bad input."""
    f = ref.format_of(dtype)
    lib = load()
    if lib is None:
        got = ref.decode(bytes(data), f.dtype, count)
        if out is None:
            return got
        out.reshape(-1).view(f.uint)[:] = got.view(f.uint)
        return out
    if count < 0:
        raise InvalidArgumentError("count", f"{count} is negative")
    buf = np.frombuffer(data, np.uint8) if not isinstance(data, np.ndarray) else data
    if out is None:
        out = np.empty(count, f.dtype.numpy_dtype())
    elif out.size != count or out.dtype.itemsize != f.bits // 8 or not out.flags.c_contiguous:
        raise InvalidArgumentError("out", f"needs {count} contiguous {f.bits}-bit elements")
    where = ctypes.c_uint64()
    r = lib.cc_decode(f.bits, f.exp_bits, f.man_bits, buf.ctypes.data, buf.size, count,
                      out.ctypes.data, ctypes.byref(where))
    if r < 0:
        raise MalformedHeaderError("codec", _ERRORS.get(r, "format"),
                                   f"block {where.value}: rejected ({r})")
    return out


__all__ = ["SOURCE", "decode", "encode", "load", "reason", "set_vector"]
