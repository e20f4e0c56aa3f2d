"""Devices the ``board`` backend can drive (:class:`fpgaccl.host.driver.Device`).

:class:`SimDevice` is the simulated board (:mod:`fpgaccl.sim.board`): the same DMA
node in Verilator, reached over a Unix socket. Each call is one request; register
writes are batched as a driver posts them. A PCIe board would implement the same five
calls over its BAR (mmap of the resource file), its pinned DMA buffers and the GPU
vendor's peer-memory pinning; no such card exists on this machine.

:class:`UdpDevice` reaches a network-attached node through its control port
(:mod:`fpgaccl.proto.control`): registers and node memory, with the board's key; it has
no GPU-peer window.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import time
from collections.abc import Callable
from typing import Any

from fpgaccl.errors import BackendUnavailableError, MalformedHeaderError, TransportError
from fpgaccl.proto import control as ctl
from fpgaccl.proto.framing import connect_unix, encode, recv_frame

from .driver import PageEntry, Writes

BOARD_ENV = "FPGACCL_BOARD"
"""``sim:PATH``: the simulated board listening at PATH; ``udp:ADDR[,ADDR...]``: nodes on
the network (``HOST`` or ``HOST:PORT``), their key in :data:`KEY_ENV`: one address is
this rank's node, a list has one per rank of the world."""
KEY_ENV = "FPGACCL_BOARD_KEY"
"""The boards' control key, in hex."""


class SimDevice:
    def __init__(self, path: str, node: int, *, timeout_s: float = 600.0) -> None:
        self.path, self.node = path, node
        self.sock = connect_unix(path, timeout_s, "simulated board")
        self.info, _ = self.call({"op": "hello", "node": node})
        self.gpu_va_base = int(self.info["gpu_va_base"])

    @classmethod
    def from_env(cls, node: int, spec: str | None = None) -> SimDevice | UdpDevice:
        spec = spec or os.environ.get(BOARD_ENV, "")
        kind, _, path = spec.partition(":")
        if kind == "udp" and path:
            return UdpDevice.from_spec(path, node)
        if kind != "sim" or not path:
            raise BackendUnavailableError(
                f"backend 'board' found no board: no fpgaccl PCIe function is present, and "
                f"{BOARD_ENV}={spec!r} does not name a simulated one (sim:PATH; start it "
                f"with `python -m fpgaccl.sim.board --socket PATH`) nor networked ones "
                f"(udp:ADDR[,ADDR...])")
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


class UdpDevice:
    """A node's registers and memory over its control port. Each call is one request
    (batches split to the node's ``max_body``); a request unanswered within
    ``timeout_s`` is sent again with the same ``seq`` up to ``retries`` times, each
    time waiting twice as long (a node busy with RoCE traffic, or a simulated one on a
    loaded host, answers late rather than never) -- the node answers a retried write
    without executing it twice. ``ip_mtu``: the path's, which bounds a request's body
    as the node's own ``max_body`` does."""

    def __init__(self, addr: str, key: int, *, port: int = ctl.CONTROL_PORT,
                 timeout_s: float = 0.2, retries: int = 5, ip_mtu: int = 1500) -> None:
        self.addr = (addr, port)
        self.node = addr
        self.name = f"control port {addr}:{port}"
        self.requests = self.resent = 0
        self.key, self.timeout_s, self.retries = key, timeout_s, retries
        self.seq = secrets.randbits(32)   # a restarted client must not look like a retry
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            self.sock.connect(self.addr)
        except OSError as e:
            self.sock.close()
            raise BackendUnavailableError(f"{self.name}: {e}") from e
        v = ctl.INFO.unpack(self.call(lambda seq: ctl.hello(seq, key)).body)
        # A request larger than the path's IP MTU would go out as IP fragments, which
        # the node drops: bodies are bounded by the link as well as by the node.
        self.max_body = min(v["max_body"], ctl.max_body(ip_mtu + 14))
        self.info = {**v, "clock_ns": v["clock_ps"] / 1000}
        self.gpu_va_base = v["gpu_va_base"]

    @classmethod
    def from_spec(cls, addrs: str, node: int, key: str | None = None) -> UdpDevice:
        hosts = [a.strip() for a in addrs.split(",")]
        if len(hosts) == 1:
            node = 0   # each rank was given its own node
        if not 0 <= node < len(hosts) or not hosts[node]:
            raise BackendUnavailableError(f"{BOARD_ENV} names {len(hosts)} node(s); "
                                          f"rank {node} has none")
        key = key if key is not None else os.environ.get(KEY_ENV, "")
        try:
            k = int(key, 16)
        except ValueError:
            raise BackendUnavailableError(f"{KEY_ENV}={key!r}: the boards' key in hex "
                                          "is needed to reach them") from None
        host, _, port = hosts[node].partition(":")
        return cls(host, k, port=int(port) if port else ctl.CONTROL_PORT)

    def call(self, make: Callable[[int], ctl.Message]) -> ctl.Message:
        seq, self.seq = self.seq, (self.seq + 1) % (1 << 32)
        req = make(seq)
        wire = ctl.encode(req)
        wait = self.timeout_s
        for attempt in range(self.retries + 1):
            self.requests += 1
            self.resent += attempt > 0
            try:
                self.sock.send(wire)
                resp = self._answer(seq, wait)
            except ConnectionRefusedError as e:
                raise BackendUnavailableError(f"{self.name}: nothing answers ({e})") from e
            except OSError as e:
                raise TransportError(f"{self.name}: {e}") from e
            if resp is not None:
                break
            wait *= 2
        else:
            raise TransportError(f"{self.name}: no answer to {ctl.Op(req.op).name} seq {seq} "
                                 f"after {self.retries + 1} tries in {wait - self.timeout_s:g} s")
        if resp.status == ctl.Status.BAD_KEY:
            raise BackendUnavailableError(f"{self.name}: the node refuses our key ({KEY_ENV})")
        if resp.status != ctl.Status.OK:
            raise TransportError(f"{self.name}: {ctl.Op(req.op).name} seq {seq} answered "
                                 f"{resp.status.name}")
        return resp

    def _answer(self, seq: int, timeout_s: float) -> ctl.Message | None:
        """The response to ``seq``, or None after ``timeout_s``; stray datagrams and late
        answers to earlier requests are skipped."""
        end = time.monotonic() + timeout_s
        while (left := end - time.monotonic()) > 0:
            self.sock.settimeout(left)
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                return None
            try:
                msg = ctl.decode(data)
            except MalformedHeaderError:
                continue
            if msg.response and msg.seq == seq:
                return msg
        return None

    # The Device protocol ----------------------------------------------------------
    def csr_write(self, writes: Writes) -> None:
        per = self.max_body // ctl.PAIR_BYTES
        writes = list(writes)
        for i in range(0, len(writes), per):
            self.call(lambda seq, part=writes[i:i + per]: ctl.csr_write(seq, self.key, part))

    def csr_read(self, addr: int) -> int:
        return self.csr_read_many(addr, 1)[0]

    def csr_read_many(self, addr: int, n: int) -> list[int]:
        """``n`` consecutive registers from ``addr``, one request per ``max_body``."""
        per = self.max_body // 4
        out: list[int] = []
        while len(out) < n:
            at, k = addr + 4 * len(out), min(per, n - len(out))
            out += ctl.words(self.call(lambda seq, a=at, c=k: ctl.csr_read(seq, self.key, a,
                                                                             c)).body)
        return out

    def host_write(self, iova: int, data: bytes) -> None:
        data = bytes(data)
        for off in range(0, len(data), self.max_body):
            part = data[off:off + self.max_body]
            self.call(lambda seq, o=off, p=part: ctl.mem_write(seq, self.key, iova + o, p))

    def host_read(self, iova: int, n: int) -> bytes:
        out = bytearray()
        while len(out) < n:
            k, at = min(self.max_body, n - len(out)), iova + len(out)
            out += self.call(lambda seq, a=at, c=k: ctl.mem_read(seq, self.key, a, c)).body
        return bytes(out)

    def _absent(self, *_args, **_kw):
        raise BackendUnavailableError(f"{self.name}: the control port serves registers and "
                                      "node memory only (no GPU-peer window, no cycle count)")

    gpu_alloc = gpu_write = gpu_read = gpu_pin = cycle = _absent

    def pause(self) -> None:
        time.sleep(0.001)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()
