"""Turning user objects into flat, contiguous numpy views, and the reduction-op table.

Accepted: numpy arrays, anything with the buffer protocol, ``__array_interface__``,
DLPack (CPU) and ``__cuda_array_interface__`` (through :class:`GpuPeerWindow`).
Nothing is copied for host memory: the engine reads and writes the caller's bytes.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

from fpgaccl.errors import InvalidArgumentError, UnsupportedError

DTYPES: dict[str, np.dtype] = {
    "int8": np.dtype(np.int8), "int16": np.dtype(np.int16), "int32": np.dtype(np.int32),
    "int64": np.dtype(np.int64), "uint8": np.dtype(np.uint8), "uint16": np.dtype(np.uint16),
    "uint32": np.dtype(np.uint32), "uint64": np.dtype(np.uint64),
    "float16": np.dtype(np.float16), "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float32": np.dtype(np.float32), "float64": np.dtype(np.float64),
}
_SUPPORTED = {d: n for n, d in DTYPES.items()}

OPS: dict[str, Any] = {
    "sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum,
    "band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor,
}
INT_ONLY = frozenset({"band", "bor", "bxor"})
AVG = "avg"
"""SUM, then each element scaled once (:data:`fpgaccl.proto.reduce.AVG` says how); not in
:data:`OPS`, which maps the engine's own operators to their ufuncs."""


def dtype_name(dt: np.dtype) -> str:
    return _SUPPORTED[dt]


def check_dtype(dt: np.dtype, argument: str) -> None:
    if dt not in _SUPPORTED:
        raise UnsupportedError(argument, f"dtype {dt} is not one of {sorted(DTYPES)}")


def resolve_op(op: str, dt: np.dtype) -> Any:
    """The ufunc the engine reduces ``op`` with (avg: np.add, scaled afterwards)."""
    if isinstance(op, str) and op == AVG:
        return np.add
    if not isinstance(op, str) or op not in OPS:
        raise InvalidArgumentError("op", f"{op!r} is not one of {sorted([*OPS, AVG])}")
    if op in INT_ONLY and dt.kind not in "iu":
        raise UnsupportedError("op", f"{op} needs an integer dtype, not {dtype_name(dt)}")
    return OPS[op]


@dataclass
class UserBuffer:
    """A flat view of a user buffer plus what to do once the engine is done with it."""

    array: np.ndarray
    finish: Callable[[], None] | None = None  # copy-back for staged device memory
    device: str = "host"


class GpuPeerWindow:
    """Model of the engine's GPU-peer path (its BAR window onto device memory).

    On a GPU machine the engine DMAs straight to device memory; the host runtime only
    needs the address. Here that is modelled in two honest ways:

    * memory that declares ``__fpgaccl_peer_mappable__`` (such as :class:`DeviceArray`,
      a stand-in for device memory on a machine without a GPU) is mapped by address,
      exactly as the peer window would see it;
    * real CUDA memory is staged through host memory with cupy (if installed), since
      the software engine cannot dereference a device pointer.
    """

    @staticmethod
    def map(obj: Any, argument: str, writable: bool) -> UserBuffer:
        cai = obj.__cuda_array_interface__
        if getattr(obj, "__fpgaccl_peer_mappable__", False):
            return UserBuffer(_array_at(cai, argument), device="gpu-peer")
        try:
            import cupy  # type: ignore[import-not-found]
        except ImportError:
            raise UnsupportedError(argument, "CUDA memory needs cupy for staging on the "
                                   "software backend (the peer window is a model here)") from None
        dev = cupy.asarray(obj)
        if not dev.flags.c_contiguous:
            raise InvalidArgumentError(argument, "device buffer is not contiguous")
        host = cupy.asnumpy(dev).reshape(-1)

        def back() -> None:
            dev.reshape(-1).set(host)

        return UserBuffer(host, back if writable else None, device="gpu-staged")


def _array_at(cai: dict, argument: str) -> np.ndarray:
    dt = np.dtype(cai["typestr"])
    shape = tuple(cai["shape"])
    strides = cai.get("strides")
    if strides is not None and strides != _c_strides(shape, dt.itemsize):
        raise InvalidArgumentError(argument, "device buffer is not contiguous")
    ptr, _readonly = cai["data"]
    n = int(np.prod(shape)) if shape else 1
    raw = (ctypes.c_uint8 * (n * dt.itemsize)).from_address(ptr) if n else bytearray()
    return np.frombuffer(raw, dtype=np.uint8).view(dt)


def _c_strides(shape: tuple, itemsize: int) -> tuple:
    out, acc = [], itemsize
    for dim in reversed(shape):
        out.append(acc)
        acc *= dim
    return tuple(reversed(out))


class DeviceArray:
    """Stand-in for device memory: only ``__cuda_array_interface__``, no host buffer API."""

    __fpgaccl_peer_mappable__ = True

    def __init__(self, host: np.ndarray) -> None:
        self._mem = np.ascontiguousarray(host).copy()

    @property
    def __cuda_array_interface__(self) -> dict:
        return {"shape": self._mem.shape, "typestr": self._mem.dtype.str,
                "data": (self._mem.ctypes.data, False), "strides": None, "version": 3}

    def get(self) -> np.ndarray:
        return self._mem.copy()


def as_buffer(obj: Any, argument: str, *, writable: bool = False) -> UserBuffer:
    """A flat contiguous view of ``obj``; typed errors name ``argument`` otherwise."""
    if obj is None:
        raise InvalidArgumentError(argument, "no buffer given")
    if writable and isinstance(obj, np.generic):
        # np.asarray would copy it: the result would land in the copy, not in obj.
        raise InvalidArgumentError(argument, "a numpy scalar is immutable; pass an array")
    if hasattr(obj, "__cuda_array_interface__") and not isinstance(obj, np.ndarray):
        ub = GpuPeerWindow.map(obj, argument, writable)
    elif isinstance(obj, np.ndarray):
        ub = UserBuffer(obj)
    elif hasattr(obj, "__dlpack__") and hasattr(obj, "__dlpack_device__"):
        kind = int(obj.__dlpack_device__()[0])
        if kind == 1:  # kDLCPU
            ub = UserBuffer(np.from_dlpack(obj))
        elif kind == 2 and hasattr(obj, "__cuda_array_interface__"):
            ub = GpuPeerWindow.map(obj, argument, writable)
        else:
            raise UnsupportedError(argument, f"DLPack device type {kind} is not supported")
    elif hasattr(obj, "__array_interface__"):
        ub = UserBuffer(np.asarray(obj))
    else:
        try:
            mv = memoryview(obj)
        except TypeError:
            raise InvalidArgumentError(argument, f"{type(obj).__name__} is not a buffer") from None
        if not mv.contiguous:
            raise InvalidArgumentError(argument, "buffer is not contiguous")
        ub = UserBuffer(np.asarray(mv))
    arr = ub.array
    if not (arr.flags.c_contiguous or arr.flags.f_contiguous):
        raise InvalidArgumentError(argument, "buffer is not contiguous")
    if arr.ndim > 1 and not arr.flags.c_contiguous:
        raise InvalidArgumentError(argument, "Fortran-ordered buffer: pass it in C order "
                                   "(np.ascontiguousarray)")
    if writable and not arr.flags.writeable:
        raise InvalidArgumentError(argument, "buffer is read-only")
    check_dtype(arr.dtype, argument)
    ub.array = arr.reshape(-1)
    return ub
