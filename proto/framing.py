"""The request/response framing that the simulation servers and their clients share.

One frame, either direction: ``>II`` (header length, payload length), a UTF-8 JSON
header, then the raw payload. Requests name their operation in ``header["op"]``;
replies carry ``ok`` or ``error`` and ``detail``. The operations themselves belong to
each server (:mod:`fpgaccl.sim.server`, :mod:`fpgaccl.sim.board`).
"""

from __future__ import annotations

import json
import socket
import struct
import time

from fpgaccl.errors import BackendUnavailableError

HEAD = struct.Struct(">II")


def encode(header: dict, payload: bytes = b"") -> bytes:
    head = json.dumps(header).encode()
    return HEAD.pack(len(head), len(payload)) + head + payload


class FrameReader:
    """Incremental decoder for a non-blocking reader (a server's select loop)."""

    def __init__(self) -> None:
        self.buf = bytearray()

    def feed(self, data: bytes) -> list[tuple[dict, bytes]]:
        self.buf += data
        out = []
        while len(self.buf) >= HEAD.size:
            hl, pl = HEAD.unpack_from(self.buf)
            end = HEAD.size + hl + pl
            if len(self.buf) < end:
                break
            head = json.loads(bytes(self.buf[HEAD.size:HEAD.size + hl]))
            out.append((head, bytes(self.buf[HEAD.size + hl:end])))
            del self.buf[:end]
        return out


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise ConnectionError("the server closed the connection")
        buf += chunk
    return bytes(buf)


def recv_frame(sock: socket.socket) -> tuple[dict, bytes]:
    """One whole frame from a blocking socket (a client waiting for its reply)."""
    hl, pl = HEAD.unpack(_recv_exact(sock, HEAD.size))
    head = json.loads(_recv_exact(sock, hl))
    return head, _recv_exact(sock, pl) if pl else b""


def connect_unix(path: str, timeout_s: float, what: str) -> socket.socket:
    """A stream connection to the server at ``path``, retried until it listens or
    ``timeout_s`` passes (then :class:`~fpgaccl.errors.BackendUnavailableError` names
    ``what``)."""
    end = time.monotonic() + timeout_s
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(path)
        except OSError as e:
            sock.close()
            if time.monotonic() > end:
                raise BackendUnavailableError(f"no {what} at {path}: {e}") from e
            time.sleep(0.1)
            continue
        sock.settimeout(timeout_s)
        return sock
