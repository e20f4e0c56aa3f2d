"""The one server loop of the simulated cluster and the simulated board.

It listens on a Unix socket, reads the clients' requests (``>II`` + JSON header + payload
frames: :mod:`fpgaccl.proto.framing`) without blocking, and hands each to the server
object; between two looks at the sockets the server moves the simulation on
(:meth:`Server.step`). While the server is not busy the loop sleeps in ``select``: no
simulated time passes then. The loop ends on a ``shutdown`` request (the server sets
``stop``), when every client came and went (:meth:`Server.finished`), or after
``idle_timeout_s`` without a request or work; it then writes the server's summary.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import socket
import time
from typing import Any, Protocol

from fpgaccl.proto.framing import FrameReader, encode

EXTRA = object()
"""Selector data of the server's own sockets (the listening socket's is None)."""


class Client:
    """One connected client: its socket, its frame reader and the node it claimed."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.reader, self.node = sock, FrameReader(), None

    def reply(self, header: dict, payload: bytes = b"") -> None:
        # Blocking for the whole frame: a reply must not be cut by a full socket buffer.
        self.sock.setblocking(True)
        try:
            self.sock.sendall(encode(header, payload))
        except OSError:
            pass  # the client left; the loop sees it on its next read
        finally:
            self.sock.setblocking(False)

    def ok(self, header: dict, payload: bytes = b"") -> None:
        self.reply({"ok": True, **header}, payload)

    def error(self, err: str, detail: str) -> None:
        self.reply({"error": err, "detail": detail})


class Server(Protocol):
    """What the loop needs of a server."""

    name: str
    stop: bool

    async def start(self) -> None:
        """Reset the design; the socket appears after this."""

    async def handle(self, client: Client, header: dict, payload: bytes) -> None: ...

    def left(self, client: Client) -> None:
        """``client`` disconnected."""

    def busy(self) -> bool:
        """Whether the simulation has work: the loop then polls instead of sleeping."""

    async def step(self) -> None:
        """Move the simulation on between two looks at the sockets."""

    def sockets(self) -> list[socket.socket]:
        """Further sockets to wake the loop (the server reads them in :meth:`step`)."""

    def finished(self) -> bool:
        """The run is over although nobody asked to stop."""

    async def summary(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


def _listen(path: str) -> socket.socket:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    lsock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    lsock.bind(path + ".tmp")
    lsock.listen(16)
    lsock.setblocking(False)
    os.replace(path + ".tmp", path)  # the socket appears only once it accepts
    return lsock


async def serve(server: Server, socket_path: str, *, idle_timeout_s: float = 600.0,
                summary_path: str | None = None, log: Any = None) -> dict[str, Any]:
    """Serve ``socket_path`` until the run ends; return (and write) the summary."""
    await server.start()
    lsock = _listen(socket_path)
    sel = selectors.DefaultSelector()
    sel.register(lsock, selectors.EVENT_READ)
    registered: set[socket.socket] = set()
    idle_since = time.monotonic()
    try:
        while not server.stop:
            for s in server.sockets():
                if s not in registered:
                    sel.register(s, selectors.EVENT_READ, EXTRA)
                    registered.add(s)
            events = sel.select(timeout=0 if server.busy() else 0.05)
            work = []
            for key, _ in events:
                if key.data is EXTRA:
                    continue
                if key.fileobj is lsock:
                    conn, _ = lsock.accept()
                    conn.setblocking(False)
                    sel.register(conn, selectors.EVENT_READ, Client(conn))
                    continue
                client = key.data
                try:
                    data = client.sock.recv(1 << 20)
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    data = b""
                if not data:
                    sel.unregister(client.sock)
                    client.sock.close()
                    server.left(client)
                    continue
                work += [(client, h, pl) for h, pl in client.reader.feed(data)]
            for client, h, pl in work:
                await server.handle(client, h, pl)
            await server.step()
            if events or server.busy():
                idle_since = time.monotonic()
            if server.finished():
                break
            if time.monotonic() - idle_since > idle_timeout_s:
                if log is not None:
                    log.warning("%s: idle for %s s, stopping", server.name, idle_timeout_s)
                break
    finally:
        summary = await server.summary()
        if summary_path:
            with open(summary_path, "w") as f:
                json.dump(summary, f)
        sel.close()
        lsock.close()
        server.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(socket_path)
    return summary
