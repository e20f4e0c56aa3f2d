"""TCP rendezvous on MASTER_ADDR:MASTER_PORT: every rank learns every rank's QP info.

Rank 0 listens; the others connect (retrying until the deadline, since launchers start
ranks in any order), and rank 0 answers everyone with the full table once all have
arrived. Only connection set-up uses TCP; data never does.

The conversation is one JSON object per line (UTF-8, ending in ``\\n``, at most
:data:`MAX_LINE` bytes), so tshark's "Follow TCP stream" shows it as it is:

* rank 0 -> rank, on accepting: ``{"fpgaccl": "rendezvous", "nonce": "<32 hex>"}``
* rank -> rank 0: ``{"rank": 2, "info": {...}, "mac": "<64 hex>"}``
* rank 0 -> rank, once every rank is in: ``{"table": [info of rank 0, 1, ...],
  "mac": "<64 hex>"}``; or at once, when it refuses the record:
  ``{"error": "why", "argument": "what to fix"}``, and it closes the connection.

``mac`` proves that the sender holds the job's secret (``FPGACCL_JOB_SECRET``: ``fpgaccl
run`` draws one per run; under torchrun, Slurm or mpirun the job script exports one value
to every rank) without sending it: HMAC-SHA256 keyed with the secret over the nonce and
the record's canonical JSON (sorted keys, no spaces); the table's over the rank's own
``mac`` and the table, so a rank knows its answer comes from its job's rank 0 and answers
this very record. Without a secret there is no ``mac``, and rank 0 takes any well-formed
record: anyone who reaches the port can join (rank 0 warns once).

Rank 0 serves all connections at once (non-blocking, one selector). A connection that
sends no record within :data:`CLIENT_TIMEOUT_S`, or whose line is no valid record (not
JSON, not an object, no integer ``rank``, a rank outside the world or already taken by
another connection, a missing or wrong ``mac``) is refused and logged with the peer's
address: port scans, HTTP probes and strangers cannot fail a job.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import hmac
import ipaddress
import json
import logging
import os
import secrets
import selectors
import socket
import time
from typing import Any

from fpgaccl.errors import CollectiveTimeoutError, InvalidArgumentError

SECRET_ENV = "FPGACCL_JOB_SECRET"
MAX_LINE = 1 << 20
"""Longest line rank 0 reads from a rank (a record of a 254-rank world is ~30 KB)."""
CLIENT_TIMEOUT_S = 10.0
"""How long rank 0 waits for a connection's record: a rank sends it on the nonce."""
MAX_PENDING = 64
"""Connections without a record that rank 0 keeps; beyond it drops the oldest."""
MAX_LOGGED = 20
"""Refusals logged one by one per rendezvous; the rest are counted."""

log = logging.getLogger("fpgaccl.rendezvous")
_warned_open = False


def _canonical(obj: Any) -> bytes:
    # Through JSON first: what the peer parses (int keys become strings) is what it signs.
    return json.dumps(json.loads(json.dumps(obj)), sort_keys=True,
                      separators=(",", ":")).encode()


def _mac(secret: str, tag: bytes, *parts: bytes) -> str:
    return hmac.new(secret.encode(), b"\n".join((tag, *parts)), hashlib.sha256).hexdigest()


def _line(obj: Any) -> bytes:
    return json.dumps(obj).encode() + b"\n"


def _recv_line(sock: socket.socket, limit: int) -> Any:
    data = bytearray()
    while not data.endswith(b"\n"):
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("rendezvous peer closed the connection")
        data += chunk
        if len(data) > limit:
            raise ConnectionError(f"rendezvous peer sent a line over {limit} bytes")
    return json.loads(data)


def rendezvous_port(master_port: int) -> int:
    """The TCP port rank 0 listens on: ``FPGACCL_RDZV_PORT`` if set; under torchrun,
    whose agent already listens on MASTER_PORT (its TCPStore), the port after it;
    otherwise MASTER_PORT itself."""
    if "FPGACCL_RDZV_PORT" in os.environ:
        return int(os.environ["FPGACCL_RDZV_PORT"])
    return master_port + 1 if "TORCHELASTIC_RUN_ID" in os.environ else master_port


def exchange(rank: int, world: int, master: tuple[str, int], info: dict,
             timeout_s: float = 60.0, secret: str | None = None) -> list[dict]:
    """All ranks' ``info`` dicts, indexed by rank. ``secret``: the job's, else
    FPGACCL_JOB_SECRET's (none if unset or empty)."""
    if not 0 <= rank < world:
        raise InvalidArgumentError("rank", f"{rank} is outside world of size {world}")
    if world == 1:
        return [info]
    secret = os.environ.get(SECRET_ENV, "") if secret is None else secret
    master = (master[0], rendezvous_port(master[1]))
    deadline = time.monotonic() + timeout_s
    if rank == 0:
        return _serve(world, master, info, deadline, timeout_s, secret)
    while True:
        try:
            sock = socket.create_connection(master, timeout=max(0.1, deadline - time.monotonic()))
            if sock.getsockname() == sock.getpeername():
                # TCP simultaneous open: with no master listening yet on a port in the
                # ephemeral range, a connect may be given that very port as its own and
                # join itself. It would read back its own line as the table.
                sock.close()
                raise ConnectionRefusedError(errno.ECONNREFUSED, "connected to itself")
            break
        except OSError:
            if time.monotonic() > deadline:
                raise CollectiveTimeoutError("rendezvous", rank, timeout_s,
                                             f"no master at {master[0]}:{master[1]}") from None
            time.sleep(0.05)
    where = f"rank 0 at {master[0]}:{master[1]}"
    with sock:
        sock.settimeout(max(0.1, deadline - time.monotonic()))
        try:
            hello = _recv_line(sock, MAX_LINE)
            if not isinstance(hello, dict) or not isinstance(hello.get("nonce"), str):
                raise ValueError(hello)
            record = {"rank": rank, "info": info}
            if secret:
                record["mac"] = _mac(secret, b"record", hello["nonce"].encode(),
                                     _canonical({"rank": rank, "info": info}))
            sock.sendall(_line(record))
            answer = _recv_line(sock, MAX_LINE * world)
        except (TimeoutError, ConnectionError) as e:
            raise CollectiveTimeoutError("rendezvous", rank, timeout_s, str(e)) from None
        except ValueError:
            raise InvalidArgumentError("master_port", f"{master[0]}:{master[1]} does not "
                                       "speak the fpgaccl rendezvous") from None
    if not isinstance(answer, dict):
        raise InvalidArgumentError("master_port", f"{where} answered {str(answer)[:80]}")
    if "error" in answer:
        raise InvalidArgumentError(str(answer.get("argument") or "rendezvous"),
                                   f"{where} refused rank {rank}: {answer['error']}")
    table = answer.get("table")
    if secret and not hmac.compare_digest(
            str(answer.get("mac")), _mac(secret, b"table", record["mac"].encode(),
                                         _canonical(table))):
        raise InvalidArgumentError(SECRET_ENV, f"the answer of {where} is not signed with "
                                   "this job's secret (another job's rank 0, or a secret "
                                   "set on some ranks only?)")
    if not isinstance(table, list) or len(table) != world:
        size = len(table) if isinstance(table, list) else "no"
        raise InvalidArgumentError(
            "world_size", f"rank {rank} was started in a world of {world}, but the master "
            f"at {master[0]}:{master[1]} answered with a table of {size} ranks")
    return table


class _Refused(Exception):
    """A connection's line is no record of this job; ``argument``: what a rank would fix."""

    def __init__(self, why: str, argument: str = "rendezvous") -> None:
        super().__init__(why)
        self.argument = argument


class _Conn:
    """One accepted connection: what it sent so far, what is still to go out to it."""

    def __init__(self, sock: socket.socket, addr: Any, now: float) -> None:
        self.sock = sock
        self.peer = f"{addr[0]}:{addr[1]}"
        self.nonce = secrets.token_hex(16)
        self.inbuf = bytearray()
        self.out = bytearray(_line({"fpgaccl": "rendezvous", "nonce": self.nonce}))
        self.expires = now + CLIENT_TIMEOUT_S
        self.rank: int | None = None
        self.mac = ""

    def flush(self) -> None:
        if self.out:
            del self.out[:self.sock.send(self.out)]


class _Server:
    """Rank 0's side: every connection served at once, none able to stall the others."""

    def __init__(self, world: int, info: dict, secret: str) -> None:
        self.world = world
        self.secret = secret
        self.table: list[Any] = [None] * world
        self.table[0] = info
        self.joined: dict[int, _Conn] = {}
        self.pending: dict[socket.socket, _Conn] = {}  # accept order: the oldest first
        self.sel = selectors.DefaultSelector()
        self.refused = 0

    def refuse(self, c: _Conn, why: str, argument: str = "rendezvous") -> None:
        self.refused += 1
        if self.refused <= MAX_LOGGED:
            log.warning("fpgaccl rendezvous: refused %s: %s", c.peer, why)
            if self.refused == MAX_LOGGED:
                log.warning("fpgaccl rendezvous: further refusals are only counted")
        with contextlib.suppress(OSError):
            c.sock.send(_line({"error": why, "argument": argument}))
        self.drop(c)

    def drop(self, c: _Conn) -> None:
        self.pending.pop(c.sock, None)
        if c.rank is not None and self.joined.get(c.rank) is c:
            del self.joined[c.rank]
            self.table[c.rank] = None
        self.sel.unregister(c.sock)
        c.sock.close()

    def accept(self, srv: socket.socket, now: float) -> None:
        while True:
            try:
                sock, addr = srv.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # ECONNABORTED, EMFILE: that connection only
                log.warning("fpgaccl rendezvous: accept failed: %s", e)
                return
            sock.setblocking(False)
            if len(self.pending) >= MAX_PENDING:
                self.refuse(next(iter(self.pending.values())), "too many connections "
                            "without a record; this one was the oldest")
            c = _Conn(sock, addr, now)
            self.pending[sock] = c
            self.sel.register(sock, selectors.EVENT_READ | selectors.EVENT_WRITE, c)

    def serve(self, c: _Conn, mask: int) -> None:
        try:
            if mask & selectors.EVENT_WRITE:
                c.flush()
            if mask & selectors.EVENT_READ:
                chunk = c.sock.recv(65536)
                if not chunk:
                    self.closed(c)
                    return
                if c.rank is None:
                    c.inbuf += chunk
                    self.read(c)
        except _Refused as e:
            self.refuse(c, str(e), e.argument)
            return
        except (BlockingIOError, InterruptedError):
            pass
        except OSError as e:
            self.refuse(c, f"connection failed: {e}")
            return
        if c.sock.fileno() != -1:
            self.sel.modify(c.sock, selectors.EVENT_READ
                            | (selectors.EVENT_WRITE if c.out else 0), c)

    def closed(self, c: _Conn) -> None:
        if c.rank is None:
            self.refuse(c, "closed without sending a record")
        else:
            log.warning("fpgaccl rendezvous: rank %d (%s) left before the table was "
                        "complete; its rank is open again", c.rank, c.peer)
            self.drop(c)

    def read(self, c: _Conn) -> None:
        end = c.inbuf.find(b"\n")
        if end < 0:
            if len(c.inbuf) > MAX_LINE:
                raise _Refused(f"a line over {MAX_LINE} bytes")
            return
        try:
            msg = json.loads(c.inbuf[:end])
        except ValueError:
            raise _Refused(f"not JSON: {bytes(c.inbuf[:40])!r}") from None
        if not isinstance(msg, dict):
            raise _Refused("not a JSON object")
        r = msg.get("rank")
        if self.secret:
            mac = msg.get("mac")
            if not isinstance(mac, str):
                raise _Refused("a record without the job secret's mac", SECRET_ENV)
            want = _mac(self.secret, b"record", c.nonce.encode(),
                        _canonical({"rank": r, "info": msg.get("info")}))
            if not hmac.compare_digest(mac, want):
                raise _Refused("a record signed with another secret", SECRET_ENV)
            c.mac = mac
        if not isinstance(r, int) or isinstance(r, bool) or "info" not in msg:
            raise _Refused("no integer rank and info")
        if not 0 < r < self.world:
            raise _Refused(f"rank {r} is not one of ranks 1..{self.world - 1} of this "
                           f"world of {self.world}", "rank")
        if r in self.joined:
            raise _Refused(f"rank {r} already joined from {self.joined[r].peer}", "rank")
        c.rank = r
        self.table[r] = msg["info"]
        self.joined[r] = c
        del self.pending[c.sock]

    def answer(self, deadline: float) -> None:
        for c in list(self.pending.values()):
            self.refuse(c, "the world is complete")
        for c in self.joined.values():
            c.out += _line({"table": self.table, **({"mac": _mac(
                self.secret, b"table", c.mac.encode(), _canonical(self.table))}
                if self.secret else {})})
            self.sel.modify(c.sock, selectors.EVENT_WRITE, c)
        while any(c.out for c in self.joined.values()):
            left = deadline - time.monotonic()
            if left <= 0:
                late = [r for r, c in self.joined.items() if c.out]
                log.warning("fpgaccl rendezvous: ranks %s did not take the table", late)
                return
            for key, _ in self.sel.select(left):
                c = key.data
                try:
                    c.flush()
                except (BlockingIOError, InterruptedError):
                    pass
                except OSError as e:
                    log.warning("fpgaccl rendezvous: rank %s (%s) lost: %s", c.rank, c.peer, e)
                    c.out.clear()
                if not c.out:
                    self.sel.unregister(c.sock)

    def close(self) -> None:
        for c in [*self.pending.values(), *self.joined.values()]:
            c.sock.close()
        self.sel.close()


def _warn_open(master: tuple[str, int]) -> None:
    global _warned_open
    if not _warned_open:
        _warned_open = True
        log.warning("fpgaccl rendezvous: no %s: anyone who reaches %s:%d can join this job "
                    "as a rank (fpgaccl run sets one; under torchrun, Slurm or mpirun export "
                    "one random value to every rank)", SECRET_ENV, *master)


def _serve(world: int, master: tuple[str, int], info: dict, deadline: float,
           timeout_s: float, secret: str) -> list[dict]:
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        srv.bind(master)
    except OSError as e:
        srv.close()
        raise InvalidArgumentError(
            "master_port", f"rank 0 cannot listen on {master[0]}:{master[1]}: {e.strerror}"
            + (" (another program holds it; choose a free port with FPGACCL_RDZV_PORT)"
               if e.errno == errno.EADDRINUSE else "")) from None
    if not secret:
        _warn_open(master)
    srv.listen(socket.SOMAXCONN)
    srv.setblocking(False)
    s = _Server(world, info, secret)
    s.sel.register(srv, selectors.EVENT_READ)
    try:
        while len(s.joined) < world - 1:
            now = time.monotonic()
            if now >= deadline:
                missing = [i for i, t in enumerate(s.table) if t is None]
                raise CollectiveTimeoutError("rendezvous", 0, timeout_s,
                                             f"ranks {missing} never arrived")
            for c in [c for c in s.pending.values() if c.expires <= now]:
                s.refuse(c, f"no record within {CLIENT_TIMEOUT_S:g} s")
            wake = min([deadline, *(c.expires for c in s.pending.values())])
            for key, mask in s.sel.select(max(0.0, wake - now)):
                if key.fileobj is srv:
                    s.accept(srv, now)
                else:
                    s.serve(key.data, mask)
        s.sel.unregister(srv)
        srv.close()
        s.answer(min(deadline, time.monotonic() + CLIENT_TIMEOUT_S))
        if s.refused:
            log.warning("fpgaccl rendezvous: complete; %d connection(s) refused", s.refused)
    finally:
        s.close()
        srv.close()
    return s.table


def master(master_addr: str | None, master_port: int | None) -> tuple[str, int]:
    """Rank 0's rendezvous host and port: the arguments, else MASTER_ADDR/MASTER_PORT,
    else 127.0.0.1:29500."""
    addr = master_addr or os.environ.get("MASTER_ADDR", "127.0.0.1")
    return addr, int(master_port or os.environ.get("MASTER_PORT", 29500))


def loopback_ip(master_port: int, rank: int) -> str:
    """A per-run loopback subnet (all of 127/8 is local), so runs never share port 4791."""
    if rank >= 254:
        raise InvalidArgumentError("world_size", "local runs support at most 254 ranks")
    return f"127.{(master_port >> 8) & 0xFF}.{master_port & 0xFF}.{rank + 1}"


def is_loopback(host: str) -> bool:
    return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback


def bind_ip(rank: int, master_addr: str, master_port: int, given: str | None = None) -> str:
    """The address this rank's engine binds UDP 4791 on: ``given``, else FPGACCL_BIND_IP,
    else a loopback address of the run's own (ranks of a local run), else the local
    address the kernel routes towards rank 0's host."""
    ip = given or os.environ.get("FPGACCL_BIND_IP")
    if ip is not None:
        return ip
    if is_loopback(master_addr):
        return loopback_ip(master_port, rank)
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect((master_addr, 9))
        return s.getsockname()[0]
    finally:
        s.close()
