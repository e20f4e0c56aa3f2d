"""The control protocol: a host reads and writes a node's registers and memory over
the network, as it would through a PCIe BAR.

Transport: UDP/IPv4 to the node's address, destination port :data:`CONTROL_PORT`
(4792, the port after RoCEv2's 4791); the node answers from that port to the request's
source address and port, UDP checksum 0 (allowed for IPv4). tshark decodes it as plain
UDP (``udp.port == 4792``); the UDP payload is, byte by byte (all fields big-endian,
bit 7 of a byte first)::

    0       magic    16  0x4643 ("FC")
    2       version   4  high nibble: 1
            flags     4  low nibble: bit 3 (0x08) RESPONSE, bit 2 (0x04) ERROR,
                         bits 1..0 zero
    3       op        8  0 HELLO, 1 CSR_READ, 2 CSR_WRITE, 3 MEM_READ, 4 MEM_WRITE
    4       seq      32  the client's sequence number, echoed in the response
    8       key      64  the board key in a request; zero in a response
    16      addr     64  CSR_READ: first register's byte address; MEM_*: memory address
    24      count    16  CSR_READ: registers; CSR_WRITE: (addr, value) pairs;
                         MEM_*: bytes; HELLO: 0
    26      status   16  0 in a request; the outcome in a response (:class:`Status`)
    28      body         per op, below

Bodies (``n`` = count):

=========== ============================================ ==================================
op          request body                                 response body (status OK)
=========== ============================================ ==================================
HELLO       none                                         :data:`INFO` (32 bytes)
CSR_READ    none                                         n x value (u32), addr, addr+4, ...
CSR_WRITE   n x (register address u32, value u32)        none
MEM_READ    none                                         n bytes from addr
MEM_WRITE   n bytes to store at addr                     none
=========== ============================================ ==================================

A response with ERROR set carries no body. ``count`` is 1 or more except in HELLO.

Key: a board has one 64-bit key, set at build or -- when the build leaves it zero -- by
the first HELLO that carries a non-zero key ("first contact"; a reset reopens it).
Every other request must carry the key; one that does not (or arrives before any key
is set) is dropped without an answer and counted as
:attr:`~fpgaccl.proto.drops.DropReason.CONTROL_KEY`, so a stray host can neither
program the node nor learn anything beyond what ARP and ping tell. A HELLO with the
wrong key is counted too but answered :attr:`Status.BAD_KEY` (no INFO), so a
misconfigured host fails at once instead of timing out. Frames that are not a
well-formed request (magic, version, RESPONSE or reserved flags set, lengths that
disagree, longer than the node's buffer) are dropped and counted as
``CONTROL_MALFORMED``.

Idempotency (one slot per node, for writes only): the node remembers the client (IP
address, UDP source port) and ``seq`` of the last CSR_WRITE or MEM_WRITE it executed.
A write from that client with that ``seq`` is answered OK again and *not* executed
again; one whose ``seq`` is behind it (``(seq - last) mod 2**32 >= 2**31``) is a
delayed duplicate and is answered :attr:`Status.STALE`, not executed. Any other write
executes and takes the slot. Why writes and one slot: a CSR write batch can ring the
doorbell or clear counters (write-only and clear-on-write registers), so re-running it
is not harmless, and one host drives a node at a time (its rank). Reads and HELLO have
no side effects (no register clears on read), so a retried read is executed again and
answers the current values. Clients therefore number requests upward and retry with
the same ``seq`` and the same bytes; a second client that writes in between takes the
slot, and a retry of the first client's write is then executed again.

Size: a request and its response each fit one Ethernet frame at the node's
``max_frame`` (:func:`max_body`: body bytes = max_frame - 70; 1444 bytes at the
standard 1500-byte IP MTU, i.e. 180 CSR pairs or 361 register reads). Larger counts are
answered BAD_LENGTH; an address range past the CSR space or the node's memory,
OUT_OF_RANGE. Checks happen before anything executes: a refused batch writes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum, IntFlag

from fpgaccl.errors import MalformedHeaderError

from .fields import Field, Header, equals, one_of

CONTROL_PORT = 4792
MAGIC = 0x4643
VERSION = 1
ETH_IP_UDP_BYTES = 14 + 20 + 8
CSR_ADDR_BITS = 16
"""The node's CSR bus: byte addresses below ``2**16``, 32-bit registers."""


class Op(IntEnum):
    HELLO = 0
    CSR_READ = 1
    CSR_WRITE = 2
    MEM_READ = 3
    MEM_WRITE = 4


class Status(IntEnum):
    OK = 0
    BAD_KEY = 1
    BAD_OP = 2
    BAD_LENGTH = 3
    OUT_OF_RANGE = 4
    STALE = 5


class Flags(IntFlag):
    RESPONSE = 0x8
    ERROR = 0x4


NO_FLAGS = Flags(0)


WRITES = frozenset({Op.CSR_WRITE, Op.MEM_WRITE})
"""The ops the idempotency slot covers."""

CONTROL = Header("Control", (
    Field("magic", 16, MAGIC, "0x4643, 'FC'", hex=True, check=equals(MAGIC)),
    Field("version", 4, VERSION, "protocol version", check=equals(VERSION)),
    Field("flags", 4, 0, "0x8 RESPONSE, 0x4 ERROR, 0x3 reserved (zero)", hex=True,
          check=lambda v: None if not v & 0x3 else f"reserved bits set in {v:#x}"),
    Field("op", 8, Op.HELLO, "operation; an unknown one is answered BAD_OP"),
    Field("seq", 32, 0, "client sequence number, echoed"),
    Field("key", 64, 0, "board key (requests); zero in responses", hex=True),
    Field("addr", 64, 0, "register or memory byte address", hex=True),
    Field("count", 16, 0, "registers, pairs or bytes"),
    Field("status", 16, Status.OK, "outcome (responses)",
          check=one_of(frozenset(Status), "status")),
), "fpgaccl control request/response header (UDP port 4792)")

INFO = Header("ControlInfo", (
    Field("mac", 48, 0, "the port's MAC", hex=True),
    Field("width", 16, 64, "datapath bits"),
    Field("ip", 32, 0, "the port's IPv4 address", hex=True),
    Field("mtu", 16, 4096, "RoCE payload MTU in bytes"),
    Field("max_body", 16, 0, "largest control body the node takes or sends"),
    Field("nodes", 16, 1, "engines behind this address"),
    Field("clock_ps", 32, 4000, "engine clock period in picoseconds"),
    Field("gpu_va_base", 64, 0, "GPU virtual address of page-table slot 0", hex=True),
    Field("mem_log2", 8, 32, "the memory port reaches addresses below 2**mem_log2"),
    Field("reserved", 8, 0, "zero"),
), "HELLO's response body")

PAIR_BYTES = 8
HEADER_BYTES = CONTROL.size
BODY_OFFSET = ETH_IP_UDP_BYTES + HEADER_BYTES
"""Where the body starts in an Ethernet frame (no VLAN tag, no IP options)."""


def max_body(max_frame: int) -> int:
    """Body bytes one frame of ``max_frame`` bytes (without FCS) carries."""
    return max_frame - BODY_OFFSET


MAX_BODY_1500 = max_body(1500 + 14)


def request_body_len(op: int, count: int) -> int:
    return {Op.CSR_WRITE: PAIR_BYTES * count, Op.MEM_WRITE: count}.get(op, 0)


def response_body_len(op: int, count: int) -> int:
    """Body of an OK response (an unknown op has none: it is answered BAD_OP)."""
    return {Op.HELLO: INFO.size, Op.CSR_READ: 4 * count, Op.MEM_READ: count}.get(op, 0)


def _op_name(op: int) -> str:
    return Op(op).name if op in Op._value2member_map_ else f"op {op:#x}"


@dataclass(frozen=True)
class Message:
    """A request or a response (``flags`` has RESPONSE), its body included."""

    op: int
    """An :class:`Op`, or the unknown value a BAD_OP answer echoes."""
    seq: int
    key: int = 0
    addr: int = 0
    count: int = 0
    status: Status = Status.OK
    flags: Flags = NO_FLAGS
    body: bytes = b""

    @property
    def response(self) -> bool:
        return Flags.RESPONSE in self.flags


def encode(msg: Message) -> bytes:
    _checked_body(msg)
    head = CONTROL.pack(op=int(msg.op), seq=msg.seq, key=msg.key, addr=msg.addr,
                        count=msg.count, status=int(msg.status), flags=int(msg.flags))
    return head + bytes(msg.body)


def decode(payload: bytes) -> Message:
    """A UDP payload as a :class:`Message`; :class:`MalformedHeaderError` names the
    field that is truncated, forbidden, or disagrees with the body's length."""
    v = CONTROL.unpack(payload)
    op = Op(v["op"]) if v["op"] in Op._value2member_map_ else v["op"]
    msg = Message(op, v["seq"], v["key"], v["addr"], v["count"], Status(v["status"]),
                  Flags(v["flags"]), bytes(payload[CONTROL.size:]))
    _checked_body(msg)
    return msg


def _checked_body(msg: Message) -> None:
    if msg.response:
        want = 0 if Flags.ERROR in msg.flags else response_body_len(msg.op, msg.count)
    else:
        want = request_body_len(msg.op, msg.count)
    if len(msg.body) != want:
        raise MalformedHeaderError(CONTROL.name, "count", f"{_op_name(msg.op)} count "
                                   f"{msg.count} needs a {want}-byte body, found {len(msg.body)}")


# Requests ---------------------------------------------------------------------------
def hello(seq: int, key: int) -> Message:
    return Message(Op.HELLO, seq, key)


def csr_read(seq: int, key: int, addr: int, n: int = 1) -> Message:
    return Message(Op.CSR_READ, seq, key, addr, n)


def csr_write(seq: int, key: int, writes) -> Message:
    body = b"".join(int(a).to_bytes(4, "big") + int(v).to_bytes(4, "big") for a, v in writes)
    return Message(Op.CSR_WRITE, seq, key, 0, len(body) // PAIR_BYTES, body=body)


def mem_read(seq: int, key: int, addr: int, n: int) -> Message:
    return Message(Op.MEM_READ, seq, key, addr, n)


def mem_write(seq: int, key: int, addr: int, data: bytes) -> Message:
    return Message(Op.MEM_WRITE, seq, key, addr, len(data), body=bytes(data))


def answer(req: Message, status: Status = Status.OK, body: bytes = b"") -> Message:
    """The response to ``req``: its op, seq, addr and count, key zero."""
    flags = Flags.RESPONSE | (Flags.ERROR if status != Status.OK else NO_FLAGS)
    return Message(req.op, req.seq, 0, req.addr, req.count, status, flags,
                   body if status == Status.OK else b"")


def pairs(body: bytes) -> list[tuple[int, int]]:
    """A CSR_WRITE body as (address, value) pairs."""
    return [(int.from_bytes(body[i:i + 4], "big"), int.from_bytes(body[i + 4:i + 8], "big"))
            for i in range(0, len(body), PAIR_BYTES)]


def words(body: bytes) -> list[int]:
    """A CSR_READ response body as register values."""
    return [int.from_bytes(body[i:i + 4], "big") for i in range(0, len(body), 4)]


def seq_behind(seq: int, last: int) -> bool:
    """``seq`` is older than ``last`` in 32-bit serial-number order."""
    return (seq - last) % (1 << 32) >= 1 << 31


def check(req: Message, *, body_max: int, mem_log2: int) -> Status:
    """What the node answers a well-formed request with the right key, before the
    idempotency slot: the first failing check, else OK."""
    if req.op not in Op._value2member_map_:
        return Status.BAD_OP
    if req.op == Op.HELLO:
        return Status.OK
    if req.count == 0 or max(request_body_len(req.op, req.count),
                             response_body_len(req.op, req.count)) > body_max:
        return Status.BAD_LENGTH
    if req.op == Op.CSR_READ:
        if req.addr % 4 or req.addr + 4 * req.count > 1 << CSR_ADDR_BITS:
            return Status.OUT_OF_RANGE
    elif req.op == Op.CSR_WRITE:
        if any(a % 4 or a >= 1 << CSR_ADDR_BITS for a, _ in pairs(req.body)):
            return Status.OUT_OF_RANGE
    elif req.addr + req.count > 1 << mem_log2:
        return Status.OUT_OF_RANGE
    return Status.OK


__all__ = ["BODY_OFFSET", "CONTROL", "CONTROL_PORT", "CSR_ADDR_BITS", "HEADER_BYTES",
           "INFO", "MAGIC", "MAX_BODY_1500", "NO_FLAGS", "PAIR_BYTES", "VERSION", "WRITES", "Flags",
           "Message", "Op", "Status", "answer", "check", "csr_read", "csr_write", "decode",
           "encode", "hello", "max_body", "mem_read", "mem_write", "pairs",
           "request_body_len", "response_body_len", "seq_behind", "words"]
