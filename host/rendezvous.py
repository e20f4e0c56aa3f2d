"""TCP rendezvous on MASTER_ADDR:MASTER_PORT: every rank learns every rank's QP info.

Rank 0 listens; the others connect (retrying until the deadline, since launchers start
ranks in any order), each sends one JSON line, and rank 0 answers everyone with the
full table once all have arrived. Only connection set-up uses TCP; data never does.
"""

from __future__ import annotations

import errno
import ipaddress
import json
import os
import socket
import time
from typing import Any

from fpgaccl.errors import CollectiveTimeoutError, InvalidArgumentError


def _send_line(sock: socket.socket, obj: Any) -> None:
    sock.sendall(json.dumps(obj).encode() + b"\n")


def _recv_line(sock: socket.socket) -> Any:
    data = bytearray()
    while not data.endswith(b"\n"):
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("rendezvous peer closed the connection")
        data += chunk
    return json.loads(data)


def rendezvous_port(master_port: int) -> int:
    """The TCP port rank 0 listens on: ``FPGACCL_RDZV_PORT`` if set; under torchrun,
    whose agent already listens on MASTER_PORT (its TCPStore), the port after it;
    otherwise MASTER_PORT itself."""
    if "FPGACCL_RDZV_PORT" in os.environ:
        return int(os.environ["FPGACCL_RDZV_PORT"])
    return master_port + 1 if "TORCHELASTIC_RUN_ID" in os.environ else master_port


def exchange(rank: int, world: int, master: tuple[str, int], info: dict,
             timeout_s: float = 60.0) -> list[dict]:
    """All ranks' ``info`` dicts, indexed by rank."""
    if not 0 <= rank < world:
        raise InvalidArgumentError("rank", f"{rank} is outside world of size {world}")
    if world == 1:
        return [info]
    master = (master[0], rendezvous_port(master[1]))
    deadline = time.monotonic() + timeout_s
    if rank == 0:
        return _serve(world, master, info, deadline, timeout_s)
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
    with sock:
        sock.settimeout(max(0.1, deadline - time.monotonic()))
        _send_line(sock, {"rank": rank, "info": info})
        try:
            table = _recv_line(sock)
        except (TimeoutError, ConnectionError) as e:
            raise CollectiveTimeoutError("rendezvous", rank, timeout_s, str(e)) from None
    if not isinstance(table, list) or len(table) != world:
        size = len(table) if isinstance(table, list) else "no"
        raise InvalidArgumentError(
            "world_size", f"rank {rank} was started in a world of {world}, but the master "
            f"at {master[0]}:{master[1]} answered with a table of {size} ranks")
    return table


def _serve(world: int, master: tuple[str, int], info: dict, deadline: float,
           timeout_s: float) -> list[dict]:
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
    srv.listen(world)
    table: list[dict | None] = [None] * world
    table[0] = info
    conns = []
    try:
        while any(t is None for t in table):
            left = deadline - time.monotonic()
            if left <= 0:
                missing = [i for i, t in enumerate(table) if t is None]
                raise CollectiveTimeoutError("rendezvous", 0, timeout_s,
                                             f"ranks {missing} never arrived")
            srv.settimeout(left)
            try:
                conn, _ = srv.accept()
            except TimeoutError:
                continue
            conn.settimeout(max(0.1, deadline - time.monotonic()))
            msg = _recv_line(conn)
            r = int(msg["rank"])
            if not 0 < r < world or table[r] is not None:
                conn.close()
                raise InvalidArgumentError("rank", f"rank {r} announced twice or out of range")
            table[r] = msg["info"]
            conns.append(conn)
        for conn in conns:
            _send_line(conn, table)
    finally:
        for conn in conns:
            conn.close()
        srv.close()
    return table  # type: ignore[return-value]


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
