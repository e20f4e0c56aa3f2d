"""The software engine's per-packet loops in C (``fastpath.c``), loaded through ctypes.

The engine is correct without it: every function here has a Python path beside it that
the tests run too, and the two give the same bytes. With it, a run of datagrams costs a
few calls instead of a few Python operations per datagram, and many datagrams go through
one system call (sendmmsg / recvmmsg), which Python's socket module does not offer.

The library is compiled on first use with the system's C compiler (``$CC``, else
``gcc`` or ``cc``; Python headers are not needed) into ``$FPGACCL_CACHE`` (default
``~/.cache/fpgaccl``), named by a digest of the source, so ranks that start together
share one build. ``FPGACCL_NATIVE=0`` turns it off. When it cannot be built or loaded,
:func:`load` returns None and :data:`reason` says why; the engine then uses Python.

The ICRC's CRC-32 is not reimplemented in C: the library calls the one the Python side
uses (ISA-L's ``crc32_gzip_refl``, or zlib's ``crc32``), checked against it at load.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import os
import shutil
import socket
import subprocess
import tempfile
import zlib
from pathlib import Path

from . import wire

SOURCE = Path(__file__).with_name("fastpath.c")
SLOT_BYTES = 65536  # one UDP datagram, or one GRO run of them, per receive slot
BATCH = 64  # messages per sendmmsg / recvmmsg (BATCH in fastpath.c)

reason = "not loaded yet"
_lib: Fastpath | None = None
_tried = False

_u8p = ctypes.c_void_p
_u32 = ctypes.c_uint32
_CRC = ctypes.CFUNCTYPE(ctypes.c_uint32, ctypes.c_uint32, ctypes.c_void_p, ctypes.c_uint64)


class SockaddrIn(ctypes.Structure):
    _fields_ = [("family", ctypes.c_ushort), ("port", ctypes.c_uint16),
                ("addr", ctypes.c_uint32), ("zero", ctypes.c_uint8 * 8)]


def sockaddr(addr: tuple[str, int]) -> SockaddrIn:
    """``struct sockaddr_in`` for an (IPv4, port) pair, in network byte order."""
    return SockaddrIn(socket.AF_INET, socket.htons(addr[1]),
                      int.from_bytes(socket.inet_aton(addr[0]), "little"))


_u64 = ctypes.c_uint64
_MAC8 = ctypes.c_uint8 * 8


class Bulk(ctypes.Structure):
    """``bulk_t`` of ``fastpath.c``: what :func:`fp_bulk` is given and gives back (the
    engine's ``Receiver.bulk`` fills and reads it; see ``fastpath.c`` for each field)."""

    _fields_ = [
        ("tx_fd", ctypes.c_int32), ("wake_fd", ctypes.c_int32), ("nfds", ctypes.c_int32),
        ("pad0", ctypes.c_int32), ("fds", ctypes.c_int32 * 16),
        ("rxbuf", _u64), ("lens", _u64), ("segs", _u64), ("addrs", _u64), ("ports", _u64),
        ("slot", _u32), ("nslots", _u32),
        ("bth_len", _u32), ("psn_mask", _u32), ("ackreq_bit", _u32), ("ack_syndrome", _u32),
        ("syn_shift", _u32), ("mtu", _u32),
        ("crc", _u64), ("deadline", ctypes.c_double), ("rto", ctypes.c_double),
        ("yields", _u64),
        ("rx_on", _u32), ("rx_seg", _u32), ("rx_addr", _u32), ("rx_port", _u32),
        ("rx_head", _MAC8), ("rx_state", _u32), ("epsn", _u32),
        ("rx_dst", _u64), ("rx_room", _u64), ("fold", _u64), ("fold_at", _u64),
        ("ack_head", _MAC8), ("ack_state", _u32), ("aeth", _u32), ("ack_dst", SockaddrIn),
        ("tx_on", _u32), ("per", _u32), ("tx_head", _MAC8),
        ("tx_state", _u32), ("next_psn", _u32), ("inflight", _u32), ("window", _u32),
        ("since", _u32), ("half", _u32),
        ("src", _u64), ("k_left", _u64), ("meta", _u64), ("sealed", _u64), ("sent", _u64),
        ("tx_dst", SockaddrIn), ("peer_ack_head", _MAC8),
        ("peer_ack_state", _u32), ("notify_on", _u32), ("notify_psn", _u32),
        ("acked", _u32), ("acked_psn", _u32), ("pad1", _u32),
        ("last_progress", ctypes.c_double),
        ("stop", _u32), ("r", _u32), ("j", _u32), ("part", _u32), ("ack_lost", _u32),
        ("sock_error", _u32),
        ("rx_taken", _u64), ("acks_tx", _u64), ("acks_rx", _u64), ("err", ctypes.c_int64),
    ]


BULK_FDS = 16
SOCKET_ERROR_BIT = 1 << 32  # fp_wait: a socket has an error queued
(BULK_WAKE, BULK_TIMER, BULK_BATCH, BULK_TX_DONE, BULK_ACKED, BULK_RX_ERROR, BULK_TX_ERROR,
 BULK_SOCKET_ERROR) = range(1, 9)


class Fastpath:
    """Typed entry points of the loaded library (see ``fastpath.c`` for each contract)."""

    def __init__(self, lib: ctypes.CDLL, crc: ctypes.c_void_p, crc_name: str) -> None:
        self.lib = lib
        self.crc = crc
        self.crc_name = crc_name
        self.seal_rows = lib.fp_seal_rows
        self.seal_rows.argtypes = [_u8p, _u32, _u32, ctypes.c_char_p, _u32, _u32, _u32, _u32,
                                   _u32, _u32, ctypes.c_void_p]
        self.seal_rows.restype = _u32
        self.seal_meta = lib.fp_seal_meta
        self.seal_meta.argtypes = [_u8p, _u32, _u8p, _u32, _u32, ctypes.c_char_p, _u32, _u32,
                                   _u32, _u32, _u32, _u32, ctypes.c_void_p]
        self.seal_meta.restype = _u32
        self.send_gather = lib.fp_send_gather
        self.send_gather.argtypes = [ctypes.c_int, _u8p, _u32, _u8p, _u32, _u32, _u32,
                                     ctypes.POINTER(SockaddrIn)]
        self.send_gather.restype = ctypes.c_int64
        self.take_runs = lib.fp_take_runs
        self.take_runs.argtypes = [_u8p, _u32, _u32, _u32, _u8p, _u8p, _u8p, _u8p, _u32, _u32,
                                   _u32, _u32, _u32, _u32, ctypes.c_void_p, _u8p,
                                   ctypes.c_uint64, ctypes.POINTER(_u32), ctypes.POINTER(_u32),
                                   ctypes.c_void_p, ctypes.c_uint64]
        self.take_runs.restype = ctypes.c_uint64
        self.fold = lib.fp_fold
        self.fold.argtypes = [ctypes.c_void_p, ctypes.c_uint64, _u8p, ctypes.c_uint64]
        self.fold.restype = ctypes.c_int
        self.send_rows = lib.fp_send_rows
        self.send_rows.argtypes = [ctypes.c_int, _u8p, _u32, _u32, _u32,
                                   ctypes.POINTER(SockaddrIn)]
        self.send_rows.restype = ctypes.c_int64
        self.recv_batch = lib.fp_recv_batch
        self.recv_batch.argtypes = [ctypes.c_int, _u8p, _u32, _u32, _u8p, _u8p, _u8p, _u8p]
        self.recv_batch.restype = ctypes.c_int
        self.bulk = lib.fp_bulk
        self.bulk.argtypes = [ctypes.POINTER(Bulk)]
        self.bulk.restype = ctypes.c_int
        self.wait = lib.fp_wait
        self.wait.argtypes = [ctypes.c_void_p, _u32, ctypes.c_uint64, ctypes.c_int32]
        self.wait.restype = ctypes.c_int64
        size = lib.fp_bulk_size
        size.restype = _u32
        if size() != ctypes.sizeof(Bulk):
            raise OSError(f"bulk_t is {size()} bytes, its ctypes mirror {ctypes.sizeof(Bulk)}")


def _crc_function() -> tuple[ctypes.c_void_p, str] | None:
    """The address of the CRC-32 the Python side uses, and its name."""
    try:
        from isal import isal_zlib
        lib = ctypes.CDLL(isal_zlib.__file__)
        return ctypes.cast(lib.crc32_gzip_refl, ctypes.c_void_p), "isal crc32_gzip_refl"
    except (ImportError, OSError, AttributeError):
        pass
    name = ctypes.util.find_library("z")
    if name is None:
        return None
    try:
        return ctypes.cast(ctypes.CDLL(name).crc32, ctypes.c_void_p), f"{name} crc32"
    except (OSError, AttributeError):
        return None


def _compiler() -> str | None:
    for cc in (os.environ.get("CC"), "gcc", "cc"):
        if cc and shutil.which(cc):
            return cc
    return None


def build_library(source: Path, stem: str, cc: str, opt: str = "-O2") -> Path:
    """``source`` compiled into a shared library in the user's cache, named after its
    content, machine and compiler (built once, then reused)."""
    src = source.read_bytes()
    digest = hashlib.sha256(src + os.uname().machine.encode() + cc.encode()).hexdigest()[:16]
    cache = Path(os.environ.get("FPGACCL_CACHE") or Path.home() / ".cache" / "fpgaccl")
    out = cache / f"{stem}-{digest}.so"
    if out.exists():
        return out
    cache.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
    os.close(fd)
    try:
        subprocess.run([cc, opt, "-shared", "-fPIC", "-o", tmp, str(source)], check=True,
                       capture_output=True, text=True, timeout=120)
        os.replace(tmp, out)  # atomic: ranks building at once all end with one good file
    except subprocess.CalledProcessError as e:
        raise OSError(f"{cc} failed: {e.stderr.strip()[-500:]}") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def open_library(source: Path, stem: str, opt: str = "-O2") -> tuple[ctypes.CDLL | None, str]:
    """``source`` built (see :func:`build_library`) and loaded, or None; and why not."""
    if os.environ.get("FPGACCL_NATIVE", "1") == "0":
        return None, "turned off by FPGACCL_NATIVE=0"
    cc = _compiler()
    if cc is None:
        return None, "no C compiler (set CC, or install gcc)"
    try:
        return ctypes.CDLL(str(build_library(source, stem, cc, opt))), "built"
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"could not build {source.name}: {e}"


def load() -> Fastpath | None:
    """The library, built if needed; None (see :data:`reason`) when unavailable."""
    global _lib, _tried, reason
    if _tried:
        return _lib
    _tried = True
    if os.environ.get("FPGACCL_NATIVE", "1") == "0":
        reason = "turned off by FPGACCL_NATIVE=0"
        return None
    crc = _crc_function()
    if crc is None:
        reason = "no CRC-32 library (ISA-L or zlib) to call"
        return None
    cdll, reason = open_library(SOURCE, "fastpath")
    if cdll is None:
        return None
    lib = Fastpath(cdll, *crc)
    probe = bytes(range(256)) * 5
    got = _CRC(crc[0].value)(0x1234, probe, len(probe))
    if got != zlib.crc32(probe, 0x1234) or got != wire.crc32(probe, 0x1234):
        reason = f"{crc[1]} does not compute zlib's CRC-32"
        return None
    _lib, reason = lib, f"loaded ({crc[1]})"
    return lib


__all__ = ["BATCH", "BULK_FDS", "SLOT_BYTES", "Bulk", "Fastpath", "SockaddrIn", "load", "reason",
           "sockaddr"]
