"""Devices the ``board`` backend can drive (:class:`fpgaccl.host.driver.Device`).

:class:`SimDevice` is the simulated board (:mod:`fpgaccl.sim.board`): the same DMA
node in Verilator, reached over a Unix socket. Each call is one request; register
writes are batched as a driver posts them. A PCIe board would implement the same five
calls over its BAR (mmap of the resource file), its pinned DMA buffers and the GPU
vendor's peer-memory pinning; no such card exists on this machine.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

from fpgaccl.errors import BackendUnavailableError, TransportError
from fpgaccl.proto.framing import connect_unix, encode, recv_frame

from .driver import PageEntry, Writes

BOARD_ENV = "FPGACCL_BOARD"
"""``sim:PATH``: the simulated board listening at PATH."""


class SimDevice:
    def __init__(self, path: str, node: int, *, timeout_s: float = 600.0) -> None:
        self.path, self.node = path, node
        self.sock = connect_unix(path, timeout_s, "simulated board")
        self.info, _ = self.call({"op": "hello", "node": node})
        self.gpu_va_base = int(self.info["gpu_va_base"])

    @classmethod
    def from_env(cls, node: int, spec: str | None = None) -> SimDevice:
        spec = spec or os.environ.get(BOARD_ENV, "")
        kind, _, path = spec.partition(":")
        if kind != "sim" or not path:
            raise BackendUnavailableError(
                f"backend 'board' found no board: no fpgaccl PCIe function is present, and "
                f"{BOARD_ENV}={spec!r} does not name a simulated one (sim:PATH; start it "
                f"with `python -m fpgaccl.sim.board --socket PATH`)")
        return cls(path, node)

    def call(self, header: dict, payload: bytes = b"") -> tuple[dict[str, Any], bytes]:
        try:
            self.sock.sendall(encode(header, payload))
            head, body = recv_frame(self.sock)
        except (OSError, ConnectionError) as e:
            raise TransportError(f"node {self.node}: simulated board lost: {e}") from e
        if "error" in head:
            raise BackendUnavailableError(f"simulated board: {head['error']}: "
                                          f"{head.get('detail', '')}")
        return head, body

    # The Device protocol ----------------------------------------------------------
    def csr_write(self, writes: Writes) -> None:
        if writes:
            self.call({"op": "csr_write", "writes": [[int(a), int(v)] for a, v in writes]})

    def csr_read(self, addr: int) -> int:
        return int(self.call({"op": "csr_read", "addr": addr})[0]["value"])

    def host_write(self, iova: int, data: bytes) -> None:
        self.call({"op": "host_write", "addr": iova}, bytes(data))

    def host_read(self, iova: int, n: int) -> bytes:
        return self.call({"op": "host_read", "addr": iova, "n": n})[1]

    def gpu_alloc(self, nbytes: int) -> int:
        return int(self.call({"op": "gpu_alloc", "nbytes": nbytes})[0]["va"])

    def gpu_write(self, va: int, data: bytes) -> None:
        self.call({"op": "gpu_write", "va": va}, bytes(data))

    def gpu_read(self, va: int, n: int) -> bytes:
        return self.call({"op": "gpu_read", "va": va, "n": n})[1]

    def gpu_pin(self, va: int, nbytes: int, *, write: bool) -> list[PageEntry]:
        head, _ = self.call({"op": "gpu_pin", "va": va, "nbytes": nbytes, "write": write})
        return [PageEntry(int(i), int(b), bool(r), bool(w)) for i, b, r, w in head["pages"]]

    def pause(self) -> None:
        self.call({"op": "pause"})

    def cycle(self) -> int:
        return int(self.call({"op": "stats"})[0]["cycle"])

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()
