"""The pcap file format (microsecond, Ethernet link type): a writer, a reader and a merge
by timestamp. Standard library only, below both users: the host runtime's captures
(:mod:`fpgaccl.host.pcap`) and the simulation's bridge (:mod:`fpgaccl.sim.bridge`), which
must not import the host."""

from __future__ import annotations

import heapq
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path

_GLOBAL = struct.Struct("<IHHiIII")
_RECORD = struct.Struct("<IIII")
PCAP_MAGIC_US = 0xA1B2C3D4
LINKTYPE_ETHERNET = 1


class PcapFile:
    """Writes one pcap file; safe to call from the engine thread while the host closes."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "wb")  # noqa: SIM115 - lives as long as the engine
        self._f.write(_GLOBAL.pack(PCAP_MAGIC_US, 2, 4, 0, 0, 65535, LINKTYPE_ETHERNET))
        self._lock = threading.Lock()

    def write(self, data: bytes, ts: float | None = None) -> None:
        ts = time.time() if ts is None else ts
        sec = int(ts)
        usec = int((ts - sec) * 1e6)
        with self._lock:
            if self._f.closed:
                return
            self._f.write(_RECORD.pack(sec, usec, len(data), len(data)) + data)

    def close(self) -> None:
        with self._lock:
            self._f.close()


def read(path: str | Path) -> Iterator[tuple[float, bytes]]:
    data = Path(path).read_bytes()
    magic = struct.unpack_from("<I", data)[0]
    if magic != PCAP_MAGIC_US:
        raise ValueError(f"{path}: not a little-endian microsecond pcap")
    pos = _GLOBAL.size
    while pos + _RECORD.size <= len(data):
        sec, usec, incl, _ = _RECORD.unpack_from(data, pos)
        pos += _RECORD.size
        yield sec + usec / 1e6, data[pos:pos + incl]
        pos += incl


def merge(inputs: list[Path], out: str | Path) -> int:
    """Merge per-rank captures into one, ordered by timestamp; returns the frame count."""
    w = PcapFile(out)
    n = 0
    try:
        for ts, data in heapq.merge(*(read(p) for p in inputs), key=lambda r: r[0]):
            w.write(data, ts)
            n += 1
    finally:
        w.close()
    return n
